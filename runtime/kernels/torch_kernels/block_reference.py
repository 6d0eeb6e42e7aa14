"""The torch reference of the block-format linear (cpu/blocks.py): W de-quantized by
gguf.quants.dequantize (numpy float32), the input quantized into the format's input type with the
kernels' arithmetic (quants_blocks.h: d = max|x| / 127 per block, q = round-half-even(x / d)) and
de-quantized, then one float64 matmul. For tests, and for machines without the native library.
"""
from __future__ import annotations

import gguf
import numpy as np
import torch

from ..cpu.blocks import K_BLOCK, SUM_GROUP, QuantizedInput, check_blocks, input_type


def dequantize_blocks(blocks: torch.Tensor, fmt: str, k: int) -> torch.Tensor:
    """float32 [n, k] of W = `blocks` uint8 [n, row_bytes] of `fmt` (gguf.quants.dequantize)."""
    n = check_blocks(blocks, fmt, k)
    values = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[fmt.upper()])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(n, k)


def quantize_input(x: torch.Tensor, fmt: str) -> QuantizedInput:
    """x float32 [rows, k] -> `fmt`'s input type, as the native bm_blk_quantize computes it."""
    kind = input_type(fmt)
    rows, k = x.shape
    block = K_BLOCK if kind == "q8k" else 32
    xb = x.to(torch.float32).reshape(rows, k // block, block)
    d = xb.abs().amax(-1) / 127
    q = torch.round(xb / torch.where(d == 0, 1, d)[..., None]).clamp(-127, 127)
    q = torch.where(d[..., None] == 0, 0, q).to(torch.int8).reshape(rows, k)
    group = SUM_GROUP[kind]
    sums = q.to(torch.int32).reshape(rows, k // group, group).sum(-1)
    return QuantizedInput(kind, q, d, sums.to(torch.int16 if kind == "q8k" else torch.int32))


def dequantize_input(quantized: QuantizedInput) -> torch.Tensor:
    """float64 [rows, k]: q * d exactly (the values the kernels' integer dot products see)."""
    rows, k = quantized.q.shape
    block = k // quantized.d.shape[1]
    q = quantized.q.to(torch.float64).reshape(rows, -1, block)
    return (q * quantized.d.to(torch.float64)[..., None]).reshape(rows, k)


def block_linear_reference(x: torch.Tensor, blocks: torch.Tensor, fmt: str, k: int,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [rows, n]: (quantized-then-de-quantized x) @ (de-quantized W)^T (+ bias), in float64."""
    w = dequantize_blocks(blocks, fmt, k).to(torch.float64)
    y = dequantize_input(quantize_input(x, fmt)) @ w.T
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(torch.float32)
