"""`python -m samples.memory_soak [--rounds 20] [--requests 100] [--seed 0] [--json OUT]`: does a
long-running GptManager's memory level off?

One GptManager serves rounds of requests with random prompt and output lengths, handed out a
random few at a time, so every step packs a new mix of row counts; RSS is read after each round.
It has levelled off when it grew by at most --tolerance-mib over the last half of the rounds.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

import torch

from batch_manager import (GptManager, InferenceRequest, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType,
                           tensor_names)
from runtime.engine import ENGINE_CONFIG_FILE

from .default_model import add_model_arguments, model_from_arguments

ROUND_TIMEOUT_S = 1800.0
TOLERANCE_MIB = 16.0   # growth allowed over the last half of the rounds (allocator and cache slack)


@dataclass(frozen=True)
class Workload:
    num_requests: int      # per round
    max_prompt_len: int    # prompt lengths are uniform in 1..max_prompt_len
    max_new_tokens: int    # output lengths are uniform in 1..max_new_tokens
    max_arrivals: int      # each get-requests call hands out 0..max_arrivals requests
    vocab_size: int        # prompt ids are uniform in 3..vocab_size - 1


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


class RoundClient:
    """The four callbacks for one round: random requests out, final responses counted in."""

    def __init__(self, workload: Workload, rng: random.Random, first_id: int):
        self.rng = rng
        self.max_arrivals = workload.max_arrivals
        self.pending: deque[InferenceRequest] = deque()
        for request_id in range(first_id, first_id + workload.num_requests):
            r = InferenceRequest(request_id)
            r.input_ids = torch.tensor([rng.randrange(3, workload.vocab_size)
                                        for _ in range(rng.randint(1, workload.max_prompt_len))], dtype=torch.int32)
            r.max_new_tokens = torch.tensor([[rng.randint(1, workload.max_new_tokens)]], dtype=torch.int32)
            self.pending.append(r)
        self.num_requests = workload.num_requests
        self.num_final = self.num_generated = 0
        self.errors: list[str] = []
        self.done = threading.Event()

    def get(self, max_num_requests: int) -> list[InferenceRequest]:
        count = min(max_num_requests, self.rng.randint(0, self.max_arrivals), len(self.pending))
        return [self.pending.popleft() for _ in range(count)]

    def send(self, request_id: int, tensors, is_final: bool, err_msg: str) -> None:
        if err_msg:
            self.errors.append(f"{request_id}: {err_msg}")
        for t in tensors:
            if t.name == tensor_names.OUTPUT_IDS:
                self.num_generated += int(t.tensor.shape[-1])
        if is_final:
            self.num_final += 1
            if self.num_final == self.num_requests:
                self.done.set()


class RoundFeed:
    """Routes the manager's callbacks to the current round's client (the manager outlives rounds)."""

    def __init__(self):
        self.client: RoundClient | None = None
        self.num_stray_responses = 0   # answers after their round timed out

    def get(self, max_num_requests: int) -> list[InferenceRequest]:
        client = self.client
        return client.get(max_num_requests) if client is not None else []

    def send(self, *args) -> None:
        client = self.client
        if client is None:
            self.num_stray_responses += 1
        else:
            client.send(*args)

    def poll_stop(self) -> set[int]:
        return set()

    def report_stats(self, stats_json: str) -> None:
        pass


def levelled_off(rss_per_round: list[float], tolerance_mib: float) -> tuple[bool, float]:
    """(levelled off, growth in MiB from the middle round to the last)."""
    growth = rss_per_round[-1] - rss_per_round[len(rss_per_round) // 2]
    return growth <= tolerance_mib, growth


def run_soak(model_dir: str, num_rounds: int, workload: Workload, seed: int,
             tolerance_mib: float = TOLERANCE_MIB, on_round=None, round_timeout_s: float = ROUND_TIMEOUT_S) -> dict:
    """Rounds on one GptManager; a round that times out ends the soak (its rest counts unanswered)."""
    if num_rounds < 2:
        raise ValueError(f"num_rounds: need at least 2 to see a trend, got {num_rounds}")
    rng = random.Random(seed)
    feed = RoundFeed()
    rounds = []
    start_rss = rss_mib()
    with GptManager(model_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    feed.get, feed.send, feed.poll_stop, feed.report_stats, TrtGptModelOptionalParams(),
                    exclude_input_in_output=True):
        loaded_rss = rss_mib()
        for index in range(num_rounds):
            client = RoundClient(workload, random.Random(rng.getrandbits(64)), index * workload.num_requests)
            round_start = time.perf_counter()
            feed.client = client
            client.done.wait(round_timeout_s)
            wall_s = time.perf_counter() - round_start
            gc.collect()
            rounds.append(dict(round=index, rss_mib=round(rss_mib(), 1), requests=client.num_requests,
                               answered=client.num_final, errors=client.errors[:5], num_errors=len(client.errors),
                               generated_tokens=client.num_generated, wall_s=round(wall_s, 2),
                               tokens_per_s=round(client.num_generated / wall_s, 1)))
            if on_round is not None:
                on_round(rounds[-1])
            feed.client = None
            if not client.done.is_set():
                break
    rss = [r["rss_mib"] for r in rounds]
    ok, growth = levelled_off(rss, tolerance_mib) if len(rss) >= 2 else (False, float("nan"))
    return dict(model_dir=model_dir, seed=seed, workload=asdict(workload), torch_threads=torch.get_num_threads(),
                rss_before_load_mib=round(start_rss, 1), rss_after_load_mib=round(loaded_rss, 1),
                rss_per_round_mib=rss, growth_last_half_mib=round(growth, 1), tolerance_mib=tolerance_mib,
                levelled_off=ok, unanswered=sum(r["requests"] - r["answered"] for r in rounds)
                + workload.num_requests * (num_rounds - len(rounds)),
                num_errors=sum(r["num_errors"] for r in rounds), num_stray_responses=feed.num_stray_responses,
                rounds=rounds)


def vocab_size_of(model_dir: str) -> int:
    """The vocabulary size from an engine directory's engine.json or an HF checkpoint's config.json."""
    engine_json = os.path.join(model_dir, ENGINE_CONFIG_FILE)
    if os.path.exists(engine_json):
        with open(engine_json) as f:
            return int(json.load(f)["model"]["vocab_size"])
    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, "--engine-dir")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--requests", type=int, default=100, help="requests per round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-arrivals", type=int, default=8, help="most requests handed out per get-requests call")
    p.add_argument("--tolerance-mib", type=float, default=TOLERANCE_MIB,
                   help="growth allowed over the last half of the rounds")
    p.add_argument("--round-timeout-s", type=float, default=ROUND_TIMEOUT_S)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--require-level", action="store_true", help="exit status 1 when RSS did not level off")
    p.add_argument("--json", metavar="OUT", help="also write the report as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = model_from_arguments(args.engine_dir, args.random_model)
    workload = Workload(args.requests, args.max_prompt_len, args.max_new_tokens, args.max_arrivals,
                        vocab_size_of(model_dir))
    print(f"model: {model_dir}; {args.rounds} rounds of {args.requests} requests (prompts 1..{args.max_prompt_len}, "
          f"outputs 1..{args.max_new_tokens} tokens), seed {args.seed}")
    print(f"{'round':>5}  {'RSS MiB':>8}  {'answered':>8}  {'errors':>6}  {'tokens':>7}  {'tokens/s':>8}")

    def show(r: dict) -> None:
        print(f"{r['round']:>5}  {r['rss_mib']:>8.1f}  {r['answered']:>8}  {r['num_errors']:>6}  "
              f"{r['generated_tokens']:>7}  {r['tokens_per_s']:>8.1f}", flush=True)

    report = run_soak(model_dir, args.rounds, workload, args.seed, args.tolerance_mib, show, args.round_timeout_s)
    print(f"RSS {report['rss_before_load_mib']} MiB before the model, {report['rss_after_load_mib']} after loading, "
          f"{report['rss_per_round_mib'][-1]} after the last round; last half of the rounds: "
          f"{report['growth_last_half_mib']:+.1f} MiB -> "
          f"{'levelled off' if report['levelled_off'] else 'STILL GROWING'} (tolerance {args.tolerance_mib} MiB)")
    print(f"unanswered: {report['unanswered']}, errors: {report['num_errors']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    failed = report["unanswered"] or report["num_errors"] or (args.require_level and not report["levelled_off"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
