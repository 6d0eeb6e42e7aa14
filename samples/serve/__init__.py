"""The HTTP serving sample: the aiohttp server (`server`), the request body (`params`), the bridges
to a GptManager (`bridge`) or an Executor (`executor_bridge`), the Prometheus gauges (`metrics`);
`python -m samples.serve` runs it."""
