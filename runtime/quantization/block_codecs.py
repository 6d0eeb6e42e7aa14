"""The arithmetic of llama.cpp's quantized blocks: de-quantization in torch (bit for bit what
`gguf.quants.dequantize` computes: float32 products of the float16 scales and the integer levels,
in its order of operations) and quantizers of the 32-element formats in numpy (bytes equal to
`gguf.quants.quantize`, ggml's reference quantizers; the K formats' are in k_quants.py). Block
layouts (little-endian, f16 = IEEE half):

    q8_0  34 B: d f16, qs int8[32]                          value = d * q
    q4_0  18 B: d f16, qs[16] (low nibbles 0..15, high 16..31)   value = d * (q - 8)
    q4_1  20 B: d f16, m f16, qs[16]                        value = d * q + m
    q5_0  22 B: d f16, qh u32 (bit j: the 5th bit of value j), qs[16]   value = d * (q - 16)
    q4_k, q5_k, q6_k: super-blocks of 256 (k_quants.py's docstring)

Each `dequantize_*` takes uint8 [blocks, block bytes] and returns float32 [blocks, block elements].
Used by gguf_blocks.py (the format entries).
"""
from __future__ import annotations

import numpy as np
import torch

QK_K = 256


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """float32 [blocks, 1]: the float16 stored at byte `at` of each block."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _shifts(values: tuple[int, ...], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device).reshape(shape)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [blocks, 16] -> [blocks, 32]: the low nibbles, then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _f16(blocks, 0)


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return _f16(blocks, 0) * q.float()


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _f16(blocks, 2)


def dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    bits = (blocks[:, 2:6, None] >> _shifts(tuple(range(8)), (1, 1, 8), blocks.device)) & 1   # [blocks, 4, 8]
    q = _nibbles(blocks[:, 6:]) | (bits.reshape(-1, 32) << 4)
    return _f16(blocks, 0) * (q.to(torch.int8) - 16).float()


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 packed bytes [blocks, 12] -> (8 six-bit scales, 8 six-bit mins) float32."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.float(), mn.float()


def _low_high(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [blocks, 128] -> [blocks, 8, 32]: per 32 bytes, their low nibbles then their high ones."""
    halves = qs.reshape(-1, 4, 1, 32) >> _shifts((0, 4), (1, 1, 2, 1), qs.device)
    return (halves & 0x0F).reshape(-1, 8, 32)


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    d = (_f16(blocks, 0) * sc)[..., None]
    dm = (_f16(blocks, 2) * mn)[..., None]
    return (d * _low_high(blocks[:, 16:]).float() - dm).reshape(-1, QK_K)


def dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    d = (_f16(blocks, 0) * sc)[..., None]
    dm = (_f16(blocks, 2) * mn)[..., None]
    qh = (blocks[:, None, 16:48] >> _shifts(tuple(range(8)), (1, 8, 1), blocks.device)) & 1   # [blocks, 8, 32]
    q = _low_high(blocks[:, 48:]) | (qh << 4)
    return (d * q.float() - dm).reshape(-1, QK_K)


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    d = (_f16(blocks, 208) * blocks[:, 192:208].contiguous().view(torch.int8).float())[..., None]   # [blocks, 16, 1]
    ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> _shifts((0, 4), (1, 1, 2, 1), blocks.device)
    ql = (ql & 0x0F).reshape(-1, 8, 32)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> _shifts((0, 2, 4, 6), (1, 1, 4, 1), blocks.device)
    qh = (qh & 0x03).reshape(-1, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(-1, 16, 16).float()
    return (d * q).reshape(-1, QK_K)


# -- quantizers of the 32-element formats (ggml's quantize_row_*_ref) ----------------------------------

def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 levels [blocks, 32] -> [blocks, 16]: value j in the low nibble of byte j, value 16 + j in its high."""
    return (q[:, :16] & 0x0F) | (q[:, 16:] << np.uint8(4))


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _signed_max(blocks: np.ndarray) -> np.ndarray:
    """[blocks, 1]: each block's value of largest magnitude, with its sign."""
    return np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)


def _half_bytes(d: np.ndarray) -> np.ndarray:
    return d.astype(np.float16).view(np.uint8).reshape(-1, 2)


def quantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    scaled = blocks * _inverse(d)
    magnitude = np.abs(scaled)
    whole = np.floor(magnitude)
    q = np.sign(scaled) * (whole + np.floor(2 * (magnitude - whole)))   # round half away from zero
    return np.concatenate([_half_bytes(d), q.astype(np.int8).view(np.uint8)], axis=1)


def quantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    d = _signed_max(blocks) / np.float32(-8)
    q = np.trunc(blocks * _inverse(d) + np.float32(8.5)).astype(np.uint8).clip(0, 15)
    return np.concatenate([_half_bytes(d), _pack_nibbles(q)], axis=1)


def quantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    low, high = blocks.min(axis=1, keepdims=True), blocks.max(axis=1, keepdims=True)
    d = (high - low) / np.float32(15)
    q = np.trunc((blocks - low) * _inverse(d) + np.float32(0.5)).astype(np.uint8).clip(0, 15)
    return np.concatenate([_half_bytes(d), _half_bytes(low), _pack_nibbles(q)], axis=1)


def quantize_q5_0(blocks: np.ndarray) -> np.ndarray:
    d = _signed_max(blocks) / np.float32(-16)
    q = np.trunc(blocks * _inverse(d) + np.float32(16.5)).astype(np.uint8).clip(0, 31)
    qh = np.packbits(q >> np.uint8(4), axis=1, bitorder="little")   # [blocks, 4]: bit j = value j's 5th bit
    return np.concatenate([_half_bytes(d), qh, _pack_nibbles(q)], axis=1)
