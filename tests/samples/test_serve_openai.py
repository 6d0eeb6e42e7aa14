"""samples.serve's OpenAI endpoints end to end: the official `openai` client (sync and async) against
the real server on a loopback port, over GptManager and the Executor, with a real byte-level BPE
tokenizer and a tiny model whose weights script its reply (scripted_model): exact texts, token
counts, log probs, stop strings across token boundaries, multi-byte characters streamed whole."""
from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import signal
import subprocess
import sys
import time

import aiohttp
import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from prometheus_client.parser import text_string_to_metric_families

from runtime import build_engine
from tests.samples.conftest import ServerThread, kv_of_bridge, run
from tests.samples.scripted_model import REPLY, Script, write_scripted_model, write_tokenizer

API_KEY = "test-key"
MODEL = "scripted"
MAX_BODY_BYTES = 64 << 10
MAX_SEQ_LEN = 1024
PROMPT = "Say:"            # ends with a token outside the reply: the reply starts at once
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Greet me 👋"}]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """(tokenizer, Script, engine dir)."""
    import transformers
    root = tmp_path_factory.mktemp("openai")
    write_tokenizer(str(root / "tokenizer"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(root / "tokenizer"), local_files_only=True)
    script = Script(tokenizer)
    write_scripted_model(str(root / "hf"), script)
    build_engine(root / "hf", root / "engine", tokens_per_block=8, max_batch_size=16, max_input_len=256,
                 max_seq_len=MAX_SEQ_LEN, max_num_tokens=512)
    return tokenizer, script, str(root / "engine")


@pytest.fixture(scope="module", params=["gpt_manager", "executor"])
def server(scripted, request):
    from samples.serve.server import model_info
    tokenizer, _, engine_dir = scripted
    s = ServerThread(engine_dir, tokenizer, api=request.param, model_info=model_info(engine_dir, tokenizer, MODEL),
                     api_key=API_KEY, max_body_bytes=MAX_BODY_BYTES)
    yield s
    s.stop()


def client(server, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kwargs.pop("api_key", API_KEY), max_retries=0,
                         timeout=30, **kwargs)


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)


def chat_prompt_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def assert_idle(server) -> None:
    """Nothing running or waiting, every KV block free again (within a few seconds)."""
    deadline = time.monotonic() + 5
    while (server.bridge.num_active_requests() or server.bridge.num_waiting_handlers()) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.bridge.num_active_requests() == 0 and server.bridge.num_waiting_handlers() == 0
    kv = kv_of_bridge(server.bridge)
    assert kv.num_free_blocks == kv.num_blocks


# -- completions and chat, not streamed ----------------------------------------------------------------


def test_models(server):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert c.models.retrieve(MODEL).owned_by == "batch_manager"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")


def test_completion_greedy_text_usage_and_finish(server, scripted):
    tokenizer, script, _ = scripted
    out = client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL and len(out.choices) == 1
    assert out.choices[0].text == script.text(script.greedy_ids()) == REPLY + "."
    assert out.choices[0].finish_reason == "stop"   # the end token, not output nor counted
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == len(script.greedy_ids())
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_length_and_token_id_prompts(server, scripted):
    """max_tokens ends it ("length"), inside a character: the unfinished bytes are U+FFFD, as the
    tokenizer decodes them. A batch of token-id prompts: a choice per prompt, in order."""
    _, script, _ = scripted
    prompts = [[40, 41, 42], [43, 44]]
    assert not {42, 44} & set(script.greedy_ids())   # prompts ending outside the chain: the reply comes
    out = client(server).completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        assert choice.text == script.text(script.reply_ids[:5]) and choice.text.endswith("\ufffd")
        assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 10


def test_chat_uses_the_tokenizers_template(server, scripted):
    tokenizer, script, _ = scripted
    out = client(server).chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == REPLY + "."
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens == len(chat_prompt_ids(tokenizer))
    assert out.usage.completion_tokens == len(script.greedy_ids())


def test_n_choices_are_the_requests_of_seed_plus_i(server, scripted):
    """n = 4 sampled choices; choice i is what a single request with seed 7 + i gets; they differ
    in the branch token (each of the two is drawn with probability 1/2)."""
    c = client(server)
    out = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, n=4, seed=7)
    assert [choice.index for choice in out.choices] == [0, 1, 2, 3]
    texts = [choice.text for choice in out.choices]
    assert {t[-1] for t in texts} == {".", "?"} and all(t[:-1] == REPLY for t in texts)
    for i, text in enumerate(texts):
        single = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, seed=7 + i)
        assert single.choices[0].text == text, i
    assert out.usage.completion_tokens == 4 * len(scripted[1].greedy_ids())
    assert out.usage.prompt_tokens == single.usage.prompt_tokens   # the prompt counts once


def test_log_probs_of_the_sampled_tokens(server, scripted):
    """Scripted tokens have probability ~1 (log prob ~0); the branch token 1/2 (log 0.5)."""
    tokenizer, script, _ = scripted
    out = client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, logprobs=0, seed=1)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens == len(script.greedy_ids())
    assert lp.tokens == [tokenizer.decode([t]) for t in script.reply_ids] + [out.choices[0].text[-1]]
    assert all(abs(x) < 1e-4 for x in lp.token_logprobs[:-1])
    assert lp.token_logprobs[-1] == pytest.approx(math.log(0.5), abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len(REPLY) and lp.top_logprobs is None
    chat = client(server).chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=0,
                                                  seed=1)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert content[-1].logprob == pytest.approx(math.log(0.5), abs=1e-4) and content[-1].top_logprobs == []


@pytest.mark.parametrize("stop, expected", [
    ("字 😀", "Hello 漢"),                 # across the byte tokens of two characters
    (["zz", "ld!"], "Hello 漢字 😀 wor"),   # across 'ld' and '!'; the first stop never occurs
    ("o 漢字", "Hell"),
    ("!.", "Hello 漢字 😀 world"),           # matches only once the branch token '.' comes
])
def test_stop_strings_across_tokens(server, scripted, stop, expected):
    _, script, _ = scripted
    text = REPLY + "."
    num_tokens = next(n for n in range(1, len(script.greedy_ids()) + 1)
                      if any(s in script.text(script.greedy_ids()[:n]) for s in ([stop] if isinstance(stop, str)
                                                                                   else stop)))
    c = client(server)
    out = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop)
    assert out.choices[0].text == expected and expected in text
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == num_tokens   # up to the token that completed the stop string
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected
    assert chunks[-1].usage.completion_tokens == num_tokens
    assert_idle(server)


# -- streaming ---------------------------------------------------------------------------------------------


def test_streamed_completion_keeps_multibyte_characters_whole(server, scripted):
    """Every chunk's text is whole characters (no U+FFFD: the reply's CJK and emoji come as 3 and 4
    byte tokens); their concatenation is the reply; usage comes last, alone."""
    _, script, _ = scripted
    chunks = list(client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert "".join(texts) == REPLY + "." and not any("\ufffd" in t for t in texts)
    assert " 漢" in texts and "字" in texts and " 😀" in texts   # held back until whole, then sent at once
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finals[-1] == "stop" and not any(finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(script.greedy_ids())
    assert all(ch.usage is None for ch in chunks[:-1])


def test_streamed_chat_async_client(server, scripted):
    tokenizer, script, _ = scripted

    async def stream_chat():
        async with async_client(server) as c:
            stream = await c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, stream=True,
                                                     stream_options={"include_usage": True})
            return [chunk async for chunk in stream]

    chunks = run(stream_chat)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == REPLY + "."
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].usage.prompt_tokens == len(chat_prompt_ids(tokenizer))
    assert chunks[-1].usage.completion_tokens == len(script.greedy_ids())


def test_async_concurrent_n_streams(server):
    """Several streamed requests with n = 3 at once: every choice ends, each with the reply."""
    async def many():
        async with async_client(server) as c:
            async def one(seed):
                stream = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, n=3, seed=seed,
                                                    stream=True)
                texts = {}
                async for chunk in stream:
                    for choice in chunk.choices:
                        texts[choice.index] = texts.get(choice.index, "") + choice.text
                return texts
            return await asyncio.gather(*(one(seed) for seed in range(6)))

    for texts in run(many):
        assert sorted(texts) == [0, 1, 2] and all(t[:-1] == REPLY and t[-1] in ".?" for t in texts.values())
    assert_idle(server)


def test_disconnect_mid_stream_frees_the_request(server):
    """A client that goes away after the first chunk of a long generation (no end token, 900
    tokens) stops it long before its end: its blocks are free again."""
    metrics = server.bridge.metrics
    start_iteration = metrics.last_stats.get("Iteration Counter", 0)

    async def read_one_chunk_and_leave():
        async with async_client(server) as c:
            stream = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=900, stream=True,
                                                extra_body={"ignore_eos": True})
            async for _ in stream:
                break
            await stream.close()

    run(read_one_chunk_and_leave)
    assert_idle(server)
    assert metrics.last_stats["Iteration Counter"] - start_iteration < 600


# -- errors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, param, words", [
    ({"temperature": 3.0}, "temperature", "[0.0, 2.0]"),
    ({"n": 0}, "n", "[1, 128]"),
    ({"max_tokens": 0}, "max_tokens", "[1,"),
    ({"stop": ""}, "stop", "empty"),
    ({"logprobs": 2}, "logprobs", "top log probs are not supported"),
    ({"prompt": []}, "prompt", "non-empty"),
    ({"prompt": [5, 300]}, "prompt[1]", "[0, 299]"),
    ({"prompt": "x" * 300}, "prompt", "max_input_len"),                 # the engine's limit, by its field
    ({"max_tokens": 2000}, "max_tokens", "context of 1024"),             # prompt + max_tokens over max_seq_len
    ({"extra_body": {"echo": True}}, "echo", "not supported"),
    ({"extra_body": {"colour": 1}}, "colour", "unknown field"),
    ({"extra_body": {"logit_bias": {"301": 5}}}, "logit_bias", "token id"),
    ({"stream": True, "logprobs": 1}, "logprobs", "top log probs"),     # refused before any event is sent
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
    ({"logprobs": True, "top_logprobs": 3}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
])
def test_bad_chat_requests_are_400(server, kwargs, param):
    body = {"model": MODEL, "messages": MESSAGES, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(**body)
    assert e.value.body["param"] == param, e.value.body


async def raw_post(url: str, path: str, data: bytes, key: str | None = API_KEY) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.post(url + path, data=data, headers=headers) as response:
            return response.status, json.loads(await response.read())


def assert_error_shape(body: dict, status_type: str) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == status_type and body["error"]["message"]


def test_error_statuses_and_shape(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError) as e:   # another model: 404
        c.completions.create(model="gpt-4", prompt=PROMPT)
    assert e.value.body["code"] == "model_not_found"
    status, body = run(raw_post, server.url, "/v1/embeddings", b"{}")   # no such endpoint: 404, same shape
    assert status == 404
    assert_error_shape(body, "not_found_error")
    status, body = run(raw_post, server.url, "/v1/completions", b"{not json")
    assert status == 400 and body["error"]["param"] == "body"
    assert_error_shape(body, "invalid_request_error")
    big = json.dumps({"model": MODEL, "prompt": "x" * MAX_BODY_BYTES}).encode()
    status, body = run(raw_post, server.url, "/v1/completions", big)   # over the body limit: 413
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert_error_shape(body, "invalid_request_error")


@pytest.fixture
def full_queue(server):
    """Every submit refused as the queue-full path does (the bound set to 0 for the test)."""
    if hasattr(server.bridge, "executor"):
        queue = server.bridge.executor._front_end.requests   # internal: the Executor's bounded queue
        saved, queue.max_size = queue.max_size, 0
        yield
        queue.max_size = saved
    else:
        saved, server.bridge.max_queue_size = server.bridge.max_queue_size, 0
        yield
        server.bridge.max_queue_size = saved


def test_queue_full_is_429(server, full_queue):
    with pytest.raises(openai.RateLimitError) as e:
        client(server).completions.create(model=MODEL, prompt=PROMPT, n=2)
    assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
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
    status, body = run(raw_post, server.url, "/v1/completions", b"{}", None)
    assert status == 401 and "missing API key" in body["error"]["message"]
    status, body = run(raw_post, server.url, "/generate", b'{"input_ids": [5]}', None)   # the sample's own too
    assert status == 401
    status, body = run(raw_post, server.url, "/generate", b'{"input_ids": [5], "max_new_tokens": 2}')
    assert status == 200 and len(body["output_ids"]) == 2

    async def health():
        async with aiohttp.ClientSession() as session, session.get(server.url + "/health") as response:
            return response.status
    assert run(health) == 200   # health and metrics stay open


# -- metrics -----------------------------------------------------------------------------------------------


def scrape(server) -> dict[str, float]:
    async def get():
        async with aiohttp.ClientSession() as session, session.get(server.url + "/metrics") as response:
            return await response.text()
    return {s.name: s.value for family in text_string_to_metric_families(run(get)) for s in family.samples
            if not s.labels.get("le")}


def test_metrics_histograms_and_counters_move(server, scripted):
    tokenizer, script, _ = scripted
    before = scrape(server)
    out = client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, n=2)
    after = scrape(server)

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    num_tokens = len(script.greedy_ids())
    assert out.usage.completion_tokens == 2 * num_tokens
    assert moved("nv_trt_llm_time_to_first_token_seconds_count") == 2
    assert moved("nv_trt_llm_e2e_request_latency_seconds_count") == 2
    assert moved("nv_trt_llm_inter_token_latency_seconds_count") == 2 * (num_tokens - 1)
    assert moved("nv_trt_llm_generation_tokens_total") == 2 * num_tokens
    assert moved("nv_trt_llm_prompt_tokens_total") == 2 * len(tokenizer.encode(PROMPT))
    assert moved("nv_trt_llm_time_to_first_token_seconds_sum") > 0
    assert moved("nv_trt_llm_e2e_request_latency_seconds_sum") >= moved("nv_trt_llm_time_to_first_token_seconds_sum")


# -- the sample's own endpoint, the command line ---------------------------------------------------------


def test_generate_streams_whole_characters_too(server):
    async def stream():
        headers = {"Authorization": f"Bearer {API_KEY}"}
        body = {"text": PROMPT, "max_new_tokens": 40, "stream": True}
        async with aiohttp.ClientSession() as session, \
                session.post(server.url + "/generate", json=body, headers=headers) as response:
            return [json.loads(line[6:]) async for line in response.content if line.startswith(b"data: ")]

    texts = [event["text"] for event in run(stream)]
    assert "".join(texts).startswith(REPLY) and not any("\ufffd" in t for t in texts)


@pytest.mark.parametrize("api_key, host, bound, words", [
    (None, None, "127.0.0.1", "loopback only"),
    (None, "0.0.0.0", "0.0.0.0", "anyone who can reach"),
    (None, "::1", "::1", "listening on ::1"),
    ("k", None, "0.0.0.0", "API key set"),
    ("k", "127.0.0.1", "127.0.0.1", "API key set"),
])
def test_host_follows_the_api_key(api_key, host, bound, words):
    from samples.serve.server import parse_args, resolve_host
    argv = (["--host", host] if host else []) + (["--api-key", api_key] if api_key else [])
    args = parse_args(argv)
    args.api_key = api_key   # not from the environment
    got_host, notice = resolve_host(args)
    assert got_host == bound and words in notice


def test_cli_with_the_key_from_the_environment(scripted):
    tokenizer_dir, engine_dir = scripted[0].name_or_path, scripted[2]
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": repo_root, "BATCH_MANAGER_API_KEY": "env-key"}
    proc = subprocess.Popen([sys.executable, "-m", "samples.serve", "--engine-dir", engine_dir, "--tokenizer",
                             tokenizer_dir, "--host", "127.0.0.1", "--port", "0", "--served-model-name",
                             MODEL, "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=repo_root)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), line
        url = line.split()[-1]
        c = openai.OpenAI(base_url=url + "/v1", api_key="env-key", max_retries=0, timeout=30)
        out = c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=3)
        assert out.choices[0].message.content == "Hello" and out.choices[0].finish_reason == "length"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="other", max_retries=0).models.list()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "API key set" in proc.stderr.read()
    finally:
        proc.kill()


# -- fuzz ----------------------------------------------------------------------------------------------------

junk = (st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=6)
        | st.lists(st.integers(-5, 400), max_size=4) | st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
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
        status, text = run(raw_exchange, server.url, path, json.dumps(body).encode())
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


async def raw_exchange(url: str, path: str, data: bytes) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.post(url + path, data=data, headers=headers) as response:
            return response.status, await response.text()


def test_bench_openai_runs_both_endpoints_on_the_same_samples(scripted):
    """The benchmark script end to end (its own server process), offline, tiny: both endpoints
    return every requested token."""
    from samples.serve import bench_openai
    tokenizer, _, engine_dir = scripted
    report = bench_openai.main(["--engine-dir", engine_dir, "--tokenizer", tokenizer.name_or_path,
                                "--num-samples", "3", "--prompt-len", "constant:4", "--output-len", "constant:5",
                                "--request-rate", "0", "--warm-up", "1", "--no-progress"])
    for endpoint in ("openai", "generate"):
        assert report[endpoint]["num_error_samples"] == 0 and report[endpoint]["num_output_tokens"] == 15, report
        assert report[endpoint]["p50_time_to_first_token(ms)"] > 0
