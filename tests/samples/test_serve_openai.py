"""samples.serve's OpenAI endpoints end to end: the official `openai` client (sync and async) against
the real server on a loopback port, over GptManager and the Executor, with a real byte-level BPE
tokenizer and a tiny model whose weights script its reply (scripted_model): exact texts, token
counts, log probs, stop strings across token boundaries, multi-byte characters streamed whole,
disconnects, the latency metrics, the command line and the benchmark script."""
from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.samples.conftest import run
from tests.samples.openai_client import (API_KEY, MESSAGES, MODEL, PROMPT, assert_idle, async_client,
                                         chat_prompt_ids, client, start_server)
from tests.samples.scripted_model import REPLY


@pytest.fixture(scope="module", params=["gpt_manager", "executor"])
def server(scripted, request):
    s = start_server(scripted, request.param)
    yield s
    s.stop()


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
    """Scripted tokens have probability ~1 (log prob ~0); the branch token 1/2 (log 0.5). Token
    strings never split a character (a token ending inside one has "", the next the whole
    character): joined they are the text; chat's `bytes` are each token's own, joined the UTF-8."""
    tokenizer, script, _ = scripted
    out = client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, logprobs=0, seed=1)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens == len(script.greedy_ids())
    assert "".join(lp.tokens) == out.choices[0].text and not any("\ufffd" in t for t in lp.tokens)
    assert "" in lp.tokens   # the reply's multi-byte characters span tokens
    assert all(abs(x) < 1e-4 for x in lp.token_logprobs[:-1])
    assert lp.token_logprobs[-1] == pytest.approx(math.log(0.5), abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len(REPLY) and lp.top_logprobs is None
    chat = client(server).chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=0,
                                                  seed=1)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    assert bytes(b for e in content for b in e.bytes).decode("utf-8") == chat.choices[0].message.content
    assert content[-1].logprob == pytest.approx(math.log(0.5), abs=1e-4) and content[-1].top_logprobs == []


@pytest.mark.parametrize("stream", [False, True])
def test_top_log_probs_are_the_models_own(server, scripted, stream):
    """The engine's num_top_log_probs: the scripted token leads with log prob ~0; at the two-way
    branch the two successors share log 0.5 each."""
    def completions():
        kw = dict(model=MODEL, prompt=PROMPT, max_tokens=40, logprobs=2, seed=1)
        if not stream:
            return [client(server).completions.create(**kw).choices[0].logprobs]
        return [c.choices[0].logprobs for c in client(server).completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs]

    parts = completions()
    tokens = [t for lp in parts for t in lp.tokens]
    tops = [t for lp in parts for t in lp.top_logprobs]
    assert len(tops) == len(tokens) and all(len(t) == 2 for t in tops)
    for token, top in zip(tokens[:-1], tops[:-1]):
        assert token in top and top[token] == pytest.approx(0.0, abs=1e-4)
    assert sorted(tops[-1].values()) == pytest.approx([math.log(0.5)] * 2, abs=1e-4)
    chat = client(server).chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=3,
                                                  seed=1)
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-4)
        top = entry.top_logprobs[0]
        assert top.bytes == list(top.token.encode("utf-8")) or top.token == "bytes:" + "".join(
            f"\\x{b:02x}" for b in top.bytes) or top.token == entry.token   # (the sampled one: as `token`)


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
    from samples.serve.launch import parse_args, resolve_host
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


def test_n_up_to_the_advertised_128_is_served_over_several_engine_requests(server, scripted):
    """The engine holds 16 samples per request here (its max_batch_size): n = 128 is 8 requests of
    16 samples, every choice the sample its seed draws."""
    c = client(server)
    out = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=128, seed=11)
    assert [choice.index for choice in out.choices] == list(range(128))
    assert out.usage.completion_tokens == 128 * 2
    for i in (0, 16, 127):   # the first of a request, and the last choice
        single = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, seed=11 + i)
        assert single.choices[0].text == out.choices[i].text, i
    assert_idle(server)


@pytest.mark.parametrize("stream", [False, True])
def test_log_prob_tokens_join_to_a_text_that_ends_inside_a_character(server, scripted, stream):
    """max_tokens cuts the reply inside a multi-byte character: the text ends in U+FFFD, and so do
    the joined token strings (the last token's string carries it)."""
    tokenizer, script, _ = scripted
    ids = script.greedy_ids()
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=cut, logprobs=0, seed=1)
    if stream:
        chunks = [c for c in client(server).completions.create(stream=True, **kw) if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    else:
        choice = client(server).completions.create(**kw).choices[0]
        text, tokens = choice.text, choice.logprobs.tokens
    assert text.endswith("\ufffd") and len(tokens) == cut and "".join(tokens) == text
