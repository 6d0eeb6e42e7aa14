"""The HTTP serving sample: the aiohttp server (`server`), the request body (`params`), the bridges
to a GptManager (`bridge`) or an Executor (`executor_bridge`), the Prometheus metrics (`metrics`);
the OpenAI-compatible endpoints (`openai_server`: bodies in `openai_protocol`, choices in
`openai_choices`, text in `detokenizer`), client values in error messages (`value_repr`), the
default model's tokenizer (`default_tokenizer`) and their benchmark (`bench_openai`);
`python -m samples.serve` runs it."""
