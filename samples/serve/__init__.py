"""The HTTP serving sample: the aiohttp server (`server`), the request body (`params`), the bridges
to a GptManager (`bridge`, its admission by load in `load_admission`) or an Executor
(`executor_bridge`), the Prometheus metrics (`metrics`); the OpenAI-compatible endpoints
(`openai_server`: bodies in `openai_protocol`, choices in `openai_choices`, text in
`detokenizer`, token bytes in `token_bytes`, tool calls in `tool_calls` and `tool_call_parser`,
end ids and the grammar engine's tokenizer in `generation_config`), client values in error
messages (`value_repr`), the
default model's tokenizer (`default_tokenizer`) and their benchmark (`bench_openai`);
`python -m samples.serve` runs it."""
