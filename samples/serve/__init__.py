"""The HTTP serving sample: the aiohttp server (`server`) and its command line (`launch`), the
request body (`params`), the bridges to a GptManager (`bridge`, its admission by load in
`load_admission`) or an Executor (`executor_bridge`), the Prometheus metrics (`metrics`); the
OpenAI-compatible endpoints (`openai_server`: errors and the model's description in
`openai_basics`, bodies in `openai_protocol`, chat messages and tools in `openai_chat`, choices in
`openai_choices`, text in `detokenizer`, token bytes in `token_bytes`, tool calls in `tool_calls`
and `tool_call_parser`, end ids and the grammar engine's tokenizer in `generation_config`); what a
router in front asks (`router_routes`) and the replicas behind vllm-router (`replicas`,
`bench_replicas`); client values in error messages (`value_repr`), the default model's tokenizer
(`default_tokenizer`) and the benchmark (`bench_openai`); `python -m samples.serve` runs it."""
