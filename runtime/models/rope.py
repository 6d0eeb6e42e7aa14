"""Rotary position embeddings: inverse frequencies (with the config's scaling) and application,
over the first rotary_dim dims of each head (partial rotary) with either pairing of dims.

Computed in float32 in the same operation order as transformers, so the cos/sin tables match
its reference bit for bit.
"""
from __future__ import annotations

import math

import torch

from ..config import RopeConfig


def rope_inv_freq(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    """float32 [rotary_dim // 2]: one frequency per rotated pair."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.scaling_type == "default":
        return inv_freq
    if rope.scaling_type == "linear":
        return inv_freq / rope.factor
    if rope.scaling_type == "freq_factors":
        return inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
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


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, style: str = "neox"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions int [T] -> cos, sin [T, 1, rotary_dim] in `dtype` (broadcast over heads), laid out
    like the dims they rotate: frequency i at dims i and i + rotary_dim / 2 ("neox") or at dims
    2i and 2i + 1 ("interleaved")."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1) if style == "neox" else freqs.repeat_interleave(2, dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "neox") -> torch.Tensor:
    """x [T, heads, head_dim] rotated by position over its first rotary_dim = cos.shape[-1] dims.
    "neox": the rotate-half convention of HF LLaMA and GPT-NeoX (dim i pairs with i + rotary_dim / 2);
    "interleaved": GPT-J's rotate-every-two (dim 2i pairs with 2i + 1)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary_dim], cos, sin, style), x[..., rotary_dim:]), dim=-1)
    if style == "neox":
        half = rotary_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    else:
        rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return x * cos + rotated * sin
