"""Paged decode attention over cold KV caches, against this machine's measured read bandwidth.

Each step attends once per layer over that layer's own cache (--layers caches, together larger
than the last-level cache, as in a decode step where the weight stream has evicted them), block
ids shuffled as a long-running pool leaves them. Printed per (KV format, rows, context): ms per
step (all layers, median of --repeats), GB/s of the K and V bytes the visible keys hold, and that
rate's fraction of a torch sum's read rate over --bandwidth-gib GiB measured in the same process.
Shapes default to SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64, 30 layers). Each call
crosses ctypes once (~20-40 us, included).

    python -m samples.microbench.decode_attention [--rows 1 8] [--context 64 400 2000] [--kv float32 bf16 int8]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

KV_FORMATS = ("float32", "bf16", "int8")


def make_caches(kv: str, num_layers: int, num_blocks: int, tpb: int, num_kv_heads: int, head_dim: int,
                gen: torch.Generator) -> list[tuple]:
    """Per layer (k, v, k_scales, v_scales) in the KV format (scales: int8 only, else None)."""
    from runtime.kernels import kv_quant
    caches = []
    for _ in range(num_layers):
        k, v = (torch.randn(num_blocks, tpb, num_kv_heads, head_dim, generator=gen) for _ in range(2))
        if kv == "int8":
            (kq, ks), (vq, vs) = kv_quant.quantize_rows(k, torch.int8), kv_quant.quantize_rows(v, torch.int8)
            caches.append((kq, vq, ks, vs))
        else:
            dtype = torch.bfloat16 if kv == "bf16" else torch.float32
            caches.append((k.to(dtype), v.to(dtype), None, None))
    return caches


def step_seconds(ops, bf16_ops, kv: str, rows: int, context: int, args: argparse.Namespace) -> tuple[float, int]:
    """(median seconds of one step over every layer, the K and V bytes one step reads)."""
    gen = torch.Generator().manual_seed(rows * 10_000 + context)
    tpb = args.tokens_per_block
    blocks_per_sequence = -(-context // tpb)
    num_blocks = rows * blocks_per_sequence
    caches = make_caches(kv, args.layers, num_blocks, tpb, args.kv_heads, args.head_dim, gen)
    tables = torch.randperm(num_blocks, generator=gen).int().view(rows, blocks_per_sequence)
    seq_lens = torch.full((rows,), context)
    dtype = torch.bfloat16 if kv == "bf16" else torch.float32
    q = torch.randn(rows, args.heads, args.head_dim, generator=gen).to(dtype)
    scale = args.head_dim ** -0.5

    def step() -> None:
        for k, v, ks, vs in caches:
            if kv == "int8":
                ops.decode_attention_int8(q, k, v, ks, vs, tables, seq_lens, scale, None)
            elif kv == "bf16":
                bf16_ops.decode_attention(q, k, v, tables, seq_lens, scale, None)
            else:
                ops.decode_attention(q, k, v, tables, seq_lens, scale, None)

    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    element = {"float32": 4, "bf16": 2, "int8": 1}[kv]
    row_bytes = args.head_dim * element + (4 if kv == "int8" else 0)   # int8: a float32 scale per row
    return statistics.median(times[1:]), 2 * rows * context * args.kv_heads * row_bytes * args.layers


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    p.add_argument("--context", nargs="+", type=int, default=[64, 400, 2000])
    p.add_argument("--kv", nargs="+", default=list(KV_FORMATS), choices=KV_FORMATS)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--bandwidth-gib", type=float, default=1.0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from runtime.kernels.cpu import cpu_native, cpu_native_bf16
    from samples.microbench.gemv_bandwidth import read_bandwidth
    from samples.microbench.weight_only import cpu_description
    ops = cpu_native.native_ops()
    if ops is None:
        raise SystemExit("the native CPU kernels cannot be built or run here")
    bf16_ops = cpu_native_bf16.bf16_ops()
    bandwidth = read_bandwidth(int(args.bandwidth_gib * 2**30), 3)
    print(f"{cpu_description()}, {args.threads} threads; read bandwidth {bandwidth / 1e9:.1f} GB/s (torch sum); "
          f"{args.layers} layers, {args.heads} / {args.kv_heads} heads of {args.head_dim}, shuffled blocks of "
          f"{args.tokens_per_block}")
    results = {}
    for kv in args.kv:
        for rows in args.rows:
            for context in args.context:
                seconds, num_bytes = step_seconds(ops, bf16_ops, kv, rows, context, args)
                results[(kv, rows, context)] = {"ms": seconds * 1e3, "bytes_per_s": num_bytes / seconds}
                print(f"  {kv:7s} rows {rows:2d} context {context:5d}: {seconds * 1e3:7.2f} ms a step, "
                      f"{num_bytes / seconds / 1e9:5.1f} GB/s of KV, {num_bytes / seconds / bandwidth:4.0%} of the bandwidth",
                      flush=True)
    return results


if __name__ == "__main__":
    main()
