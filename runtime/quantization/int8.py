"""Weight-only int8, one scale per output channel: `W` int8 [out, in], `W_scale` float32 [out];
w = q * scale (symmetric, round to nearest, |q| <= 127). Under tensor parallelism a row-parallel
rank takes W's columns and keeps the per-row scales whole."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..precision import QuantMode
from .format import PartLayout, Ranges, WeightFormat


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in], float32 scale [out])."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


@dataclass(frozen=True)
class Int8Format(WeightFormat):
    def stored_layout(self, out: int, width: int, group_size: int) -> PartLayout:
        return {"": (torch.int8, (out, width)), "_scale": (torch.float32, (out,))}

    def quantize(self, weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_int8(weight)

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return weight.float() * scale[:, None]

    def max_error(self, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return scale[:, None] / 2

    def input_width(self, weight: torch.Tensor) -> int:
        return weight.shape[1]

    def column_spans(self, suffix: str, spans: Ranges, shapes: dict[str, tuple[int, ...]], name: str,
                     size: int) -> Ranges | None:
        return spans if suffix == "" else None


INT8 = Int8Format(name="int8", quant_mode=QuantMode.INT8_WEIGHTS | QuantMode.PER_CHANNEL, weight_dtype=torch.int8,
                  suffixes=("_scale",), is_grouped=False)
