"""samples.serve end to end: the real aiohttp server on a loopback port, a real HTTP client."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from samples.serve.metrics import TritonMetrics
from samples.serve.executor_bridge import ExecutorBridge
from tests.samples.conftest import ServerThread, greedy_reference, kv_of_bridge, run

PROMPTS = [[random.Random(i).randrange(3, 128) for _ in range(random.Random(i).randrange(3, 30))] for i in range(12)]


async def post(url: str, body, timeout_s: float = 30.0) -> tuple[int, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        async with session.post(url + "/generate", data=data) as response:
            return response.status, await response.json()


async def post_stream(url: str, body) -> tuple[int, str, list[dict]]:
    """(status, content type, the SSE events' JSON bodies)."""
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/generate", json={**body, "stream": True}) as response:
            if response.status != 200:
                return response.status, response.content_type, [await response.json()]
            events = []
            async for line in response.content:
                if line.startswith(b"data: "):
                    events.append(json.loads(line[6:]))
            return response.status, response.content_type, events


async def get(url: str, path: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + path) as response:
            return response.status, await response.text()


async def post_raw(url: str, data: str) -> tuple[int, str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.post(url + "/generate", data=data.encode("utf-8", "surrogatepass")) as response:
            return response.status, await response.text()


def num_waiting(url: str) -> int:
    status, text = run(get, url, "/health")
    assert status == 200, text
    return json.loads(text)["waiting_requests"]


def test_health(server):
    status, text = run(get, server.url, "/health")
    assert status == 200
    assert json.loads(text) == {"status": "ok", "active_requests": 0, "waiting_requests": 0}


def test_generate_json_matches_transformers(server, tiny_model_dirs):
    status, body = run(post, server.url, {"input_ids": PROMPTS[0], "max_new_tokens": 6})
    assert status == 200, body
    assert body["output_ids"] == greedy_reference(tiny_model_dirs[2], PROMPTS[0], 6)
    assert body["num_output_tokens"] == 6 and body["is_final"]
    assert body["text"] == " ".join(f"t{t}" for t in body["output_ids"] if t >= 3)


def test_streaming_sse(server, tiny_model_dirs):
    status, content_type, events = run(post_stream, server.url, {"input_ids": PROMPTS[1], "max_new_tokens": 7})
    assert status == 200 and content_type == "text/event-stream"
    assert len(events) > 1 and events[-1]["is_final"] and not any(e["is_final"] for e in events[:-1])
    tokens = [t for e in events for t in e["output_ids"]]
    assert tokens == greedy_reference(tiny_model_dirs[2], PROMPTS[1], 7)
    assert "".join(e["text"] for e in events).split() == [f"t{t}" for t in tokens if t >= 3]


def test_text_prompt(server, tiny_model_dirs):
    status, body = run(post, server.url, {"text": "t5 t6 t7 t8", "max_new_tokens": 4})
    assert status == 200, body
    assert body["output_ids"] == greedy_reference(tiny_model_dirs[2], [5, 6, 7, 8], 4)


def test_concurrent_requests(server, tiny_model_dirs):
    """More requests than max_batch_size (8), half streamed, all at once: each gets its own tokens."""
    async def all_requests():
        calls = [post_stream(server.url, {"input_ids": p, "max_new_tokens": 5}) if i % 2 else
                 post(server.url, {"input_ids": p, "max_new_tokens": 5}) for i, p in enumerate(PROMPTS)]
        return await asyncio.gather(*calls)

    results = run(all_requests)
    for i, (prompt, result) in enumerate(zip(PROMPTS, results)):
        tokens = [t for e in result[2] for t in e["output_ids"]] if i % 2 else result[1]["output_ids"]
        assert tokens == greedy_reference(tiny_model_dirs[2], prompt, 5), i
    assert server.bridge.num_active_requests() == 0


def test_sampling_options_reach_the_request(server):
    """Seeded top-k sampling with log probs: the same seed gives the same tokens."""
    body = {"input_ids": PROMPTS[4], "max_new_tokens": 6, "top_k": 5, "temperature": 0.8, "seed": 3,
            "return_log_probs": True}
    (status_a, a), (status_b, b) = run(post, server.url, body), run(post, server.url, body)
    assert status_a == status_b == 200, (a, b)
    assert a["output_ids"] == b["output_ids"] and len(a["log_probs"]) == 6
    assert a["cum_log_prob"] == pytest.approx(sum(a["log_probs"]), abs=1e-4) and a["cum_log_prob"] < 0


@pytest.mark.parametrize("body, status, names", [
    ("{not json", 400, "JSON"),
    ({"input_ids": [5, 6], "colour": 1}, 400, "colour"),
    ({"max_new_tokens": 4}, 400, "input_ids"),
    ({"input_ids": "t5", "max_new_tokens": 4}, 400, "input_ids"),
    ({"input_ids": [5, 6], "max_new_tokens": "4"}, 400, "max_new_tokens"),
    ({"input_ids": [5, 6], "temperature": "hot"}, 400, "temperature"),
    ({"input_ids": [5, 6], "stop_words": [[]]}, 400, "stop_words[0]"),
    # GptManager's own validation errors, passed through as 400:
    ({"input_ids": [5, 1000], "max_new_tokens": 4}, 400, "input_ids: token id 1000"),
    ({"input_ids": [5, 6], "max_new_tokens": 0}, 400, "request_output_len"),
    ({"input_ids": [5] * 60, "max_new_tokens": 4}, 400, "max_input_len"),
    ({"input_ids": [5, 6], "temperature": -1.0}, 400, "temperature"),
    ({"input_ids": [5, 6], "beam_width": 0}, 400, "beam_width"),
])
def test_bad_input_is_4xx(server, body, status, names):
    if isinstance(server.bridge, ExecutorBridge):   # the Executor names its field, not the wire tensor
        names = names.replace("request_output_len", "max_new_tokens")
    start = num_waiting(server.url)
    got_status, got = run(post, server.url, body)
    assert got_status == status and names in got["error"], got
    assert num_waiting(server.url) == start


INT32_OVERFLOW = 1 << 31
NESTED = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("data, field", [
    *[(json.dumps({"input_ids": [5, 6], f: INT32_OVERFLOW}), f) for f in
      ("max_new_tokens", "end_id", "pad_id", "beam_width", "top_k", "min_length", "early_stopping",
       "no_repeat_ngram_size")],
    (json.dumps({"input_ids": [5, -INT32_OVERFLOW - 1], "max_new_tokens": 2}), "input_ids"),
    (json.dumps({"input_ids": [5, INT32_OVERFLOW], "max_new_tokens": 2}), "input_ids"),
    (json.dumps({"input_ids": [5, 6], "stop_words": [[5], [6, INT32_OVERFLOW]]}), "stop_words[1]"),
    (json.dumps({"input_ids": [5, 6], "bad_words": [[INT32_OVERFLOW]]}), "bad_words[0]"),
    (json.dumps({"input_ids": [5, 6], "seed": 1 << 64}), "seed"),
    (json.dumps({"input_ids": [5, 6], "seed": -(1 << 63) - 1}), "seed"),
    (json.dumps({"input_ids": [5, 6], "temperature": 10 ** 400}), "temperature"),
    (json.dumps({"input_ids": [5, 6], "top_p": 1e39}), "top_p"),
    (json.dumps({"input_ids": [5, 6], "embedding_bias": [10 ** 400] * 128}), "embedding_bias[0]"),
    ('{"input_ids": [5, 6], "temperature": NaN}', "temperature"),
    ('{"input_ids": ' + NESTED + "}", "body"),
    ('{"input_ids": [5, 6], "max_new_tokens": ' + "9" * 5000 + "}", "body"),
    ('{"text": "t5 \\ud800 t6"}', "text"),
    ('{"text": "t5 \ud800 t6"}', "text"),          # raw surrogate bytes: json decodes them with surrogatepass
    ('{"input_ids": [5, 6], "stop_words": ["t5", "t6 \\udfff"]}', "stop_words[1]"),
    ('{"input_ids": [5, 6], "top_k": 2000000}', "top_k"),               # the manager's range check
    ('{"input_ids": [5, 6], "max_new_tokens": 0}', "max_new_tokens"),    # the manager's, by its wire name
], ids=lambda v: v if len(v) < 40 else v[:40])
def test_bad_body_is_400_naming_the_field_and_leaks_no_handler(server, data, field):
    start = num_waiting(server.url)
    status, text = run(post_raw, server.url, data)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error.startswith(field + ":"), error
    assert num_waiting(server.url) == start
    assert server.bridge.num_active_requests() == 0


def test_a_request_that_fails_to_build_registers_no_handler(server):
    def broken(request_id):
        raise RuntimeError("value cannot be converted to type int32 without overflow")

    start, loop = server.bridge.num_waiting_handlers(), asyncio.new_event_loop()
    with pytest.raises(RuntimeError, match="int32"):
        server.bridge.submit(broken, False, loop)
    loop.close()
    assert server.bridge.num_waiting_handlers() == start


@pytest.mark.parametrize("seed", [1 << 63, (1 << 64) - 1, -1, -(1 << 63)])
def test_any_uint64_or_int64_seed_is_accepted(server, seed):
    body = {"input_ids": PROMPTS[5], "max_new_tokens": 4, "top_k": 50, "seed": seed}
    status, got = run(post, server.url, body)
    assert status == 200, got
    # The manager reads random_seed as uint64: a negative seed is its two's complement.
    status, wrapped = run(post, server.url, {**body, "seed": seed % (1 << 64)})
    assert status == 200 and wrapped["output_ids"] == got["output_ids"], (got, wrapped)


def test_bad_input_while_streaming_is_4xx_not_sse(server):
    status, content_type, events = run(post_stream, server.url, {"input_ids": [5, 6], "temperature": -1.0})
    assert status == 400 and content_type == "application/json"
    assert "temperature" in events[0]["error"]


def test_metrics_scrape(server):
    assert run(post, server.url, {"input_ids": PROMPTS[2], "max_new_tokens": 3})[0] == 200
    status, text = run(get, server.url, "/metrics")
    assert status == 200
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def value(family: str, label: str, label_value: str) -> float:
        return samples[(family, tuple(sorted({"model": "tensorrt_llm", "version": "1", label: label_value}.items())))]

    assert value("nv_trt_llm_request_metrics", "request_type", "max") == 8
    assert value("nv_trt_llm_request_metrics", "request_type", "active") == 0   # idle again
    assert value("nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type", "tokens_per") == 4
    assert value("nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type", "used") == 0
    assert value("nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type", "max") > 0
    assert value("nv_trt_llm_runtime_memory_metrics", "memory_type", "cpu") > 0
    assert ("nv_trt_llm_inflight_batcher_metrics", tuple(sorted(
        {"model": "tensorrt_llm", "version": "1", "inflight_batcher_specific_metric": "micro_batch_id"}.items()))) \
        in samples
    assert value("nv_trt_llm_general_metrics", "general_type", "iteration_counter") >= 2
    assert value("nv_trt_llm_general_metrics", "general_type", "timestamp") > 1.6e9


@pytest.mark.parametrize("idle", [False, True])
def test_a_scrape_that_sees_the_manager_idle_sees_the_rest_of_that_update(idle):
    """The gauges a reader polls for idleness (active requests, used blocks) are set after every
    other gauge of an update or of mark_idle: seen at 0, the free blocks are already max."""
    import json
    metrics = TritonMetrics(False)
    busy = {"Active Request Count": 1, "Used KV cache blocks": 3, "Free KV cache blocks": 93,
            "Max KV cache blocks": 96, "Tokens per KV cache block": 4}
    metrics.update(json.dumps(busy))
    free_gauge = metrics._key_to_gauges["Free KV cache blocks"][0]
    seen = []
    for key in ("Used KV cache blocks", "Active Request Count"):
        child = metrics._key_to_gauges[key][0]
        child.set = lambda value, set_=child.set: (seen.append(free_gauge._value.get()), set_(value))
    if idle:
        metrics.mark_idle()
    else:
        # The final iteration's stats as the worker builds them: used and active come first.
        metrics.update(json.dumps({"Active Request Count": 0, "Used KV cache blocks": 0, "Free KV cache blocks": 96,
                                   "Max KV cache blocks": 96}))
    assert seen == [96.0, 96.0]


class SlowMetrics(TritonMetrics):
    """Paces the manager: the stats callback runs on its worker thread once per iteration."""

    def update(self, stats_json):
        super().update(stats_json)
        time.sleep(0.02)


@pytest.fixture(scope="module")
def slow_server(tiny_model_dirs):
    s = ServerThread(tiny_model_dirs[1], metrics=SlowMetrics(False))
    yield s
    s.stop()


def _assert_freed_soon(server, max_iterations: int) -> None:
    deadline = time.monotonic() + 5
    while server.bridge.num_active_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.bridge.num_active_requests() == 0
    kv = kv_of_bridge(server.bridge)  # internal: the block pool is whole again
    assert kv.num_free_blocks == kv.num_blocks
    assert server.bridge.num_waiting_handlers() == 0
    # Stopped long before its 80 tokens (one iteration per token, each >= 20 ms here).
    assert server.bridge.metrics.last_stats["Iteration Counter"] < max_iterations


@pytest.mark.parametrize("streaming", [True, False])
def test_disconnect_stops_the_request_and_frees_its_blocks(slow_server, streaming):
    start_iteration = slow_server.bridge.metrics.last_stats.get("Iteration Counter", 0)

    async def disconnect_early():
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None if streaming else 0.3))
        body = {"input_ids": PROMPTS[3][:10], "max_new_tokens": 80, "stream": streaming}
        try:
            async with session.post(slow_server.url + "/generate", json=body) as response:
                await response.content.readline()  # the first event
        except asyncio.TimeoutError:
            assert not streaming
        await session.close()

    run(disconnect_early)
    _assert_freed_soon(slow_server, start_iteration + 60)


def test_cli_serves_without_tools_when_the_grammar_engine_cannot_take_the_tokenizer(tiny_model_dirs, tokenizer_dir):
    """A word-level tokenizer without a decoder: llguidance refuses it; the server still starts
    (it once failed to), logs why, and refuses tools by name."""
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-m", "samples.serve", "--engine-dir", tiny_model_dirs[1], "--port", "0",
                             "--tokenizer", tokenizer_dir], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": repo_root}, cwd=repo_root)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), line
        url = line.split()[-1]

        async def chat_with_tools() -> tuple[int, dict]:
            body = {"model": "engine", "messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 2,
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
            async with aiohttp.ClientSession() as session:
                async with session.post(url + "/v1/chat/completions", json=body) as response:
                    return response.status, await response.json()

        status, body = asyncio.run(chat_with_tools())
        assert status == 400 and body["error"]["param"] == "tools", body
        status, answer = run(post, url, {"input_ids": [5, 6, 7], "max_new_tokens": 2})
        assert status == 200 and len(answer["output_ids"]) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "tools and guided decoding are off" in proc.stderr.read()
    finally:
        proc.kill()


def test_cli_serves_and_exits_on_sigterm(tiny_model_dirs):
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": repo_root}
    proc = subprocess.Popen([sys.executable, "-m", "samples.serve", "--engine-dir", tiny_model_dirs[1], "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=repo_root)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), line
        url = line.split()[-1]
        status, text = run(get, url, "/health")
        assert status == 200 and json.loads(text)["status"] == "ok"
        status, body = run(post, url, {"input_ids": [5, 6, 7], "max_new_tokens": 2})
        assert status == 200 and len(body["output_ids"]) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
