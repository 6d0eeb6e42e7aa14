"""Prompt-lookup decoding (the built-in drafter) off vs on: generated tokens per second and the
draft acceptance rate at 1, 8 and 64 concurrent requests, on two workloads of the default model:

- copy: outputs that repeat spans of the prompt, built from random ids so that any model serves
  (the real-text version, prompts that ask to repeat a passage, is in samples.quality): each
  prompt is T + G + T, with G the model's own greedy continuation of T (measured in a first
  pass): when the model continues the second T as it did the first, the output is a span of the
  prompt, as in extraction or summaries that quote.
- w64: the W64 benchmark's random prompts (nothing to copy: the drafter finds little).

    python -m samples.microbench.prompt_lookup [--num-tokens 64] [--lookup 4] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import random
import threading
import time

import torch

from batch_manager import (DecodingConfig, GptManager, InferenceRequest, KvCacheConfig, SchedulerPolicy,
                           TrtGptModelOptionalParams, TrtGptModelType, tensor_names)
from samples.default_model import default_model_dir


class Run:
    """Serve `prompts` (all at once) through one GptManager; collect outputs and the last stats."""

    def __init__(self, model_dir: str, prompts: list[list[int]], num_tokens: int, lookup: int, max_batch: int,
                 lookup_max_batch: int = DecodingConfig.prompt_lookup_max_batch_size):
        self.pending = [self._request(i, p, num_tokens) for i, p in enumerate(prompts)]
        self.expected = len(prompts)
        self.outputs: dict[int, list[int]] = {}
        self.stats: dict = {}
        self.lock, self.done = threading.Lock(), threading.Event()
        params = TrtGptModelOptionalParams(
            kv_cache_config=KvCacheConfig(max_tokens=max(4096, len(prompts) * (max(map(len, prompts)) + num_tokens + 8))),
            max_batch_size=max_batch, max_num_sequences=max_batch,
            decoding_config=DecodingConfig(prompt_lookup_num_tokens=lookup, max_matching_ngram_size=3,
                                           prompt_lookup_max_batch_size=lookup_max_batch))
        self.start: float | None = None   # the first fetch: model loading is not timed
        with GptManager(model_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                        self.get, self.send, lambda: set(), self.report, optional_params=params):
            if not self.done.wait(600):
                raise RuntimeError("the run did not finish in 600 s")
        self.seconds = self.finish - self.start
        self.num_tokens = sum(len(self.outputs[i]) - len(p) for i, p in enumerate(prompts))   # generated only

    @staticmethod
    def _request(i: int, prompt: list[int], num_tokens: int) -> InferenceRequest:
        r = InferenceRequest(i)
        r.input_ids = torch.tensor(prompt, dtype=torch.int32)
        r.max_new_tokens = torch.tensor([[num_tokens]], dtype=torch.int32)
        return r

    def get(self, n: int):
        with self.lock:
            out, self.pending = self.pending[:n], self.pending[n:]
            if out and self.start is None:
                self.start = time.perf_counter()
            return out

    def send(self, request_id, tensors, is_final, error) -> None:
        if error:
            raise RuntimeError(error)
        out = {t.name: t.tensor for t in tensors}
        length = int(out[tensor_names.SEQUENCE_LENGTH][0, 0])
        with self.lock:
            self.outputs[request_id] = out[tensor_names.OUTPUT_IDS][0, 0, :length].tolist()
            if is_final and len(self.outputs) == self.expected:
                self.finish = time.perf_counter()
                self.done.set()

    def report(self, stats: str) -> None:
        self.stats = json.loads(stats)


def serve(model_dir, prompts, num_tokens, lookup, max_batch,
          lookup_max_batch: int = DecodingConfig.prompt_lookup_max_batch_size) -> dict:
    run = Run(model_dir, prompts, num_tokens, lookup, max_batch, lookup_max_batch)
    proposed = run.stats.get("Draft Tokens Proposed", 0)
    accepted = run.stats.get("Draft Tokens Accepted", 0)
    return {"tokens_per_s": run.num_tokens / run.seconds, "seconds": run.seconds,
            "proposed": proposed, "accepted": accepted,
            "acceptance": accepted / proposed if proposed else 0.0,
            "outputs": {i: t for i, t in run.outputs.items()}}


def copy_prompts(model_dir: str, n: int, num_tokens: int, seed: int) -> list[list[int]]:
    """T + G + T: G the greedy continuation of T."""
    rng = random.Random(seed)
    seeds = [[rng.randrange(3, 32000) for _ in range(rng.randrange(24, 64))] for _ in range(n)]
    first = serve(model_dir, seeds, num_tokens, 0, min(64, n))["outputs"]
    return [seeds[i] + first[i][len(seeds[i]):] + seeds[i] for i in range(n)]


def random_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 32000) for _ in range(rng.randrange(32, 256))] for _ in range(n)]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--lookup", type=int, default=4, help="prompt_lookup_num_tokens when on")
    parser.add_argument("--concurrency", default="1,8,64")
    parser.add_argument("--lookup-max-batch-size", type=int, default=DecodingConfig.prompt_lookup_max_batch_size,
                        help="DecodingConfig.prompt_lookup_max_batch_size when on (0: draft at any batch size)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    model_dir = default_model_dir()
    results = {}
    for workload in ("copy", "w64"):
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            prompts = (copy_prompts(model_dir, concurrency, args.num_tokens, concurrency) if workload == "copy"
                       else random_prompts(concurrency, concurrency))
            off = serve(model_dir, prompts, args.num_tokens, 0, concurrency)
            on = serve(model_dir, prompts, args.num_tokens, args.lookup, concurrency, args.lookup_max_batch_size)
            assert on["outputs"] == off["outputs"], "prompt lookup changed greedy outputs"
            row = {"off_tok_s": round(off["tokens_per_s"], 1), "on_tok_s": round(on["tokens_per_s"], 1),
                   "speedup": round(on["tokens_per_s"] / off["tokens_per_s"], 3),
                   "acceptance": round(on["acceptance"], 3), "proposed": on["proposed"], "accepted": on["accepted"]}
            results[f"{workload}@{concurrency}"] = row
            print(f"{workload:5s} concurrency {concurrency:3d}: off {row['off_tok_s']:7.1f} tok/s, "
                  f"on {row['on_tok_s']:7.1f} tok/s ({row['speedup']:.2f}x), acceptance {row['acceptance']:.2f} "
                  f"({row['accepted']}/{row['proposed']} drafts)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
