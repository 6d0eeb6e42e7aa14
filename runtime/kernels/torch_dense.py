"""The torch definitions of the dense ops (interface.KernelBackend.rms_norm, silu_mul, and the
weight-only linear with its de-quantization; a plain linear's is F.linear): what the torch
backend runs wherever its native CPU kernels do not, and what those kernels are tested against."""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
    """The float32 weight [out, in] of a weight-only one (also of a row subset: any leading rows):
    int8 [out, in] with scale [out]: q * scale; packed int4 uint8 [out, in / 2] with scale and
    minimum [out, in / group_size] (float16, or float32): q * scale + min in float32, in group g byte j holding column g*gs + j
    (low nibble) and g*gs + gs/2 + j (high nibble) (runtime/models/weight_only.py's layouts)."""
    if weight.dtype == torch.int8:
        return weight.float() * scale[:, None]
    out, groups = scale.shape
    packed = weight.view(out, groups, -1)
    q = torch.cat([packed & 15, packed >> 4], dim=2).float()   # [out, groups, gs]
    return (q * scale.float()[..., None] + minimum.float()[..., None]).reshape(out, -1)


def weight_only_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] -> [rows, out] in x's dtype: de-quantize, then F.linear in float32."""
    y = F.linear(x.float(), dequantize(weight, scale, minimum), None if bias is None else bias.float())
    return y.to(x.dtype)
