"""samples.serve's OpenAI endpoints refuse what they cannot serve, in OpenAI's error shape: 400
naming the field, 401 without the key, 404 for another model or path, 413 past the body limit, 429
when the queue is full, 503 while shutting down; fuzzed bodies never get a 5xx or leave a request
behind. The official `openai` client and raw HTTP, over GptManager and the Executor."""
from __future__ import annotations

import collections
import json

import aiohttp
import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.samples.conftest import run
from tests.samples.openai_client import (API_KEY, MAX_BODY_BYTES, MESSAGES, MODEL, PROMPT, assert_idle, client,
                                         raw_post, start_server)
from tests.samples.scripted_model import MAX_SEQ_LEN


@pytest.fixture(scope="module", params=["gpt_manager", "executor"])
def server(scripted, request):
    s = start_server(scripted, request.param)
    yield s
    s.stop()


# -- errors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, param, words", [
    ({"temperature": 3.0}, "temperature", "[0.0, 2.0]"),
    ({"n": 0}, "n", "[1, 128]"),
    ({"max_tokens": 0}, "max_tokens", "[1,"),
    ({"stop": ""}, "stop", "empty"),
    ({"logprobs": 6}, "logprobs", "[0, 5]"),
    ({"prompt": []}, "prompt", "non-empty"),
    ({"prompt": [5, 300]}, "prompt[1]", "[0, 299]"),
    ({"prompt": "x" * 300}, "prompt", "max_input_len"),                 # the engine's limit, by its field
    ({"max_tokens": 2000}, "max_tokens", f"context of {MAX_SEQ_LEN}"),             # prompt + max_tokens over max_seq_len
    ({"extra_body": {"echo": True}, "logprobs": 1}, "echo", "prompt's log probs are not supported"),
    ({"extra_body": {"echo": 1}}, "echo", "true or false"),
    ({"extra_body": {"colour": 1}}, "colour", "unknown field"),
    ({"extra_body": {"logit_bias": {"301": 5}}}, "logit_bias", "token id"),
    ({"extra_body": {"logit_bias": {"1" * 5000: 5}}}, "logit_bias", "token id"),   # over int()'s digit limit
    ({"stream": True, "logprobs": -1}, "logprobs", "[0, 5]"),        # refused before any event is sent
])
def test_bad_completion_requests_are_400_naming_the_field(server, kwargs, param, words):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client(server).completions.create(**body)
    error = e.value.body
    assert e.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"].startswith(param + ":") and words in error["message"]
    assert_idle(server)


@pytest.mark.parametrize("kwargs, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),   # no grammar engine here
    ({"tool_choice": "required"}, "tool_choice"),   # without tools
    ({"tools": [{"type": "function", "function": {"name": "f g"}}], "tool_choice": "none"}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "1"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": "f"}]}]}, "messages[0].tool_calls[0]"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
])
def test_bad_chat_requests_are_400(server, kwargs, param):
    body = {"model": MODEL, "messages": MESSAGES, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(**body)
    assert e.value.body["param"] == param, e.value.body


NESTED = b"[" * 1000 + b"]" * 1000   # within orjson's depth limit, past what repr() recurses into


@pytest.mark.parametrize("path, field, raw, param", [
    ("/v1/completions", "prompt", NESTED, "prompt[0][0]"),
    ("/v1/completions", "temperature", NESTED, "temperature"),
    ("/v1/completions", "stop", NESTED, "stop[0]"),
    ("/v1/completions", "seed", b"1" * 30, "seed"),                 # past 64 bits: orjson makes it a float
    ("/v1/completions", "best_of", b"true", "best_of"),            # true == 1 == n
    ("/v1/chat/completions", "messages", b'[{"role": ' + NESTED + b', "content": "hi"}]', "messages[0].role"),
    ("/v1/chat/completions", "messages", b'[{"role": ["user"], "content": "hi"}]', "messages[0].role"),
    ("/v1/chat/completions", "logprobs", b"0", "logprobs"),
])
def test_values_python_cannot_convert_or_show_are_400_naming_the_field(server, path, field, raw, param):
    body = {"model": MODEL, "max_tokens": 2, **({"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT})}
    data = json.dumps(body | {field: "VALUE"}).encode().replace(b'"VALUE"', raw)
    status, answer = post_json(server, path, data)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert_idle(server)


def post_json(server, path: str, data: bytes, key: str | None = API_KEY) -> tuple[int, dict]:
    status, text = run(raw_post, server.url, path, data, key)
    return status, json.loads(text)


def assert_error_shape(body: dict, status_type: str) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == status_type and body["error"]["message"]


def test_error_statuses_and_shape(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError) as e:   # another model: 404
        c.completions.create(model="gpt-4", prompt=PROMPT)
    assert e.value.body["code"] == "model_not_found"
    status, body = post_json(server, "/v1/embeddings", b"{}")   # no such endpoint: 404, same shape
    assert status == 404
    assert_error_shape(body, "not_found_error")
    status, body = post_json(server, "/v1/completions", b"{not json")
    assert status == 400 and body["error"]["param"] == "body"
    assert_error_shape(body, "invalid_request_error")
    big = json.dumps({"model": MODEL, "prompt": "x" * MAX_BODY_BYTES}).encode()
    status, body = post_json(server, "/v1/completions", big)   # over the body limit: 413
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert_error_shape(body, "invalid_request_error")


@pytest.fixture
def full_queue(server):
    """Every submit refused as the queue-full path does (the bound set to 0 for the test)."""
    if hasattr(server.bridge, "executor"):
        queue = server.bridge.executor.front_end.requests   # the Executor's bounded queue
        saved, queue.max_size = queue.max_size, 0
        yield
        queue.max_size = saved
    else:
        admission = server.bridge.admission   # internal: the GptManager bridge's bounds
        saved, admission.max_queue_size = admission.max_queue_size, 0
        yield
        admission.max_queue_size = saved


def test_queue_full_is_429(server, full_queue):
    with pytest.raises(openai.RateLimitError) as e:
        client(server).completions.create(model=MODEL, prompt=PROMPT, n=2)
    assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
    assert int(e.value.response.headers["Retry-After"]) >= 1
    assert_error_shape({"error": e.value.body}, "rate_limit_error")
    assert server.bridge.num_waiting_handlers() == 0


def test_shutting_down_is_503(server):
    server.bridge.is_closed = True   # what close() sets first
    try:
        with pytest.raises(openai.InternalServerError) as e:
            client(server).chat.completions.create(model=MODEL, messages=MESSAGES)
        assert e.value.status_code == 503 and e.value.body["code"] == "shutting_down"
    finally:
        server.bridge.is_closed = False


def test_api_key(server):
    with pytest.raises(openai.AuthenticationError) as e:
        client(server, api_key="wrong").completions.create(model=MODEL, prompt=PROMPT)
    assert e.value.body["code"] == "invalid_api_key"
    status, body = post_json(server, "/v1/completions", b"{}", None)
    assert status == 401 and "missing API key" in body["error"]["message"]
    status, body = post_json(server, "/generate", b'{"input_ids": [5]}', None)   # the sample's own too
    assert status == 401
    status, body = post_json(server, "/generate", b'{"input_ids": [5], "max_new_tokens": 2}')
    assert status == 200 and len(body["output_ids"]) == 2

    async def health():
        async with aiohttp.ClientSession() as session, session.get(server.url + "/health") as response:
            return response.status
    assert run(health) == 200   # health and metrics stay open

# -- fuzz ----------------------------------------------------------------------------------------------------

EDGE_KEYS = ["1" * 5000, "0" * 30 + "1", "-1", "1e3", "٣"]   # no token ids; int() refuses the first
junk = (st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=6)
        | st.lists(st.integers(-5, 400), max_size=4) | st.dictionaries(st.text(max_size=4), st.integers(), max_size=2)
        | st.dictionaries(st.sampled_from(EDGE_KEYS), st.integers(-5, 5), min_size=1, max_size=2))
VALID_FIELDS = {
    "max_tokens": st.integers(1, 6), "temperature": st.floats(0.0, 2.0), "top_p": st.floats(0.0, 1.0),
    "seed": st.integers(-(1 << 63), (1 << 64) - 1), "n": st.integers(1, 3), "stream": st.booleans(),
    "stop": st.sampled_from(["lo", "字 😀", ["zz", "!"], "\u00e9"]), "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0), "logit_bias": st.dictionaries(
        st.integers(0, 299).map(str), st.floats(-100.0, 100.0), max_size=3), "user": st.text(max_size=5),
    "top_k": st.integers(-1, 20), "min_tokens": st.integers(0, 3), "ignore_eos": st.booleans(),
}
PROMPTS = (st.text(max_size=12) | st.lists(st.integers(0, 299), min_size=1, max_size=8)
           | st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=2))
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=8)})


@st.composite
def openai_bodies(draw) -> tuple[str, dict]:
    is_chat = draw(st.booleans())
    body = {"model": MODEL if draw(st.integers(0, 9)) else draw(st.text(max_size=5))}
    if is_chat:
        body["messages"] = draw(st.lists(MESSAGE, min_size=1, max_size=3) if draw(st.integers(0, 5)) else junk)
        if draw(st.booleans()):
            body["logprobs"] = draw(st.booleans())
    else:
        body["prompt"] = draw(PROMPTS if draw(st.integers(0, 5)) else junk)
        if draw(st.booleans()):
            body["logprobs"] = draw(st.integers(0, 1) | junk)
    for field in draw(st.lists(st.sampled_from(sorted(VALID_FIELDS)), max_size=4)):
        body[field] = draw(VALID_FIELDS[field] if draw(st.integers(0, 4)) else junk)
    body.setdefault("max_tokens", 4)
    if body.get("stream") is True and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(min_size=1, max_size=5))] = draw(junk)
    return ("/v1/chat/completions" if is_chat else "/v1/completions"), body


def test_fuzzed_openai_bodies_get_200_or_a_shaped_4xx(server):
    statuses = collections.Counter()

    @settings(max_examples=80, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(openai_bodies())
    def check(path_body):
        path, body = path_body
        status, text = run(raw_post, server.url, path, json.dumps(body).encode())
        assert status in (200, 400, 404), (status, text, body)
        if status != 200:
            error = json.loads(text)["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        elif body.get("stream") is True:
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and not any('"error"' in e[:10] for e in events), text
        else:
            assert all(c["finish_reason"] in ("stop", "length") for c in json.loads(text)["choices"]), text
        assert_idle(server)
        statuses[status] += 1

    check()
    assert statuses[200] >= 10 and statuses[400] >= 10, statuses


@pytest.mark.parametrize("api", ["gpt_manager", "executor"])
def test_the_engines_own_refusals_name_the_openai_field_on_both_bridges(scripted, api):
    """A server told the engine holds 64 samples per request, over an engine of max_batch_size 16:
    the engine refuses n = 17 itself, and both bridges name `n` (GptManager's admission error once
    named its own prefix)."""
    import dataclasses
    from samples.serve.launch import model_info
    from tests.samples.conftest import ServerThread
    tokenizer, _, engine_dir = scripted
    info = dataclasses.replace(model_info(engine_dir, tokenizer, MODEL), max_samples_per_request=64)
    s = ServerThread(engine_dir, tokenizer, api=api, model_info=info, api_key=API_KEY)
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client(s).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=17)
        assert e.value.body["param"] == "n" and e.value.body["message"].startswith("n: ")
        assert "max_batch_size 16" in e.value.body["message"]
        assert_idle(s)
    finally:
        s.stop()
