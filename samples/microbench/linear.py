"""CPU linear kernels by row count on a model's matmul weights (runtime/kernels/torch_kernels/linear.py's choice of
NATIVE_MAX_ROWS):

    python -m samples.microbench.linear [--rows 1,2,4,8,12,16,32,64] [--threads N] [--reps 15]

The weights of every layer and the lm_head (the default model's shapes), so that each pass
streams them from memory as a generation step does; per row count, one pass of each kernel in
turn (native on the [out, in] weight, oneDNN on its reordered copy, W @ x^T through BLAS),
`--reps` times; the best pass of each, in ms and in GB/s of weights read.
"""
from __future__ import annotations

import argparse
import time

import torch

from runtime.kernels.cpu.cpu_native import native_ops
from runtime.kernels.torch_kernels.linear import onednn_available
from samples.default_model import LLAMA_50M


def model_shapes(cfg: dict) -> list[tuple[int, int]]:
    """[out, in] of every matmul weight of a LLaMA-style config, in the order a step uses them."""
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    return [(h + 2 * kv, h), (h, h), (2 * i, h), (h, i)] * layers + [(cfg["vocab_size"], h)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,12,16,32,64")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inp, generator=gen) * 0.02 for out, inp in model_shapes(LLAMA_50M)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    native = native_ops()
    kernels = {}
    if native is not None:
        kernels["native"] = lambda x, w, packed: native.linear(x, w, None)
    if onednn_available(torch.float32):
        kernels["onednn"] = lambda x, w, packed: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    kernels["w_xt"] = lambda x, w, packed: torch.mm(w, x.t())
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) if "onednn" in kernels else None for w in weights]
    print(f"{len(weights)} weights, {nbytes / 1e6:.1f} MB, {torch.get_num_threads()} threads; best of {args.reps}")
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            inputs = {inp: torch.randn(rows, inp, generator=gen) for inp in {w.shape[1] for w in weights}}
            best_s = dict.fromkeys(kernels, float("inf"))
            for _ in range(args.reps + 1):  # the first pass warms up
                for name, kernel in kernels.items():
                    start = time.perf_counter()
                    for w, pk in zip(weights, packed):
                        kernel(inputs[w.shape[1]], w, pk)
                    best_s[name] = min(best_s[name], time.perf_counter() - start)
            print(f"rows {rows:>3}: " + "  ".join(f"{name} {s * 1e3:6.2f} ms ({nbytes / s / 1e9:4.1f} GB/s)"
                                                  for name, s in best_s.items()))


if __name__ == "__main__":
    main()
