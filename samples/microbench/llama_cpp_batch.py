"""Many requests and long prompts, ours against llama.cpp on the same weights, in one run: W64 (64
concurrent requests of the benchmark's synthetic mix: prompts uniform 16-256, outputs uniform 16-128
tokens, seed 0; generated tokens over the wall time from the first submission to the last token) and
prefill (one 512-token prompt, one new token: prompt tokens per second; llama.cpp's own prompt
timing, ours the wall time of the request, so ours carries its scheduling on top).

The files and our engines are llama_cpp_compare's (same --model, --formats and --work-dir, so one
work directory serves both tools): llama.cpp's server (the `xllamacpp` wheel) with 64 parallel slots
gets the 64 requests from 64 threads at once; ours gets them through the Executor. Each measurement
runs in a fresh process.

    python -m samples.microbench.llama_cpp_batch [--model smollm2|llama-1b] [--formats F32 Q8_0 Q4_0 ...]
        [--threads 2] [--work-dir DIR] [--skip-w64] [--skip-prefill]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import threading
import time

import torch

from samples.benchmark.dataset import LengthDistribution, synthetic_dataset
from samples.microbench.llama_cpp_compare import (LLAMA_CPP_TYPES, in_fresh_process, llama_cpp_completion,
                                                   llama_cpp_server, model_files, our_modes)
from samples.microbench.weight_only import cpu_description

NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN, PREFILL_LEN = 64, "uniform:16:256", "uniform:16:128", 512


def w64_requests(vocab_size: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) of the W64 mix (samples.benchmark's synthetic default, seed 0)."""
    samples = synthetic_dataset(NUM_REQUESTS, LengthDistribution.parse("prompt", PROMPT_LEN),
                                LengthDistribution.parse("output", OUTPUT_LEN), vocab_size, 0, 2048)
    return [(s.input_ids, s.output_len) for s in samples]


def prefill_prompt(vocab_size: int) -> list[int]:
    rng = random.Random(1)
    return [rng.randrange(3, vocab_size) for _ in range(PREFILL_LEN)]


def llama_cpp_w64(path: str, requests: list[tuple[list[int], int]], threads: int) -> float:
    """llama.cpp's generated tokens/s over the wall time of the whole batch."""
    server = llama_cpp_server(path, threads, len(requests), max(len(p) + n for p, n in requests) + 8)
    results: list[dict | None] = [None] * len(requests)

    def one(i: int) -> None:
        results[i] = llama_cpp_completion(server, *requests[i])

    workers = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - start
    generated = sum(int(r["timings"]["predicted_n"]) for r in results if r is not None)
    if generated != sum(n for _, n in requests):
        raise RuntimeError(f"llama.cpp generated {generated} tokens, expected {sum(n for _, n in requests)}")
    return generated / elapsed


def llama_cpp_prefill(path: str, prompt: list[int], threads: int) -> float:
    server = llama_cpp_server(path, threads, 1, len(prompt) + 16)
    return float(llama_cpp_completion(server, prompt, 1)["timings"]["prompt_per_second"])


def our_w64(engine_dir: str, requests: list[tuple[list[int], int]], threads: int) -> float:
    """Our generated tokens/s over the wall time of the whole batch, through the Executor."""
    torch.set_num_threads(threads)
    from batch_manager.executor import Executor, ExecutorConfig, ModelType, OutputConfig, Request
    with Executor(engine_dir, ModelType.DECODER_ONLY, ExecutorConfig()) as executor:
        start = time.perf_counter()
        ids = [executor.enqueue_request(Request(prompt, n, output_config=OutputConfig(exclude_input_from_output=True)))
               for prompt, n in requests]
        generated = 0
        for request_id in ids:
            done = False
            while not done:
                for response in executor.await_responses(request_id, timeout=1800.0):
                    if response.has_error():
                        raise RuntimeError(response.error_msg)
                    generated += len(response.result.output_token_ids[0])
                    done = response.result.is_final
        elapsed = time.perf_counter() - start
    if generated != sum(n for _, n in requests):
        raise RuntimeError(f"ours generated {generated} tokens, expected {sum(n for _, n in requests)}")
    return generated / elapsed


def our_prefill(engine_dir: str, prompt: list[int], threads: int) -> float:
    torch.set_num_threads(threads)
    from batch_manager.executor import Executor, ExecutorConfig, ModelType, Request
    with Executor(engine_dir, ModelType.DECODER_ONLY, ExecutorConfig()) as executor:
        warm_up = executor.enqueue_request(Request(prompt[:16], 1))   # first-call allocations, kernel builds
        executor.await_responses(warm_up, timeout=600.0)
        start = time.perf_counter()
        request_id = executor.enqueue_request(Request(prompt, 1))
        for response in executor.await_responses(request_id, timeout=600.0):
            if response.has_error():
                raise RuntimeError(response.error_msg)
        return len(prompt) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--model", choices=("smollm2", "llama-1b"), default="smollm2")
    p.add_argument("--formats", nargs="+", choices=LLAMA_CPP_TYPES, default=list(LLAMA_CPP_TYPES))
    p.add_argument("--work-dir", help="keep the files and engines here (default: a temporary directory)")
    p.add_argument("--skip-w64", action="store_true")
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    from runtime import ConfigError, build_engine
    from runtime.loading.gguf_checkpoint import GgufCheckpoint
    results: dict = {}
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work_dir or scratch
        os.makedirs(work, exist_ok=True)
        files, _ = model_files(args.model, work, ["F32", *args.formats])
        with GgufCheckpoint(files["F32"]) as checkpoint:
            vocab_size = checkpoint.model_config.vocab_size
        requests, prompt = w64_requests(vocab_size), prefill_prompt(vocab_size)
        workloads = {name: fns for name, fns in (("w64", (llama_cpp_w64, our_w64, requests)),
                                                 ("prefill", (llama_cpp_prefill, our_prefill, prompt)))
                     if not getattr(args, f"skip_{name}")}
        for type_name in args.formats:
            row: dict = {}
            for workload, (theirs, ours, inputs) in workloads.items():
                row[workload] = {"llama_cpp": in_fresh_process(theirs, files[type_name], inputs, args.threads)}
                for index, (mode, (source, fields)) in enumerate(our_modes(type_name).items()):
                    engine_dir = os.path.join(work, f"ours-{args.model}-{type_name}-{index}")
                    try:
                        if not os.path.exists(os.path.join(engine_dir, "engine.json")):
                            build_engine(files[source], engine_dir, **fields)
                        row[workload][mode] = in_fresh_process(ours, engine_dir, inputs, args.threads)
                    except ConfigError as e:
                        row[workload][mode] = f"refused: {e}"
            results[type_name] = row
    print(f"{cpu_description()}; {args.model}, {args.threads} threads, one run each "
          f"(W64: generated tokens/s; prefill: {PREFILL_LEN}-token prompt, prompt tokens/s):")
    for type_name, row in results.items():
        for workload, figures in row.items():
            base = figures["llama_cpp"]
            ours = ", ".join(f"{mode} {rate:.1f} ({rate / base:.2f}x)" if isinstance(rate, float) else f"{mode} {rate}"
                             for mode, rate in figures.items() if mode != "llama_cpp")
            print(f"  {type_name:6s} {workload:7s} llama.cpp {base:.1f}; ours {ours}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
