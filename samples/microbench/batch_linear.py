"""Linears at batch row counts (context steps, large generation batches), every mode on one shape:

    python -m samples.microbench.batch_linear [--rows 16,64,128,512] [--shapes smollm2,llama-1b]
        [--modes fp32,int8,int4,int8_a8,int4_a8] [--threads N] [--reps 5] [--clock wall|cpu]

Shapes (k -> n): SmolLM2-135M's qkv-sized 576 -> 1536, the fused gate|up 576 -> 3072, the down
projection 1536 -> 576, the head 576 -> 49152; the ~1B LLaMA's 2048 -> 8192 and 8192 -> 2048.
Modes: fp32 (torch_kernels.linear.Linear, as prepared for an engine), int8 / int4 g32 exact
(torch_kernels.weight_only_linear.QuantizedLinear), int8_a8 / int4_a8 (the same with int8
activations). Per shape and row count the modes run interleaved, `--reps` times; the best call of
each in ms and GFLOP/s (2 * rows * k * n flops). `--clock cpu` times the process's CPU time instead
of wall time: with `--threads 1` on a machine other work shares, it leaves out the time the other
processes took. Prints the CPU model name.
"""
from __future__ import annotations

import argparse
import re
import time

import torch

from runtime.kernels.torch_kernels.linear import Linear
from runtime.kernels.torch_kernels.weight_only_linear import QuantizedLinear
from runtime.quantization.int4 import quantize_int4
from runtime.quantization.int8 import quantize_int8
from samples.microbench.weight_only import cpu_description

SHAPES = {"smollm2": [(576, 1536), (576, 3072), (1536, 576), (576, 49152)],
          "llama-1b": [(2048, 8192), (8192, 2048)]}
MODES = ("fp32", "int8", "int4", "int8_a8", "int4_a8")
GROUP_SIZE = 32


def build(mode: str, weight: torch.Tensor):
    """The prepared linear of one mode over `weight` [n, k] float32."""
    if mode == "fp32":
        return Linear(weight, None, torch.device("cpu"))
    act_quant = "int8" if mode.endswith("_a8") else None
    if mode.startswith("int8"):
        return QuantizedLinear(*quantize_int8(weight), None, None, act_quant)
    return QuantizedLinear(*quantize_int4(weight, GROUP_SIZE), None, act_quant)


def call_ms(fn, x: torch.Tensor, clock) -> float:
    start = clock()
    fn(x)
    return (clock() - start) * 1e3


def run_shape(k: int, n: int, modes: list[str], rows_list: list[int], reps: int, clock) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=gen) * 0.05
    linears = {mode: build(mode, weight) for mode in modes}
    for rows in rows_list:
        x = torch.randn(rows, k, generator=gen)
        for fn in linears.values():
            fn(x)   # warm-up: caches, oneDNN's primitive for this shape
        best = dict.fromkeys(modes, float("inf"))
        for _ in range(reps):
            for mode, fn in linears.items():
                best[mode] = min(best[mode], call_ms(fn, x, clock))
        flops = 2 * rows * k * n
        cells = "  ".join(f"{mode} {ms:8.3f} ms {flops / ms / 1e6:6.1f}" for mode, ms in best.items())
        print(f"{k:>5} -> {n:<6} rows {rows:>4}:  {cells}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16,64,128,512")
    parser.add_argument("--shapes", default="smollm2,llama-1b",
                        help=f"comma list of {sorted(SHAPES)} or KxN (k inputs, n outputs)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES] + [s for s in args.shapes.split(",")
                                                      if s not in SHAPES and not re.fullmatch(r"\d+x\d+", s)]
    if unknown:
        parser.error(f"unknown mode or shape set: {unknown}")
    rows_list = [int(r) for r in args.rows.split(",")]
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"CPU: {cpu_description()}; {torch.get_num_threads()} threads; best of {args.reps}, {args.clock} "
          "clock; per mode: ms, GFLOP/s")
    with torch.inference_mode():
        for shape_set in args.shapes.split(","):
            for k, n in SHAPES.get(shape_set) or [tuple(int(v) for v in shape_set.split("x"))]:
                run_shape(k, n, modes, rows_list, args.reps, clock)


if __name__ == "__main__":
    main()
