"""Time to first token and inter-token latency through the OpenAI endpoint (/v1/completions,
streamed) vs the sample's own (/generate, streamed), in one run: one server process
(`python -m samples.serve`, the default model and its tokenizer unless told), the same dataset
and the same Poisson arrivals sent through each endpoint in turn by one aiohttp client.

    python -m samples.serve.bench_openai                      # W64 at 5 req/s, default model
    python -m samples.serve.bench_openai --request-rate 2 --num-samples 32 --api executor

Both paths generate exactly each sample's output length greedily (OpenAI: temperature 0 and
ignore_eos; /generate has no end id), so they do the same engine work; what differs is what the
OpenAI path adds: body parsing, incremental detokenization of every token, the chunk format.
TTFT: first chunk that carries generated output; ITL: (last - first) / (tokens - 1) per request.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import aiohttp

from samples.benchmark.dataset import LengthDistribution, Sample, arrival_delays_s, synthetic_dataset
from samples.benchmark.report import RequestTiming, RunResult, format_text, metrics, progress_bar

MODEL_NAME = "bench"
ENDPOINTS = ("openai", "generate")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-dir", help="engine or HF checkpoint directory (default: the default model)")
    p.add_argument("--tokenizer", default="default", help="tokenizer directory (default: the default model's)")
    p.add_argument("--api", default="gpt_manager", choices=["gpt_manager", "executor"])
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--prompt-len", default="uniform:16:256")
    p.add_argument("--output-len", default="uniform:16:128")
    p.add_argument("--request-rate", type=float, default=5.0, help="Poisson arrivals, requests/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm-up", type=int, default=2, help="untimed requests through each endpoint first")
    p.add_argument("--order", default="openai,generate", help="the endpoints, in the order they run")
    p.add_argument("--output-json", metavar="PATH")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def start_server(args) -> tuple[subprocess.Popen, str]:
    """`python -m samples.serve` on a free loopback port; returns (process, base URL)."""
    command = [sys.executable, "-m", "samples.serve", "--port", "0", "--host", "127.0.0.1", "--api", args.api,
               "--tokenizer", args.tokenizer, "--served-model-name", MODEL_NAME, "--log-level", "warning"]
    if args.engine_dir:
        command += ["--engine-dir", args.engine_dir]
    env = {k: v for k, v in os.environ.items() if k != "BATCH_MANAGER_API_KEY"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        raise RuntimeError(f"the server did not start (its first line: {line!r})")
    return proc, line.split()[-1]


async def _sse_events(response: aiohttp.ClientResponse):
    """The `data:` payloads of a server-sent event stream, as they arrive."""
    async for line in response.content:
        if line.startswith(b"data: "):
            yield line[6:].strip()


async def send_openai(session: aiohttp.ClientSession, url: str, sample: Sample, timing: RequestTiming,
                      now_s) -> None:
    body = {"model": MODEL_NAME, "prompt": sample.input_ids, "max_tokens": sample.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            timing.error = await response.text()
            return
        async for data in _sse_events(response):
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                timing.error = chunk["error"]["message"]
            elif chunk["choices"] and timing.first_token_s is None:
                timing.first_token_s = now_s()
            elif chunk.get("usage"):
                timing.num_output_tokens = chunk["usage"]["completion_tokens"]
    timing.end_s = now_s()


async def send_generate(session: aiohttp.ClientSession, url: str, sample: Sample, timing: RequestTiming,
                        now_s) -> None:
    body = {"input_ids": sample.input_ids, "max_new_tokens": sample.output_len, "stream": True}
    async with session.post(url + "/generate", json=body) as response:
        if response.status != 200:
            timing.error = await response.text()
            return
        async for data in _sse_events(response):
            event = json.loads(data)
            if "error" in event:
                timing.error = event["error"]
                break
            if event["output_ids"] and timing.first_token_s is None:
                timing.first_token_s = now_s()
            timing.num_output_tokens += len(event["output_ids"])
            if event["is_final"]:
                break
    timing.end_s = now_s()


async def run_endpoint(url: str, endpoint: str, samples: list[Sample], delays_s: list[float], warm_up: int,
                       show_progress: bool) -> RunResult:
    send = send_openai if endpoint == "openai" else send_generate
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        warm = time.perf_counter()
        await asyncio.gather(*(send(session, url, samples[0], RequestTiming(0.0), lambda: time.perf_counter() - warm)
                               for _ in range(warm_up)))
        start_s = time.perf_counter()

        def now_s() -> float:
            return time.perf_counter() - start_s

        timings = []
        tasks = []
        progress = progress_bar(len(samples), endpoint, show_progress)
        next_s = 0.0
        for sample, delay_s in zip(samples, delays_s):
            timing = RequestTiming(enqueue_s=now_s())
            timings.append(timing)
            task = asyncio.create_task(send(session, url, sample, timing, now_s))
            task.add_done_callback(lambda _: progress.update(1))
            tasks.append(task)
            next_s += delay_s
            await asyncio.sleep(max(0.0, next_s - now_s()))
        await asyncio.gather(*tasks)
        progress.close()
    total_s = max(t.end_s for t in timings if t.end_s is not None)
    return RunResult(endpoint, timings, total_s, is_streaming=True)


def main(argv: list[str] | None = None) -> dict:
    from samples.benchmark.cli import model_limits
    from samples.default_model import default_model_dir
    from samples.serve.default_tokenizer import default_tokenizer_dir
    args = parse_args(argv)
    order = args.order.split(",")
    if sorted(order) != sorted(set(order)) or not set(order) <= set(ENDPOINTS):
        raise SystemExit(f"--order: a comma-separated order of {ENDPOINTS}, got {args.order!r}")
    model_dir = args.engine_dir or default_model_dir()   # written here, not in the timed server's first run
    if args.tokenizer == "default":
        default_tokenizer_dir()
    cfg, max_seq_len = model_limits(model_dir)
    samples = synthetic_dataset(args.num_samples, LengthDistribution.parse("--prompt-len", args.prompt_len),
                                LengthDistribution.parse("--output-len", args.output_len), cfg.vocab_size,
                                args.seed, max_seq_len)
    delays_s = arrival_delays_s(samples, args.request_rate, args.seed)
    print(f"model: {model_dir}; {len(samples)} requests, Poisson arrivals at {args.request_rate} req/s; "
          f"server api {args.api}; endpoints in order: {', '.join(order)}")
    proc, url = start_server(args)
    report: dict = {}
    try:
        for endpoint in order:
            result = asyncio.run(run_endpoint(url, endpoint, samples, delays_s, args.warm_up, not args.no_progress))
            report[endpoint] = metrics(result)
            print(format_text(f"{endpoint} ({'/v1/completions' if endpoint == 'openai' else '/generate'}, "
                              f"streamed)", report[endpoint]))
    finally:
        proc.terminate()
        proc.wait(60)
    if len(report) == 2:
        for name in ("time_to_first_token", "inter_token_latency"):
            o, g = report["openai"], report["generate"]
            print(f"[BENCHMARK] {name} p50 / p90 / avg (ms): openai {o[f'p50_{name}(ms)']:.1f} / "
                  f"{o[f'p90_{name}(ms)']:.1f} / {o[f'avg_{name}(ms)']:.1f} vs generate {g[f'p50_{name}(ms)']:.1f} / "
                  f"{g[f'p90_{name}(ms)']:.1f} / {g[f'avg_{name}(ms)']:.1f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
