"""The int8-activation GEMVs (runtime.kernels.cpu.act_quant) against the weight-only ones
(runtime.kernels.cpu.cpu_weight_only, float32 activations) at SmolLM2-135M's linear shapes:

    python -m samples.microbench.act_quant [--threads 2,1] [--rows 1,8] [--reps 20] [--scalar]

Per shape (k -> n), rows and threads: ms per call of weight-only int8 / int4 g32 and of the
act-quant int8 / int4 g32 on every vector tier this CPU has (activation quantization included;
the scalar tier, a test path, with --scalar). Each pass
calls the linear on enough copies of the weight (>= 64 MB in all) that they stream from memory as
in a generation step; best of `--reps` passes, divided by the copies. Prints the CPU model name.
"""
from __future__ import annotations

import argparse
import time

import torch

from runtime.kernels.cpu.act_quant import act_quant_ops, pack
from runtime.kernels.cpu.cpu_weight_only import weight_only_ops
from runtime.quantization.int4 import quantize_int4
from runtime.quantization.int8 import quantize_int8
from samples.microbench.weight_only import cpu_description

SHAPES = [(576, 1728), (576, 576), (576, 3072), (1536, 576), (576, 49152)]   # (k, n): qkv, o, gate|up, down, lm_head
STREAM_BYTES = 64 << 20


def best_ms(fns: list, x: torch.Tensor, reps: int) -> float:
    """Best of `reps` passes over every copy, ms per call."""
    best = float("inf")
    for rep in range(reps + 2):
        start = time.perf_counter()
        for fn in fns:
            fn(x)
        if rep >= 2:
            best = min(best, (time.perf_counter() - start) * 1e3 / len(fns))
    return best


def linears(k: int, n: int, scalar: bool) -> dict[str, list]:
    """name -> bound linears over enough weight copies to stream from memory."""
    weight = torch.randn(n, k) * 0.05
    w8, s8 = quantize_int8(weight)
    w4, s4, m4 = quantize_int4(weight, 32)
    copies = max(1, min(400, STREAM_BYTES // (n * k)))
    wo, aq = weight_only_ops(), act_quant_ops()
    out = {"wo int8": [wo.bind(w8.clone(), s8, None, None) for _ in range(copies)],
           "wo int4": [wo.bind(w4.clone(), s4, m4, None) for _ in range(copies)]}
    packed8, packed4 = pack(w8, s8, None), pack(w4, s4, m4)
    for isa in reversed(aq.available_isas if scalar else aq.available_isas[1:]):
        out[f"aq int8 {isa}"] = [aq.bind(pack(w8, s8, None) if i else packed8, None, isa) for i in range(copies)]
        out[f"aq int4 {isa}"] = [aq.bind(pack(w4, s4, m4) if i else packed4, None, isa) for i in range(copies)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="2,1")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--scalar", action="store_true", help="time the scalar tier too")
    args = parser.parse_args()
    threads_list = [int(t) for t in args.threads.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"CPU: {cpu_description()}; ms per call, best of {args.reps} passes over >= 64 MB of weight copies")
    for k, n in SHAPES:
        fns = linears(k, n, args.scalar)
        header = f"{k:>5} -> {n:<6}" + "".join(f"{f'{t}thr r{r}':>11}" for t in threads_list for r in rows_list)
        print(header)
        for name, copies in fns.items():
            cells = []
            for threads in threads_list:
                torch.set_num_threads(threads)
                for rows in rows_list:
                    cells.append(best_ms(copies, torch.randn(rows, k), args.reps))
            print(f"  {name:<22}" + "".join(f"{c:>11.4f}" for c in cells))


if __name__ == "__main__":
    main()
