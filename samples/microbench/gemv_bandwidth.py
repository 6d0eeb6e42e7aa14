"""One-row GEMV of each weight format against this machine's measured read bandwidth, in one process.

Bandwidth: a torch sum over --bandwidth-gib GiB of float32 at each thread count, on 4 KiB pages
and on huge pages (runtime/kernels/cpu/weight_memory.py, where the kernel has them), measured again
(best of --repeats) before every GEMV and the best of all kept (on a shared machine the fraction is
then against the quietest moment, a lower bound). GEMV: x [1, in] times a model-sized weight [out, in] with the kernel a one-stream generation
step runs for its format (the native float32 and bf16 linears, the exact int8 / int4 weight-only
kernels, int8 / int4 with int8 activations over the repacked weight, llama.cpp's q8_0 and q4_0
blocks over their 8-row interleaved copy), held as an engine holds it (weight_memory.hold),
cycling through enough copies of the weight to read --stream-mib MiB per pass (a model's weights
are read once per step, never from the cache). Printed per (threads, shape, format): ms per GEMV, GB/s of the weight bytes the
kernel reads (as held: a repacked weight's own bytes) and that rate's fraction of the bandwidth.

    python -m samples.microbench.gemv_bandwidth [--threads 1 2] [--shapes 8192x2048 1536x576]
"""
from __future__ import annotations

import argparse
import time

import torch


def best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes per second of a torch sum over a float32 tensor of num_bytes (at torch's thread count),
    the better of 4 KiB pages and huge pages."""
    from runtime.kernels.cpu.weight_memory import hold, seal
    plain = torch.ones(num_bytes // 4)
    rates = [num_bytes / best_seconds(lambda: plain.sum(), repeats)]
    del plain
    held = hold(torch.ones(num_bytes // 4))
    seal()
    rates.append(num_bytes / best_seconds(lambda: held.sum(), repeats))
    return max(rates)


def format_kernels(n: int, k: int, group_size: int) -> dict[str, tuple]:
    """format -> (make(seed) -> (the tensors the kernel reads, fn(x) -> y), x's dtype), for the
    formats this machine runs. bf16 takes bf16 inputs, as the eager bf16 model's activations are and
    as the fused step rounds them for AVX512-BF16's dot product (a float32 x would run the kernel
    that widens the weights instead)."""
    import gguf
    import numpy as np

    from runtime.kernels.cpu import act_quant as aq
    from runtime.kernels.cpu.blocks import block_ops
    from runtime.kernels.cpu.cpu_native import native_ops
    from runtime.kernels.cpu.cpu_native_bf16 import bf16_ops
    from runtime.kernels.cpu.cpu_weight_only import weight_only_ops
    from runtime.kernels.cpu.weight_memory import hold
    from runtime.quantization.int4 import quantize_int4
    from runtime.quantization.int8 import quantize_int8
    native, bf16, weight_only, act, blocks = (native_ops(), bf16_ops(), weight_only_ops(), aq.act_quant_ops(),
                                              block_ops())

    def weight(seed: int) -> torch.Tensor:
        return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02

    def dense(ops, dtype):
        def make(seed):
            w = hold(weight(seed).to(dtype))
            return (w,), lambda x: ops.linear(x, w, None)
        return make

    def quantized(quantize, act_quant: bool):
        def make(seed):
            parts = quantize(weight(seed))
            parts = parts + (None,) if len(parts) == 2 else parts
            if act_quant:
                packed = aq.pack(*parts)
                return (packed.packed, packed.scale, packed.minimum), act.bind(packed, None)
            parts = (hold(parts[0]),) + parts[1:]
            return parts, weight_only.bind(*parts, None)
        return make

    def block(fmt: str, quant_type):
        def make(seed):
            stored = gguf.quants.quantize(weight(seed).numpy(), quant_type)
            bound = blocks.bind(torch.from_numpy(np.ascontiguousarray(stored)).reshape(n, -1), fmt, k)
            return (bound.blocks,), bound
        return make

    int4 = lambda w: quantize_int4(w, group_size)   # noqa: E731
    kernels = {}
    if native is not None:
        kernels["float32"] = dense(native, torch.float32)
    if bf16 is not None:
        kernels["bf16"] = dense(bf16, torch.bfloat16)
    if weight_only is not None:
        kernels["int8"], kernels["int4"] = quantized(quantize_int8, False), quantized(int4, False)
    if act is not None:
        kernels["int8+a8"], kernels["int4+a8"] = quantized(quantize_int8, True), quantized(int4, True)
    if blocks is not None and k % 32 == 0:
        kernels["q8_0"] = block("q8_0", gguf.GGMLQuantizationType.Q8_0)
        kernels["q4_0"] = block("q4_0", gguf.GGMLQuantizationType.Q4_0)
    return {name: (make, torch.bfloat16 if name == "bf16" else torch.float32) for name, make in kernels.items()}


def gemv_rate(make, k: int, stream_bytes: int, repeats: int, dtype: torch.dtype) -> tuple[float, int]:
    """(seconds per GEMV of an x in `dtype`, weight bytes per GEMV) over copies of the weight cycled
    per pass."""
    first, fn = make(0)
    weight_bytes = sum(t.numel() * t.element_size() for t in first if t is not None)
    copies = [fn] + [make(seed)[1] for seed in range(1, max(1, -(-stream_bytes // weight_bytes)))]
    x = torch.randn(1, k).to(dtype)

    def one_pass():
        for f in copies:
            f(x)
    return best_seconds(one_pass, repeats) / len(copies), weight_bytes


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--shapes", nargs="+", default=["8192x2048", "1536x576"], help="out x in")
    p.add_argument("--formats", nargs="+", help="default: every format this machine runs")
    p.add_argument("--group-size", type=int, default=32, help="int4's group size")
    p.add_argument("--bandwidth-gib", type=float, default=1.0)
    p.add_argument("--stream-mib", type=int, default=512, help="weight bytes read per timed pass")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    from samples.microbench.weight_only import cpu_description
    print(f"{cpu_description()}; one-row GEMV against a torch sum over {args.bandwidth_gib:g} GiB "
          f"(best of {args.repeats}; {args.stream_mib} MiB of weights per pass)")
    results = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        results[threads] = measure(args, lambda: read_bandwidth(int(args.bandwidth_gib * 2**30), args.repeats))
        bandwidth = results[threads]["bandwidth"]
        print(f"{threads} thread(s): read bandwidth {bandwidth / 1e9:.1f} GB/s (the best of every measurement)")
        for (shape, name), row in results[threads]["gemv"].items():
            print(f"  {shape:10s} {name:8s} {row['ms']:8.3f} ms  {row['bytes_per_s'] / 1e9:6.1f} GB/s  "
                  f"{row['bytes_per_s'] / bandwidth:5.0%} of the bandwidth")
    return results


def measure(args: argparse.Namespace, bandwidth) -> dict:
    """{"bandwidth": the best of the readings before each GEMV, "gemv": (shape, format) -> {"ms",
    "bytes_per_s"}} at torch's thread count."""
    best, gemv = 0.0, {}
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        for name, (make, dtype) in format_kernels(n, k, args.group_size).items():
            if args.formats and name not in args.formats:
                continue
            best = max(best, bandwidth())
            seconds, weight_bytes = gemv_rate(make, k, args.stream_mib * 2**20, args.repeats, dtype)
            gemv[(shape, name)] = {"ms": seconds * 1e3, "bytes_per_s": weight_bytes / seconds}
    return {"bandwidth": max(best, bandwidth()), "gemv": gemv}


if __name__ == "__main__":
    main()
