"""What the KV-cache features buy, each measured with and without in one run (same model,
same requests, same machine state), on the ~50M LLaMA-style default model unless --model:

1. Block reuse: N requests share a P-token prefix (a system prompt). The first request arrives
   alone; the others arrive once it produced its first token (its prefix is then cached).
   Context tokens actually computed and end-to-end throughput, reuse off vs on.
2. Chunked context: R streaming requests are generating when one long prompt arrives.
   Inter-token latency (p50/p99/max) of the running requests from the long prompt's arrival
   on, and the long prompt's time to first token, chunking off vs on.
3. Overlap: a W64-like load (64 requests, prompts 16-256, outputs 16-128, all at once), tokens
   per second with enable_trt_overlap off vs on.

    python -m samples.microbench.kv_features [--parts 1,2,3] [--quick] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field

import torch

from batch_manager import (GptManager, InferenceRequest, KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams,
                           TrtGptModelType)
from samples.default_model import add_model_arguments, model_from_arguments, write_random_llama


@dataclass
class Spec:
    prompt: list[int]
    max_new_tokens: int
    streaming: bool = False
    after_first_token_of: int | None = None   # arrives once that request produced its first token


@dataclass
class Record:
    arrival_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)   # one entry per generated token
    done_s: float = 0.0


class Load:
    """Feeds the specs through the get callback and timestamps every response."""

    def __init__(self, specs: list[Spec]):
        self.specs, self.lock, self.done = specs, threading.Lock(), threading.Event()
        self.pending = list(range(len(specs)))
        self.records = {i: Record() for i in range(len(specs))}
        self.num_done = 0
        self.num_context_tokens = 0
        self.t0: float | None = None   # set by `start`: nothing arrives before

    def start(self) -> None:
        with self.lock:
            self.t0 = time.perf_counter()

    def get(self, max_num_requests: int) -> list[InferenceRequest]:
        out = []
        with self.lock:
            if self.t0 is None:
                return out
            now = time.perf_counter() - self.t0
            for i in list(self.pending):
                if len(out) >= max_num_requests:
                    break
                after = self.specs[i].after_first_token_of
                if after is not None and not self.records[after].token_times_s:
                    continue
                self.pending.remove(i)
                self.records[i].arrival_s = now
                s = self.specs[i]
                r = InferenceRequest(i)
                r.input_ids = torch.tensor(s.prompt, dtype=torch.int32)
                r.max_new_tokens = torch.tensor([[s.max_new_tokens]], dtype=torch.int32)
                r.is_streaming = s.streaming
                out.append(r)
        return out

    def send(self, request_id, tensors, is_final, err_msg) -> None:
        now = time.perf_counter() - self.t0
        assert not err_msg, err_msg
        with self.lock:
            rec = self.records[request_id]
            ids = next(t.tensor for t in tensors if t.name == "output_ids")
            n = ids.shape[2] if self.specs[request_id].streaming else self.specs[request_id].max_new_tokens
            rec.token_times_s.extend([now] * n)
            if is_final:
                rec.done_s = now
                self.num_done += 1
                if self.num_done == len(self.specs):
                    self.done.set()

    def stats(self, stats_json: str) -> None:
        self.num_context_tokens += json.loads(stats_json)["Total Context Tokens"]


def run(model_dir: str, specs: list[Spec], params: TrtGptModelOptionalParams) -> Load:
    load = Load(specs)
    with GptManager(model_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    load.get, load.send, None, load.stats, params):
        load.start()
        if not load.done.wait(3600):
            raise RuntimeError("the load did not finish")
    return load


def tokens(rng: random.Random, n: int, vocab: int = 32000) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def bench_reuse(model_dir: str, num_requests: int, prefix_len: int, suffix_len: int, num_new: int) -> dict:
    rng = random.Random(0)
    prefix = tokens(rng, prefix_len)
    specs = [Spec(prefix + tokens(rng, suffix_len), num_new, after_first_token_of=None if i == 0 else 0)
             for i in range(num_requests)]
    out = {}
    for reuse in (False, True):
        params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(enable_block_reuse=reuse))
        load = run(model_dir, specs, params)
        wall_s = max(r.done_s for r in load.records.values())
        out["on" if reuse else "off"] = {"context_tokens_computed": load.num_context_tokens, "wall_s": wall_s,
                                         "generated_tokens_per_s": num_requests * num_new / wall_s,
                                         "requests_per_s": num_requests / wall_s}
    out["throughput_ratio"] = out["on"]["generated_tokens_per_s"] / out["off"]["generated_tokens_per_s"]
    out["context_tokens_ratio"] = out["off"]["context_tokens_computed"] / max(1, out["on"]["context_tokens_computed"])
    return out


def bench_chunking(model_dir: str, num_running: int, long_len: int, chunk_budget: int, num_new: int) -> dict:
    rng = random.Random(1)
    specs = [Spec(tokens(rng, 32), num_new, streaming=True) for _ in range(num_running)]
    # The long prompt arrives once the last running request has its first token.
    specs.append(Spec(tokens(rng, long_len), 4, streaming=True, after_first_token_of=num_running - 1))
    out = {}
    for chunked in (False, True):
        params = TrtGptModelOptionalParams(enable_chunked_context=chunked,
                                           max_num_tokens=chunk_budget if chunked else max(8192, long_len + 64))
        load = run(model_dir, specs, params)
        long_rec = load.records[num_running]
        pairs = [(a, b) for i in range(num_running) for a, b in zip(load.records[i].token_times_s,
                                                                    load.records[i].token_times_s[1:])]
        # All gaps that end after the long prompt arrived (a stall included), and those of the
        # window from its arrival to its first token (while its context is computed).
        gaps = [b - a for a, b in pairs if b > long_rec.arrival_s]
        during = [b - a for a, b in pairs if b > long_rec.arrival_s and a < long_rec.token_times_s[0]]
        out["on" if chunked else "off"] = {
            "itl_p50_ms": statistics.median(gaps) * 1e3, "itl_p99_ms": percentile(gaps, 0.99) * 1e3,
            "itl_max_ms": max(gaps) * 1e3, "num_gaps": len(gaps),
            "during_long_context_p50_ms": statistics.median(during) * 1e3,
            "during_long_context_p99_ms": percentile(during, 0.99) * 1e3, "num_gaps_during": len(during),
            "long_prompt_ttft_s": long_rec.token_times_s[0] - long_rec.arrival_s}
    return out


def bench_overlap(model_dir: str, num_requests: int) -> dict:
    rng = random.Random(2)
    specs = [Spec(tokens(rng, rng.randrange(16, 257)), rng.randrange(16, 129)) for _ in range(num_requests)]
    num_generated = sum(s.max_new_tokens for s in specs)
    out = {}
    for overlap in (False, True):
        params = TrtGptModelOptionalParams(enable_trt_overlap=overlap)
        load = run(model_dir, specs, params)
        wall_s = max(r.done_s for r in load.records.values())
        out["on" if overlap else "off"] = {"wall_s": wall_s, "generated_tokens_per_s": num_generated / wall_s}
    out["throughput_ratio"] = out["on"]["generated_tokens_per_s"] / out["off"]["generated_tokens_per_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--parts", default="1,2,3")
    p.add_argument("--quick", action="store_true", help="smaller loads (a smoke run)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    model_dir = model_from_arguments(args.model, args.random_model)
    torch.manual_seed(0)
    parts, results = {int(x) for x in args.parts.split(",")}, {"model": model_dir, "threads": torch.get_num_threads()}
    q = args.quick
    if 1 in parts:
        n, prefix = (16, 256) if q else (64, 512)
        r = results["reuse"] = bench_reuse(model_dir, n, prefix, 16, 8)
        print(f"1. reuse: {n} requests sharing a {prefix}-token prefix (+16 own tokens, 8 new tokens each)")
        for k in ("off", "on"):
            v = r[k]
            print(f"   reuse {k:>3}: context tokens computed {v['context_tokens_computed']:>7}  wall {v['wall_s']:7.2f} s"
                  f"  {v['generated_tokens_per_s']:7.1f} generated tok/s")
        print(f"   ratio on/off: throughput x{r['throughput_ratio']:.2f}, context tokens computed "
              f"/{r['context_tokens_ratio']:.1f}")
    if 2 in parts:
        n, long_len, budget = (4, 512, 128) if q else (8, 1536, 256)
        r = results["chunking"] = bench_chunking(model_dir, n, long_len, budget, 48 if q else 96)
        print(f"2. chunking: {n} streaming requests generating when a {long_len}-token prompt arrives "
              f"(chunked: max_num_tokens {budget})")
        for k in ("off", "on"):
            v = r[k]
            print(f"   chunking {k:>3}: ITL p50 {v['itl_p50_ms']:7.1f} ms  p99 {v['itl_p99_ms']:7.1f} ms  "
                  f"max {v['itl_max_ms']:7.1f} ms  ({v['num_gaps']} gaps);  while the long context runs: "
                  f"p50 {v['during_long_context_p50_ms']:7.1f} ms  p99 {v['during_long_context_p99_ms']:7.1f} ms "
                  f"({v['num_gaps_during']} gaps);  long prompt TTFT {v['long_prompt_ttft_s']:.2f} s")
    if 3 in parts:
        n = 16 if q else 64
        with tempfile.TemporaryDirectory() as tmp:
            # A 1-layer, 64-wide model: the forward costs little next to the host work.
            tiny = write_random_llama(tmp, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=4, intermediate_size=128)
            for name, directory in (("overlap", model_dir), ("overlap_tiny_model", tiny)):
                r = results[name] = bench_overlap(directory, n)
                print(f"3. {name}: {n} requests, prompts 16-256, outputs 16-128, all at once ({directory})")
                for k in ("off", "on"):
                    v = r[k]
                    print(f"   overlap {k:>3}: wall {v['wall_s']:7.2f} s  {v['generated_tokens_per_s']:7.1f} generated tok/s")
                print(f"   ratio on/off: x{r['throughput_ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
