"""Benchmark the kernel backends' hot operations and print the figures (the timing that tests
cannot assert).

    python -m samples.microbench.kernels [--cpu-only] [--iters 20] [--json OUT]

CPU (always): one generation step's decode attention (every layer of the default model's shape:
8 layers, 8 heads / 2 KV heads, head_dim 64, 64 tokens per block, float32) at a batch with mixed
cached lengths, through the torch backend's fast paths (cpu_attention.py) and the plain
reference (torch_attention.py), with the largest difference between them.
GPU (with a CUDA device and CuPy): decode attention at batch 64 x 4k context (fp16, 32 heads /
8 KV heads, head_dim 128) as KV bytes read per second against the device's DRAM bandwidth, and
sampling at batch 256 with a 128k vocabulary (mixed top-k / top-p rows), the cuda kernel next to
the torch op on the same device.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from runtime.kernels import TorchKernels
from runtime.kernels.cuda.cuda_backend import CudaKernels, cuda_available, import_cupy


def timed_ms(fn, iters: int, sync=lambda: None) -> float:
    """Mean milliseconds per call after 3 untimed calls."""
    for _ in range(3):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters * 1e3


def paged_cache(seq_lens: list[int], tokens_per_block: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, device: str):
    """Random k/v caches and a shuffled block table holding every sequence's blocks."""
    blocks_per_seq = [-(-n // tokens_per_block) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    k_cache = torch.randn(num_blocks, tokens_per_block, num_kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    ids = torch.randperm(num_blocks, device=device, dtype=torch.int64).int()
    table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=device)
    start = 0
    for row, n in enumerate(blocks_per_seq):
        table[row, :n] = ids[start:start + n]
        start += n
    return k_cache, v_cache, table, torch.tensor(seq_lens, device=device)


def cpu_decode_attention(batch: int, iters: int) -> dict:
    num_layers, num_heads, num_kv_heads, head_dim, tpb = 8, 8, 2, 64, 64
    seq_lens = torch.linspace(40, 384, batch).long().tolist()  # requests at different points of generation
    k_cache, v_cache, table, lens = paged_cache(seq_lens, tpb, num_kv_heads, head_dim, torch.float32, "cpu")
    q = torch.randn(batch, num_heads, head_dim)
    fast, reference = TorchKernels(fast_paths=True), TorchKernels()

    def step(kernels):
        return [kernels.decode_attention(q, k_cache, v_cache, table, lens, 0.125, None) for _ in range(num_layers)]

    diff = (step(fast)[0] - step(reference)[0]).abs().max().item()
    fast_ms, reference_ms = timed_ms(lambda: step(fast), iters), timed_ms(lambda: step(reference), iters)
    print(f"cpu decode attention, batch {batch}, {seq_lens[0]}-{seq_lens[-1]} cached tokens, {num_layers} layers: "
          f"fast paths {fast_ms:.2f} ms, reference {reference_ms:.2f} ms ({reference_ms / fast_ms:.2f}x); "
          f"max |diff| {diff:.1e}")
    return dict(batch=batch, fast_ms=fast_ms, reference_ms=reference_ms, max_abs_diff=diff)


def peak_memory_bandwidth_gbs() -> float:
    """The device's theoretical DRAM bandwidth: 2 (DDR) x memory clock x bus width."""
    props = import_cupy().cuda.runtime.getDeviceProperties(torch.cuda.current_device())
    return 2 * props["memoryClockRate"] * 1e3 * props["memoryBusWidth"] / 8 / 1e9


def cuda_decode_attention(kernels: CudaKernels, iters: int) -> dict:
    batch, context, tpb, num_kv_heads, head_dim = 64, 4096, 16, 8, 128
    k_cache, v_cache, table, lens = paged_cache([context] * batch, tpb, num_kv_heads, head_dim, torch.float16,
                                                "cuda")
    q = torch.randn(batch, 32, head_dim, device="cuda", dtype=torch.float16)
    ms = timed_ms(lambda: kernels.decode_attention(q, k_cache, v_cache, table, lens, 0.088, None), iters,
                  torch.cuda.synchronize)
    achieved_gbs = 2 * k_cache.numel() * k_cache.element_size() / 1e9 / (ms / 1e3)
    peak_gbs = peak_memory_bandwidth_gbs()
    print(f"cuda decode attention, batch {batch} x {context} tokens: {ms * 1e3:.0f} us, {achieved_gbs:.0f} GB/s of KV "
          f"({torch.cuda.get_device_name()}; {achieved_gbs / peak_gbs:.0%} of its memory bandwidth)")
    return dict(us=ms * 1e3, achieved_gbs=achieved_gbs, peak_gbs=peak_gbs)


def cuda_sampling(kernels: CudaKernels, iters: int) -> dict:
    batch, vocab = 256, 128 * 1024
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(batch, vocab, device="cuda", generator=gen) * 3
    top_k = torch.tensor([0, 1, 40, 0, 1000, 0, 50, 0], device="cuda").repeat(batch // 8)
    top_p = torch.tensor([0.0, 0.0, 0.9, 0.95, 0.0, 0.5, 0.0, 0.0], device="cuda").repeat(batch // 8)
    u = torch.rand(batch, device="cuda", generator=gen)
    normalize = torch.ones(batch, dtype=torch.bool, device="cuda")
    timings = {name: timed_ms(lambda k=k: k.sample(logits, top_k, top_p, u, normalize), iters, torch.cuda.synchronize)
               for name, k in (("cuda", kernels), ("torch", TorchKernels()))}
    print(f"sampling {batch} x {vocab}: cuda kernel {timings['cuda']:.2f} ms, torch {timings['torch']:.2f} ms "
          f"({torch.cuda.get_device_name()})")
    return dict(cuda_ms=timings["cuda"], torch_ms=timings["torch"])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-only", action="store_true", help="skip the GPU figures even where a device exists")
    p.add_argument("--batches", default="8,34,64", help="CPU decode-attention batch sizes")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = p.parse_args(argv)
    results = {"cpu_decode_attention": [cpu_decode_attention(int(b), args.iters) for b in args.batches.split(",")]}
    if not args.cpu_only and cuda_available():
        kernels = CudaKernels()
        results["cuda_decode_attention"] = cuda_decode_attention(kernels, args.iters)
        results["cuda_sampling"] = cuda_sampling(kernels, args.iters)
    elif not args.cpu_only:
        print("no CUDA device with CuPy: GPU figures skipped")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
