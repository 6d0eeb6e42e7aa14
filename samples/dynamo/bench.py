"""The overhead of Dynamo's frontend: one stream and W64 through `python -m samples.dynamo` (the
frontend and one worker) against `python -m samples.serve` directly, on the same engine in the
same run (both up at once; the rounds alternate, so a shared machine's drift hits both alike).

    python -m samples.dynamo.bench [--engine-dir DIR] [--requests 64] [--max-tokens 64] [--rounds 2]

Each request: /v1/completions streamed, greedy, ignore_eos, exactly --max-tokens tokens. One
stream: --single requests one after another (time to first token p50, tokens/s of one request);
W64: --requests at once (TTFT p50, generated tokens / wall time)."""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

import aiohttp

from samples.default_model import add_model_arguments, model_from_arguments
from samples.dynamo.launch import Fleet

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


async def one_request(session: aiohttp.ClientSession, url: str, model: str, max_tokens: int) -> tuple[float, int]:
    """(time to first token in s, tokens generated) of one streamed completion."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start_s, first_s, num_tokens = time.perf_counter(), None, 0
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: {response.status} {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") and first_s is None:
                first_s = time.perf_counter()
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    return (first_s or time.perf_counter()) - start_s, num_tokens


async def measure(url: str, model: str, concurrency: int, num_requests: int, max_tokens: int) -> dict:
    """TTFT p50 (ms) and generated tokens/s of num_requests requests, `concurrency` at a time."""
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await one_request(session, url, model, 4)   # warm-up
        semaphore = asyncio.Semaphore(concurrency)

        async def bounded() -> tuple[float, int]:
            async with semaphore:
                return await one_request(session, url, model, max_tokens)
        start_s = time.perf_counter()
        results = await asyncio.gather(*(bounded() for _ in range(num_requests)))
        wall_s = time.perf_counter() - start_s
    return {"ttft_p50_ms": 1e3 * statistics.median(r[0] for r in results),
            "tokens_per_s": sum(r[1] for r in results) / wall_s, "num_tokens": sum(r[1] for r in results)}


def start_serve(engine_dir: str, model: str) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "samples.serve", "--port", "0", "--host", "127.0.0.1", "--api", "executor",
               "--served-model-name", model, "--log-level", "warning", "--engine-dir", engine_dir]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if not line.startswith("listening on "):
        process.kill()
        raise RuntimeError(f"samples.serve did not start (its first line: {line!r})")
    return process, line.split()[-1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, "--engine-dir")
    p.add_argument("--requests", type=int, default=64, help="W: requests at once")
    p.add_argument("--single", type=int, default=5, help="requests of the one-stream measurement")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per server")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    engine_dir = model_from_arguments(args.engine_dir, args.random_model)
    model = engine_dir.rstrip("/").split("/")[-1]
    serve, serve_url = start_serve(engine_dir, model)
    fleet = Fleet(engine_dir, 1, "round-robin", 0)
    try:
        fleet.start()
        urls = {"samples.serve": serve_url, "dynamo": fleet.url}
        results: dict[str, dict[str, list[dict]]] = {name: {"one stream": [], f"W{args.requests}": []} for name in urls}
        for _ in range(args.rounds):
            for name, url in urls.items():
                results[name]["one stream"].append(asyncio.run(measure(url, model, 1, args.single, args.max_tokens)))
                results[name][f"W{args.requests}"].append(
                    asyncio.run(measure(url, model, args.requests, args.requests, args.max_tokens)))
        for name, by_load in results.items():
            for load, runs in by_load.items():
                print(f"{name:14s} {load:10s} " + "  ".join(
                    f"TTFT p50 {r['ttft_p50_ms']:8.1f} ms, {r['tokens_per_s']:7.1f} tokens/s" for r in runs))
        return results
    finally:
        fleet.stop()
        serve.terminate()
        serve.wait(30)


if __name__ == "__main__":
    main()
