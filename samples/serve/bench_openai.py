"""Time to first token and inter-token latency through the OpenAI endpoint (/v1/completions,
streamed) vs the sample's own (/generate, streamed), in one run against one server process
(`python -m samples.serve`, the default model and its tokenizer unless told), one aiohttp client.

    python -m samples.serve.bench_openai                      # W64 at 5 req/s, default model
    python -m samples.serve.bench_openai --mode sequential --order generate,openai --api executor

--mode interleaved (default): every sample goes through both endpoints, the two requests of a pair
in a seeded random order, all 2N on one Poisson process at --request-rate: both endpoints see the
same load at the same moments (a shared machine's drift hits both alike). --mode sequential: the N
samples through one endpoint, then the same samples and arrivals through the other.
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
import random
import subprocess
import sys
import time

import aiohttp

from samples.benchmark.dataset import LengthDistribution, Sample, arrival_delays_s, synthetic_dataset
from samples.benchmark.report import RequestTiming, RunResult, format_text, metrics, progress_bar
from samples.default_model import add_model_arguments, model_from_arguments

MODEL_NAME = "bench"
ENDPOINTS = ("openai", "generate")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, "--engine-dir")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model directory's; the stand-in "
                                       "tokenizer with --random-model)")
    p.add_argument("--api", default="gpt_manager", choices=["gpt_manager", "executor"])
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--prompt-len", default="uniform:16:256")
    p.add_argument("--output-len", default="uniform:16:128")
    p.add_argument("--request-rate", type=float, default=5.0, help="Poisson arrivals, requests/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm-up", type=int, default=2, help="untimed requests through each endpoint first")
    p.add_argument("--mode", default="interleaved", choices=["interleaved", "sequential"])
    p.add_argument("--order", default="openai,generate", help="sequential: the endpoints, in the order they run")
    p.add_argument("--output-json", metavar="PATH")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def start_server(args) -> tuple[subprocess.Popen, str]:
    """`python -m samples.serve` on a free loopback port; returns (process, base URL)."""
    command = [sys.executable, "-m", "samples.serve", "--port", "0", "--host", "127.0.0.1", "--api", args.api,
               "--served-model-name", MODEL_NAME, "--log-level", "warning", "--engine-dir", args.engine_dir]
    tokenizer = args.tokenizer or ("default" if args.random_model else None)
    if tokenizer:
        command += ["--tokenizer", tokenizer]
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


SENDERS = {"openai": send_openai, "generate": send_generate}
Job = tuple[str, Sample]   # (endpoint, sample)


async def run_jobs(url: str, jobs: list[Job], delays_s: list[float], warm_up: int,
                   show_progress: bool) -> dict[str, RunResult]:
    """Send the jobs on schedule (after warm_up untimed requests per endpoint); a RunResult per
    endpoint, times from the first timed send."""
    endpoints = sorted({endpoint for endpoint, _ in jobs})
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        warm_start_s = time.perf_counter()
        await asyncio.gather(*(SENDERS[e](session, url, jobs[0][1], RequestTiming(0.0),
                                          lambda: time.perf_counter() - warm_start_s)
                               for e in endpoints for _ in range(warm_up)))
        start_s = time.perf_counter()

        def now_s() -> float:
            return time.perf_counter() - start_s

        timings: dict[str, list[RequestTiming]] = {e: [] for e in endpoints}
        tasks = []
        progress = progress_bar(len(jobs), "+".join(endpoints), show_progress)
        next_s = 0.0
        for (endpoint, sample), delay_s in zip(jobs, delays_s):
            timing = RequestTiming(enqueue_s=now_s())
            timings[endpoint].append(timing)
            task = asyncio.create_task(SENDERS[endpoint](session, url, sample, timing, now_s))
            task.add_done_callback(lambda _: progress.update(1))
            tasks.append(task)
            next_s += delay_s
            await asyncio.sleep(max(0.0, next_s - now_s()))
        await asyncio.gather(*tasks)
        progress.close()
    return {e: RunResult(e, t, max(x.end_s for x in t if x.end_s is not None), is_streaming=True)
            for e, t in timings.items()}


def phases(args, samples: list[Sample]) -> list[list[Job]]:
    """interleaved: one phase of both endpoints per sample, each pair in a seeded random order;
    sequential: one phase per endpoint of --order."""
    if args.mode == "sequential":
        order = args.order.split(",")
        if len(order) != len(set(order)) or not set(order) <= set(ENDPOINTS):
            raise SystemExit(f"--order: a comma-separated order of {ENDPOINTS}, got {args.order!r}")
        return [[(endpoint, s) for s in samples] for endpoint in order]
    rng = random.Random(args.seed)
    jobs = []
    for sample in samples:
        pair = list(ENDPOINTS)
        rng.shuffle(pair)
        jobs += [(endpoint, sample) for endpoint in pair]
    return [jobs]


def main(argv: list[str] | None = None) -> dict:
    from samples.benchmark.cli import model_limits
    from samples.serve.default_tokenizer import default_tokenizer_dir
    args = parse_args(argv)
    # The model (and the stand-in tokenizer) are written here, not in the timed server's first run.
    model_dir = args.engine_dir = model_from_arguments(args.engine_dir, args.random_model)
    if args.random_model and args.tokenizer is None:
        default_tokenizer_dir()
    cfg, max_seq_len = model_limits(model_dir)
    samples = synthetic_dataset(args.num_samples, LengthDistribution.parse("--prompt-len", args.prompt_len),
                                LengthDistribution.parse("--output-len", args.output_len), cfg.vocab_size,
                                args.seed, max_seq_len)
    jobs_of_phases = phases(args, samples)
    print(f"model: {model_dir}; {len(samples)} samples, {args.mode}: "
          + " then ".join(f"{len(jobs)} requests" for jobs in jobs_of_phases)
          + f" on Poisson arrivals at {args.request_rate} req/s; server api {args.api}")
    proc, url = start_server(args)
    report: dict = {"mode": args.mode, "request_rate": args.request_rate, "num_samples": len(samples)}
    try:
        for jobs in jobs_of_phases:
            delays_s = arrival_delays_s([s for _, s in jobs], args.request_rate, args.seed)
            results = asyncio.run(run_jobs(url, jobs, delays_s, args.warm_up, not args.no_progress))
            for endpoint, result in results.items():
                report[endpoint] = metrics(result)
                print(format_text(f"{endpoint} ({'/v1/completions' if endpoint == 'openai' else '/generate'}, "
                                  f"streamed)", report[endpoint]))
    finally:
        proc.terminate()
        proc.wait(60)
    if all(e in report for e in ENDPOINTS):
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
