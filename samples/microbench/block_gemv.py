"""GEMV of llama.cpp's block formats (runtime.kernels.cpu.blocks) next to the float32 native linear
(bm_linear), on model-sized matrices:

    python -m samples.microbench.block_gemv [--threads 1,2] [--rows 1] [--reps 10] [--shapes 2048x8192,...]
                                            [--formats q4_0,q8_0,...]
                                            [--clock wall|thread]

Per shape (k -> n), format, threads and rows: ms per call (input quantization included; bound
linears, BlockOps.bind: the 8-row interleaved layout where the format has kernels over it) and GB/s
of weight bytes read. Each pass calls the linear on enough copies of
the weight (>= 64 MB in all) that they stream from memory as in a generation step; best of `--reps`
passes, divided by the copies.
Shapes whose k is not a multiple of a format's block skip that format. `--clock thread` times the
calling thread's CPU time instead of the wall clock (one thread only: the figure a busy, shared
machine still gives about the kernels). Prints the CPU model name.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from runtime.kernels.cpu.blocks import BLOCK_FORMATS, block_geometry, block_ops
from runtime.kernels.cpu.cpu_native import native_ops
from runtime.quantization import k_quants
from samples.microbench.weight_only import cpu_description

# (k, n): the ~1B LLaMA's gate / up (2048 -> 8192) and down (8192 -> 2048); SmolLM2-135M's down
# (1536 -> 576) and gate / up (576 -> 1536: the 32-element formats only)
SHAPES = "2048x8192,8192x2048,1536x576,576x1536"
STREAM_BYTES = 64 << 20


def best_ms(fns: list, x: torch.Tensor, reps: int, clock=time.perf_counter) -> float:
    """Best of `reps` passes over every copy's bound linear, ms per call."""
    best = float("inf")
    for rep in range(reps + 2):
        start = clock()
        for fn in fns:
            fn(x)
        if rep >= 2:
            best = min(best, (clock() - start) * 1e3 / len(fns))
    return best


def weights(fmt: str, k: int, n: int) -> tuple[list, int] | None:
    """Copies of one quantized weight (>= STREAM_BYTES in all) and its bytes; None: k does not fit."""
    if k % block_geometry(fmt)[0]:
        return None
    values = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32) * 0.05
    blocks = torch.from_numpy(np.ascontiguousarray(k_quants.quantize(values, fmt.upper())))
    copies = max(1, STREAM_BYTES // blocks.numel())
    return [blocks] + [blocks.clone() for _ in range(copies - 1)], blocks.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", default="1")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall")
    parser.add_argument("--formats", default=",".join(BLOCK_FORMATS), help="block formats to run (float32 always)")
    args = parser.parse_args()
    ops, native = block_ops(), native_ops()
    if ops is None or native is None:
        raise SystemExit("the native CPU kernels cannot run here")
    threads_list = [int(t) for t in args.threads.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.clock == "thread" and threads_list != [1]:
        raise SystemExit("--clock thread: one thread only (--threads 1)")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    print(f"CPU: {cpu_description()}")
    print(f"ms per call ({args.clock} clock) and GB/s of weight bytes, best of {args.reps} passes over >= 64 MB "
          "of weight copies")
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        print(f"{k:>5} -> {n:<6}" + "".join(f"{f'{t}thr r{r}':>20}" for t in threads_list for r in rows_list))
        float_weight = torch.randn(n, k) * 0.05
        float_copies = [float_weight] + [float_weight.clone() for _ in range(max(0, STREAM_BYTES // (4 * n * k) - 1))]
        runs = {"float32 bm_linear": ([lambda x, w=w: native.linear(x, w, None) for w in float_copies], 4 * n * k)}
        for fmt in args.formats.split(","):
            made = weights(fmt, k, n)
            if made is not None:
                runs[fmt] = ([ops.bind(blocks, fmt, k) for blocks in made[0]], made[1])
        for name, (fns, size) in runs.items():
            cells = []
            for threads in threads_list:
                torch.set_num_threads(threads)
                for rows in rows_list:
                    ms = best_ms(fns, torch.randn(rows, k), args.reps, clock)
                    cells.append(f"{ms:8.3f} {size / ms / 1e6:6.1f} GB/s")
            print(f"  {name:<18}" + "".join(f"{c:>20}" for c in cells))


if __name__ == "__main__":
    main()
