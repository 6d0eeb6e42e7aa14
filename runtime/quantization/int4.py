"""Weight-only int4, a scale and a minimum per group of `group_size` input columns: `W` uint8
[out, in / 2], `W_scale` and `W_min` float16 [out, in / group_size] (0.625 bytes per weight in all;
engine directories written with float32 ones load, converted); w = q * scale + min with q in
0..15. In group g, byte j holds column g*gs + j (low nibble) and g*gs + gs/2 + j (high nibble):
GGUF Q4_0 / Q4_1's layout (Q4_1: scale d, min m; Q4_0: scale d, min -8 d). Under tensor
parallelism a row-parallel rank takes half W's columns and one scale and min per group; a group
never straddles two ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import ConfigError
from ..precision import QuantMode
from .format import PartLayout, Ranges, WeightFormat

if TYPE_CHECKING:
    from ..config import ModelConfig


def check_group_alignment(spans: Ranges, group_size: int, what: str, size: int) -> None:
    """ConfigError naming group_size when a span of input columns does not start and end on a group."""
    for start, stop in spans:
        if start % group_size or stop % group_size:
            raise ConfigError(f"group_size: {group_size} does not divide the {stop - start} input columns "
                              f"of {what} each of {size} tensor-parallel ranks holds (columns {start}..{stop}); "
                              "use a group size that divides them, or fewer ranks")


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float -> (packed uint8 [out, in / 2], scale, min float16 [out, in / group_size]).
    The nibbles are rounded against the float16 scale and min they will be read with."""
    out, width = weight.shape
    assert width % group_size == 0, f"group_size {group_size} does not divide {width}"
    w = weight.float().view(out, width // group_size, group_size)
    half_max = torch.finfo(torch.float16).max
    low = w.amin(dim=2).clamp(-half_max, half_max).half()
    scale = ((w.amax(dim=2) - low.float()) / 15.0).clamp(max=half_max).half()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))   # also a range below float16's smallest step
    q = torch.round((w - low.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15).to(torch.uint8)
    half = group_size // 2
    packed = q[..., :half] | (q[..., half:] << 4)   # [out, groups, gs / 2]
    return packed.reshape(out, width // 2).contiguous(), scale.contiguous(), low.contiguous()


@dataclass(frozen=True)
class Int4Format(WeightFormat):
    def stored_layout(self, out: int, width: int, group_size: int) -> PartLayout:
        groups = (out, width // group_size)
        return {"": (torch.uint8, (out, width // 2)), "_scale": (torch.float16, groups),
                "_min": (torch.float16, groups)}

    def quantize(self, weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return quantize_int4(weight, group_size)

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
        out, groups = scale.shape
        packed = weight.view(out, groups, -1)
        q = torch.cat([packed & 15, packed >> 4], dim=2).float()   # [out, groups, gs]
        return (q * scale.float()[..., None] + minimum.float()[..., None]).reshape(out, -1)

    def max_error(self, weight: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
        return scale.float().repeat_interleave(2 * weight.shape[1] // scale.shape[1], 1) / 2

    def input_width(self, weight: torch.Tensor) -> int:
        return weight.shape[1] * 2

    def column_spans(self, suffix: str, spans: Ranges, shapes: dict[str, tuple[int, ...]], name: str,
                     size: int) -> Ranges | None:
        group_size = 2 * shapes[""][1] // shapes["_scale"][1]
        check_group_alignment(spans, group_size, name, size)
        divisor = 2 if suffix == "" else group_size
        return tuple((start // divisor, stop // divisor) for start, stop in spans)

    def check_model(self, model: ModelConfig, group_size: int) -> None:
        for name, width in (("hidden_size", model.hidden_size), ("intermediate_size", model.intermediate_size),
                            ("query width (num_heads * head_dim)", model.q_size)):
            if width % group_size:
                raise ConfigError(f"group_size: {group_size} does not divide the model's {name} {width}")

    def check_shard(self, out_columns: Ranges, intermediate_columns: Ranges, group_size: int, size: int) -> None:
        check_group_alignment(out_columns, group_size, "the attention output", size)
        check_group_alignment(intermediate_columns, group_size, "the MLP down projection", size)


INT4 = Int4Format(name="int4", quant_mode=QuantMode.INT4_WEIGHTS | QuantMode.PER_GROUP, weight_dtype=torch.uint8,
                  suffixes=("_scale", "_min"), is_grouped=True)
