"""What an idle server costs and how fast it wakes, on this machine: the figures behind the tests'
liveness bounds (which are seconds, or ratios to a measurement taken in the same test, so that they
hold on a slow or busy machine; this prints the actual values).

    python -m samples.microbench.idle_cost               # one process (GptManager, Executor, JSON)
    python -m samples.microbench.idle_cost --part tp     # two tensor-parallel ranks (torchrun)

One process, a tiny random LLaMA: GptManager idle (the share of a core it uses, get-requests polls
per second while requests came recently and after the back-off, the time its shutdown takes);
Executor idle (share of a core, fetches per second, enqueue -> first response); the share of a core
a spinning thread gets here (the reference of the tests' ratios); json.loads of a 15 MB request
body (what samples.serve's event loop does while /health waits). With `--part tp`: each of two
tensor-parallel ranks' share of a core while idle, and a spinning thread's on the same rank.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch

from batch_manager import GptManager, InferenceRequest, SchedulerPolicy, TrtGptModelType
from batch_manager.executor import Executor, ExecutorConfig, Request
from batch_manager.executor import front_end
from samples.default_model import write_random_llama


def tiny_model(directory: str) -> str:
    return write_random_llama(directory, vocab_size=1000, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                              num_key_value_heads=4, intermediate_size=128, max_position_embeddings=512)


def spinning_share(wall_s: float = 1.0) -> float:
    """The share of a core this process gets while one thread spins."""
    cpu, start = time.process_time(), time.monotonic()
    while time.monotonic() - start < wall_s:
        pass
    return (time.process_time() - cpu) / (time.monotonic() - start)


def idle_share(wall_s: float) -> float:
    """The share of a core this process uses while the caller's thread sleeps `wall_s`."""
    cpu, start = time.process_time(), time.monotonic()
    time.sleep(wall_s)
    return (time.process_time() - cpu) / (time.monotonic() - start)


class _Polls:
    """A get-requests callback that counts its calls and hands out `requests` once released."""

    def __init__(self):
        self.num_calls, self.requests = 0, []

    def __call__(self, max_num):
        self.num_calls += 1
        out, self.requests = self.requests, []
        return out


def gpt_manager_idle(model_dir: str, idle_s: float) -> dict:
    polls, done = _Polls(), threading.Event()
    manager = GptManager(model_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                         polls, lambda request_id, tensors, is_final, error: done.set() if is_final else None)
    request = InferenceRequest(1)
    request.input_ids = torch.tensor([5, 9, 17], dtype=torch.int32)
    request.max_new_tokens = torch.tensor([[2]], dtype=torch.int32)
    polls.requests = [request]
    done.wait(60)   # a request just came: the fast polls, then the back-off
    before, start = polls.num_calls, time.monotonic()
    time.sleep(0.1)
    fast_per_s = (polls.num_calls - before) / (time.monotonic() - start)
    time.sleep(0.2)
    before, start = polls.num_calls, time.monotonic()
    share = idle_share(idle_s)
    backoff_per_s = (polls.num_calls - before) / (time.monotonic() - start)
    start = time.monotonic()
    manager.shutdown()
    return {"idle_share_of_a_core": share, "polls_per_s_first_0.1_s": fast_per_s,
            "polls_per_s_after_backoff": backoff_per_s, "shutdown_ms": (time.monotonic() - start) * 1e3}


def executor_idle(model_dir: str, idle_s: float) -> dict:
    fetches: list[tuple[float, int]] = []
    fetch = front_end.ExecutorFrontEnd.fetch

    def counted(self, max_num_requests):
        fetched = fetch(self, max_num_requests)
        fetches.append((time.monotonic(), len(fetched.requests)))
        return fetched

    front_end.ExecutorFrontEnd.fetch = counted
    try:
        with Executor(model_dir, executor_config=ExecutorConfig()) as executor:
            time.sleep(0.3)
            start = time.monotonic()
            share = idle_share(idle_s)
            num_idle = len([t for t, _ in fetches if t >= start])
            fetches_per_s = num_idle / (time.monotonic() - start)
            enqueued = time.monotonic()
            request_id = executor.enqueue_request(Request([5, 9, 17], 2))
            executor.await_responses(request_id)
            first = time.monotonic()
            woke = min(t for t, n in fetches if n)
    finally:
        front_end.ExecutorFrontEnd.fetch = fetch
    return {"idle_share_of_a_core": share, "fetches_per_s": fetches_per_s,
            "enqueue_to_fetch_ms": (woke - enqueued) * 1e3, "enqueue_to_first_response_ms": (first - enqueued) * 1e3}


def json_decode_ms(num_chars: int = 15_000_000) -> float:
    body = json.dumps({"prompt": ("Hello world, the batch manager serves every client. " * (num_chars // 52 + 1))
                       [:num_chars], "max_tokens": 2}).encode()
    start = time.perf_counter()
    json.loads(body)
    return (time.perf_counter() - start) * 1e3


def tp_rank_idle(model_dir: str, idle_s: float) -> None:
    """Under torchrun (2 ranks): each builds a manager; rank 0 gets no request; both idle."""
    rank = int(os.environ["RANK"])
    callbacks = (_Polls(), lambda *args: None) if rank == 0 else (None, None)
    manager = GptManager(model_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                         *callbacks)
    share = idle_share(idle_s)
    spin = spinning_share()
    manager.shutdown()
    print(f"rank {rank} ({'leader' if rank == 0 else 'follower'}): idle {share:.4f} of a core; a spinning thread "
          f"here: {spin:.2f} (ratio {share / spin:.3f})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("local", "tp"), default="local")
    p.add_argument("--idle-s", type=float, default=3.0)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)   # the tp ranks' model, written by the parent
    args = p.parse_args()
    if args.model_dir:
        tp_rank_idle(args.model_dir, args.idle_s)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model(tmp)
        if args.part == "tp":
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                            "samples.microbench.idle_cost", "--model-dir", model_dir, "--idle-s", str(args.idle_s)],
                           check=True, env=env)
            return
        print(f"a spinning thread gets {spinning_share():.2f} of a core here")
        for name, figures in (("GptManager", gpt_manager_idle(model_dir, args.idle_s)),
                              ("Executor", executor_idle(model_dir, args.idle_s))):
            print(f"{name} idle {args.idle_s} s: " + ", ".join(f"{k} {v:.4g}" for k, v in figures.items()))
        print(f"json.loads of a 15 MB body: {json_decode_ms():.1f} ms")


if __name__ == "__main__":
    main()
