"""Rotary position embeddings: inverse frequencies (with the config's scaling) and application.

Computed in float32 in the same operation order as transformers, so the cos/sin tables match
its reference bit for bit.
"""
from __future__ import annotations

import math

import torch

from .config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """float32 [head_dim // 2]."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.scaling_type == "default":
        return inv_freq
    if rope.scaling_type == "linear":
        return inv_freq / rope.factor
    if rope.scaling_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope scaling_type: unsupported {rope.scaling_type!r}")


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions int [T] -> cos, sin [T, 1, head_dim] in `dtype` (broadcast over heads)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by position: rotary_style "neox", the rotate-half convention of
    HF LLaMA and GPT-NeoX (the first and second halves of each head form the pairs)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
