"""KV leaving the engine: disaggregated transfer (wire, server, fetch, hand-off) and KV-cache events."""
