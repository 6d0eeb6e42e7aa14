"""The torch definitions of the dense ops (interface.KernelBackend.rms_norm, silu_mul, and the
weight-only linear with its de-quantization; a plain linear's is F.linear): what the torch
backend runs wherever its native CPU kernels do not, and what those kernels are tested against."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...quantization import lookup_dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., h], weight [h] -> x * rsqrt(mean(x^2) + eps) * weight in x's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # Half precision: normalise in float32, as the reference implementation does.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2n] (gate | up) -> silu(gate) * up [..., n]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight [out, in] of a weight-only one (also of a row subset: any leading rows),
    as the format its stored dtype names defines it (runtime.quantization; minimum: None for a
    format with one part)."""
    return lookup_dtype(weight.dtype).dequantize(weight, *(part for part in (scale, minimum) if part is not None))


def weight_only_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] -> [rows, out] in x's dtype: de-quantize, then F.linear in float32."""
    y = F.linear(x.float(), dequantize(weight, scale, minimum), None if bias is None else bias.float())
    return y.to(x.dtype)
