"""samples.serve stays responsive while a huge text prompt arrives: a 15 MB prompt, chat message
or /generate text is refused by its length (a 400 naming the field and the limit) without being
tokenized, and `/health`, sent one after another while that request is in flight, keeps answering
within HEALTH_BUDGET_S. Before the bound, the server tokenized such a prompt on its event loop and
every other client waited 20-60 s. What stays on the loop is decoding the 15 MB of JSON (~17 ms on
a quiet machine, 35-70 ms on a loaded one; samples/microbench/idle_cost.py prints it), so the
budget is seconds: far above that on any machine, far below the stall it guards against."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from samples.serve.openai_basics import MAX_CHARS_PER_TOKEN
from samples.serve.server import DEFAULT_MAX_BODY_BYTES
from tests.samples.conftest import run
from tests.samples.openai_client import API_KEY, MODEL, raw_post, start_server
from tests.samples.scripted_model import MAX_SEQ_LEN

BIG_CHARS = 15_000_000                      # fits the default 16 MiB body limit
BIG_TEXT = ("Hello world, the batch manager serves every client. " * (BIG_CHARS // 52 + 1))[:BIG_CHARS]
HEALTH_BUDGET_S = 3.0                       # the slowest /health answer allowed while the big request runs
MAX_TEXT_CHARS = MAX_SEQ_LEN * MAX_CHARS_PER_TOKEN


@pytest.fixture(scope="module")
def server(scripted):
    """One front-end is enough: the text is checked before anything reaches the engine."""
    s = start_server(scripted, "gpt_manager", max_body_bytes=DEFAULT_MAX_BODY_BYTES)
    yield s
    s.stop()


async def health_latencies_during(url: str, path: str, data: bytes) -> tuple[int, str, list[float]]:
    """(status and text of the POST, the latency of each /health sent back to back while it ran)."""
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def health() -> float:
            start = time.perf_counter()
            async with session.get(url + "/health") as response:
                assert response.status == 200
                await response.read()
            return time.perf_counter() - start

        async def post() -> tuple[int, str]:
            async with session.post(url + path, data=data, headers=headers) as response:
                return response.status, await response.text()

        await health()   # a pooled connection: no connect inside the measured requests
        big = asyncio.create_task(post())
        latencies = []
        while not big.done():
            latencies.append(await health())
            await asyncio.sleep(0.002)
        status, text = await big
    return status, text, latencies


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"model": MODEL, "prompt": BIG_TEXT, "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": BIG_TEXT}]}, "messages"),
    ("/generate", {"text": BIG_TEXT, "max_new_tokens": 2}, "text"),
])
def test_a_huge_text_prompt_is_refused_without_stalling_other_clients(server, path, body, field):
    data = json.dumps(body).encode()   # before the measurement: the client shares the server's process
    status, text, latencies = run(health_latencies_during, server.url, path, data, timeout_s=180)
    assert latencies
    print(f"{path}: the slowest /health of {len(latencies)}: {max(latencies) * 1e3:.1f} ms")
    assert max(latencies) < HEALTH_BUDGET_S, f"the slowest /health: {max(latencies) * 1e3:.1f} ms"
    error = json.loads(text)["error"]
    message = error if path == "/generate" else error["message"]
    assert status == 400 and message.startswith(f"{field}: {BIG_CHARS} characters"), text[:300]
    assert str(MAX_TEXT_CHARS) in message, message
    if path != "/generate":
        assert error["param"] == field


def test_text_just_under_the_limit_is_tokenized(server):
    """The bound is on characters, far above what the context holds: a prompt of MAX_TEXT_CHARS
    characters passes it and is refused by its token count."""
    text = ("Hello world " * (MAX_TEXT_CHARS // 12 + 1))[:MAX_TEXT_CHARS]
    status, body = run(raw_post, server.url, "/v1/completions",
                       json.dumps({"model": MODEL, "prompt": text, "max_tokens": 2}).encode())
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "max_tokens", body
    assert "with a prompt of" in error["message"] and "exceeds the model's context" in error["message"], body
