"""Paged KV-cache bookkeeping in plain Python: blocks, reuse and eviction (`kv_cache_manager`), beams' copy-on-write blocks (`beam_blocks`)."""
