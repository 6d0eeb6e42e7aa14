"""Manager overhead: host time per iteration outside the model forward and the decoder.

1. With a runtime whose forward is nearly free (returns ready-made logits): iteration time vs
   number of active generation requests (16, 64, 256, 1024).
2. With the ~50M LLaMA-style default model at 64 active requests: the share of iteration time
   spent outside the forward and the decoder.

    python -m samples.microbench.manager_overhead [--iterations 50] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time

import torch

from batch_manager import (GptManager, InferenceRequest, KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams,
                           TrtGptModelType)
from samples.default_model import add_model_arguments, model_from_arguments, write_random_llama


class Timed:
    """Wraps a callable and records the wall time (seconds) of each call."""

    def __init__(self, fn):
        self.fn, self.times_s = fn, []

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.times_s.append(time.perf_counter() - start)

    def median_ms(self) -> float:
        # The run is dominated by identical generation iterations; the median skips the context step.
        if not self.times_s:
            raise RuntimeError(f"{getattr(self.fn, '__name__', self.fn)} was never called: nothing to time")
        return statistics.median(self.times_s) * 1e3


class FreeForward:
    """Stands in for ModelRunner.forward: logits [S, V] whose argmax is a fixed token."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, inputs):
        logits = torch.zeros(inputs["input_lengths"].numel(), self.vocab_size)
        logits[:, 5] = 1.0
        return {"logits": logits}


def measure(engine_dir: str, num_active: int, iterations: int, free_forward: bool) -> dict:
    """Run num_active long requests; time `iterations` pure-generation iterations."""
    prompt_len, done = 16, threading.Event()
    pending = [num_active]
    iteration_times: list[float] = []
    last = [None]
    measuring = [False]

    def get(max_num):
        n = min(pending[0], max_num)
        pending[0] -= n
        out = []
        for i in range(n):
            r = InferenceRequest(num_active - pending[0] - n + i)
            r.input_ids = torch.arange(3, 3 + prompt_len, dtype=torch.int32)
            r.max_new_tokens = torch.tensor([[iterations + 20]], dtype=torch.int32)
            out.append(r)
        return out

    def stats(s):
        now = time.perf_counter()
        d = json.loads(s)
        if d["Context Requests"] == 0 and d["Generation Requests"] == num_active:
            if measuring[0] and last[0] is not None:
                iteration_times.append(now - last[0])
            measuring[0] = True
            if len(iteration_times) >= iterations:
                done.set()
        last[0] = now

    params = TrtGptModelOptionalParams(max_batch_size=num_active, max_num_sequences=num_active,
                                       max_num_tokens=max(num_active * prompt_len, 256),
                                       # room for every request's worst case, whatever the block size
                                       kv_cache_config=KvCacheConfig(max_tokens=num_active * (prompt_len + iterations + 20 + 128)))
    manager = GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                         get, lambda *a: None, None, stats, params)
    executor = manager.model_executor
    runner = executor.runner
    if free_forward:
        runner.forward = FreeForward(runner.model_config.vocab_size)
    forward = runner.forward = Timed(runner.forward)
    execute = executor.execute = Timed(executor.execute)   # the worker calls it once per iteration
    if not done.wait(600):
        raise RuntimeError(f"{num_active} requests did not all reach generation")
    manager.shutdown()
    iteration_ms = statistics.median(iteration_times) * 1e3
    forward_ms, step_ms = forward.median_ms(), execute.median_ms()
    return {"num_active": num_active, "iteration_ms": iteration_ms, "forward_ms": forward_ms,
            "decoder_ms": step_ms - forward_ms, "outside_ms": iteration_ms - step_ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--sizes", default="16,64,256,1024")
    add_model_arguments(p)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    results = {"free_forward": [], "model": None}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = write_random_llama(tmp, vocab_size=1000, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=4, intermediate_size=128, max_position_embeddings=512)
        print("1. nearly free forward: iteration time vs active requests")
        print(f"{'active':>8} {'iteration ms':>13} {'per request us':>15} {'outside fwd+dec ms':>19}")
        for n in [int(x) for x in args.sizes.split(",")]:
            r = measure(tiny, n, args.iterations, free_forward=True)
            results["free_forward"].append(r)
            print(f"{n:>8} {r['iteration_ms']:>13.2f} {r['iteration_ms'] / n * 1e3:>15.1f} {r['outside_ms']:>19.2f}")
    model_dir = model_from_arguments(args.model, args.random_model)
    r = measure(model_dir, 64, args.iterations, free_forward=False)
    results["model"] = r
    share = r["outside_ms"] / r["iteration_ms"]
    print(f"\n2. {model_dir} at 64 active: iteration {r['iteration_ms']:.1f} ms = forward {r['forward_ms']:.1f} ms"
          f" + decoder {r['decoder_ms']:.2f} ms + outside {r['outside_ms']:.2f} ms ({share:.1%} outside)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
