"""A/B of the native CPU kernels (runtime/kernels/cpu/cpu_native.py) on whole model steps, in one process:

    python -m samples.microbench.native_ab [--model DIR] [--batch-sizes 1,8,64] [--rounds 3] [--threads N]

Two runners share one engine: A as built by default, B with BATCH_MANAGER_CPU_NATIVE=0 (torch and
oneDNN only). Per batch size and round: the generation step (one new token per sequence after
--past-len cached tokens) and, for batch 1, a context step of --prompt-len tokens, timed A, B,
A, B, ... (--iters each; median). Prints each round's A ms, B ms and B / A, and the median ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from runtime import Engine, ModelRunner
from runtime.kernels.cpu import cpu_native
from samples.default_model import add_model_arguments, model_from_arguments
from samples.microbench.runtime import step_inputs


def build_runner(engine: Engine, num_blocks: int, native: bool) -> ModelRunner:
    previous = os.environ.get(cpu_native.ENV_VAR)
    os.environ[cpu_native.ENV_VAR] = "1" if native else "0"
    try:
        return ModelRunner(engine, num_blocks=num_blocks)
    finally:
        if previous is None:
            del os.environ[cpu_native.ENV_VAR]
        else:
            os.environ[cpu_native.ENV_VAR] = previous


def interleaved_ms(runners: list[ModelRunner], inputs: dict, iters: int) -> list[float]:
    """Median ms of each runner's forward, the runners taking turns."""
    times = [[] for _ in runners]
    for runner in runners:
        runner.forward(inputs)
    for _ in range(iters):
        for runner, samples in zip(runners, times):
            start = time.perf_counter()
            runner.forward(inputs)
            samples.append(time.perf_counter() - start)
    return [statistics.median(samples) * 1e3 for samples in times]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--past-len", type=int, default=128)
    p.add_argument("--tokens-per-block", type=int, default=64)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--rounds", type=int, default=3, help="A/B repeats; the median ratio is the result")
    p.add_argument("--iters", type=int, default=15, help="timed steps per runner and round")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu_native.native_ops() is None:
        raise SystemExit("the native CPU kernels cannot run here (or BATCH_MANAGER_CPU_NATIVE=0): nothing to compare")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine = Engine.from_dir(model_from_arguments(args.model, args.random_model), tokens_per_block=args.tokens_per_block)
    vocab = engine.model_config.vocab_size
    blocks_per_seq = -(-(max(args.prompt_len, args.past_len) + 1) // args.tokens_per_block)
    num_blocks = max(batch_sizes) * blocks_per_seq
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; A = native kernels, B = torch/oneDNN only")
    with torch.inference_mode():
        runners = [build_runner(engine, num_blocks, native=True), build_runner(engine, num_blocks, native=False)]
        gen = torch.Generator().manual_seed(0)
        for batch in batch_sizes:
            tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
            past = torch.randint(3, vocab, (batch, args.past_len), generator=gen, dtype=torch.int32)
            for runner in runners:  # the same cache contents in both
                runner.forward(step_inputs(past, 0, tables))
            cases = [("generation", step_inputs(torch.randint(3, vocab, (batch, 1), generator=gen, dtype=torch.int32),
                                                args.past_len, tables), args.iters)]
            if batch == 1:
                prompt = torch.randint(3, vocab, (1, args.prompt_len), generator=gen, dtype=torch.int32)
                cases.append((f"context {args.prompt_len}", step_inputs(prompt, 0, tables), max(3, args.iters // 3)))
            for phase, inputs, iters in cases:
                ratios = []
                for round_index in range(args.rounds):
                    a_ms, b_ms = interleaved_ms(runners, inputs, iters)
                    ratios.append(b_ms / a_ms)
                    print(f"batch {batch:>3} {phase:<12} round {round_index + 1}: A {a_ms:7.2f} ms  B {b_ms:7.2f} ms  "
                          f"B/A {b_ms / a_ms:.2f}x")
                print(f"batch {batch:>3} {phase:<12} median B/A {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
