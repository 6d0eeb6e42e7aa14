"""A single stream through GptManager: W64's first requests served one after another (each waits
for the previous one's final response), streaming, on the default model.

    python -m samples.microbench.single_stream [--num-requests 8] [--threads N] [--model DIR]

Reports the stream's tokens/s (generated tokens over the wall time, prompts included), the
median gap between a request's streamed tokens (the per-token time a user sees), and, timed
inside the same run, the median batch-1 generation forward of the runtime and what the
iteration spends around it (decoder, then everything else in the worker loop). The manager's
per-token overhead is gap / forward.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from batch_manager import GptManager, SchedulerPolicy, TrtGptModelType
from samples.benchmark.dataset import LengthDistribution, synthetic_dataset
from samples.benchmark.ours import BenchmarkClient, make_request
from samples.benchmark.cli import model_limits
from samples.default_model import add_model_arguments, model_from_arguments


class GenerationTimer:
    """Wraps a callable taking the step (a tensor dict or a ScheduledStep); records the seconds of its
    one-token generation steps."""

    def __init__(self, fn):
        self.fn, self.times_s = fn, []

    def __call__(self, step, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(step, *args, **kwargs)
        finally:
            if _is_single_generation(step):
                self.times_s.append(time.perf_counter() - start)


def _is_single_generation(step) -> bool:
    """A tensor dict (forward) or a ScheduledStep (execute) of exactly one generation token."""
    if isinstance(step, dict):
        return step["input_ids"].numel() == 1
    return (not step.context_requests and len(step.generation_requests) == 1
            and step.generation_requests[0].num_beams == 1 and step.generation_requests[0].num_step_tokens == 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--num-requests", type=int, default=8, help="W64's first N requests, one at a time")
    p.add_argument("--seed", type=int, default=0, help="W64's dataset seed")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Prints and returns the stream's figures: tokens_per_s, and gap_ms, forward_ms, execute_ms
    (medians per token)."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = model_from_arguments(args.model, args.random_model)
    cfg, max_seq_len = model_limits(model_dir)
    samples = synthetic_dataset(64, LengthDistribution.parse("--prompt-len", "uniform:16:256"),
                                LengthDistribution.parse("--output-len", "uniform:16:128"), cfg.vocab_size,
                                args.seed, max_seq_len)[:args.num_requests]
    client = BenchmarkClient()
    with GptManager(model_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *client.callbacks(), exclude_input_in_output=True) as manager:
        executor = manager.model_executor
        forward = executor.runner.launch = GenerationTimer(executor.runner.launch)
        execute = executor.execute = GenerationTimer(executor.execute)
        client.reset(1, None)  # warm-up: the first request, untimed
        client.submit(make_request(1 << 40, samples[0], streaming=True))
        client.done.wait()
        forward.times_s.clear()
        execute.times_s.clear()
        gaps_s, start_s, num_tokens = [], time.perf_counter(), 0
        for request_id, sample in enumerate(samples):
            client.reset(1, None)
            client.submit(make_request(request_id, sample, streaming=True))
            client.done.wait()
            events = [t for t, _ in client.token_events]
            gaps_s += [b - a for a, b in zip(events, events[1:])]
            num_tokens += sum(n for _, n in client.token_events)
        wall_s = time.perf_counter() - start_s
    gap_ms = statistics.median(gaps_s) * 1e3
    forward_ms = statistics.median(forward.times_s) * 1e3
    execute_ms = statistics.median(execute.times_s) * 1e3
    print(f"{model_dir}: {len(samples)} requests one at a time, {num_tokens} tokens in {wall_s:.2f} s "
          f"= {num_tokens / wall_s:.1f} tokens/s (prompts included), {torch.get_num_threads()} threads")
    print(f"per token: gap {gap_ms:.2f} ms = forward {forward_ms:.2f} ms + decoder {execute_ms - forward_ms:.2f} ms "
          f"+ rest of the iteration {gap_ms - execute_ms:.2f} ms; gap / forward {gap_ms / forward_ms:.2f}x "
          f"(runtime alone: {1e3 / forward_ms:.1f} tokens/s)")
    return {"tokens_per_s": num_tokens / wall_s, "gap_ms": gap_ms, "forward_ms": forward_ms, "execute_ms": execute_ms}


if __name__ == "__main__":
    main()
