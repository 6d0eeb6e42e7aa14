"""`WeightFormat`: what one weight-only format declares (its registry entry's interface); int8.py and
int4.py hold instances, registry.py looks them up. Torch and precision only: the kernel
backends import the entries, never the other way round; the config is read here, never imported (it
asks the registry).

A quantized canonical weight `W` is stored as `W` (`weight_dtype`) plus one tensor per suffix
(`W_scale`, ...); code takes them as (W, *parts), the parts in `suffixes` order.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..precision import QuantMode
from .native_codes import weight_code

if TYPE_CHECKING:
    from ..config import ModelConfig

Ranges = tuple[tuple[int, int], ...]   # [start, stop) spans, ascending (runtime.parallel.tensor_shard)
PartLayout = dict[str, tuple[torch.dtype, tuple[int, ...]]]   # suffix ("" for W) -> (stored dtype, shape)


@dataclass(frozen=True)
class WeightFormat(abc.ABC):
    name: str                   # the config value: BuildConfig.weight_only, engine.json, --weight-only
    quant_mode: QuantMode       # its QuantMode bits (engine.model_config.quant_mode)
    weight_dtype: torch.dtype   # W's stored dtype; no two entries share one (the kernels' lookup key)
    suffixes: tuple[str, ...]   # the parts stored beside W; no two entries share a set (the names' lookup key)
    is_grouped: bool            # parts per group of BuildConfig.group_size input columns (else per output row)

    @property
    def native_code(self) -> int | None:
        """Its code in the native CPU layer's format table (native_codes.py); None: no native kernel."""
        return weight_code(self.name)

    @abc.abstractmethod
    def stored_layout(self, out: int, width: int, group_size: int) -> PartLayout:
        """The stored parts of a float weight [out, width]."""

    @abc.abstractmethod
    def quantize(self, weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, ...]:
        """float [out, in] -> (W, *parts) as stored_layout says."""

    @abc.abstractmethod
    def dequantize(self, weight: torch.Tensor, *parts: torch.Tensor) -> torch.Tensor:
        """(W, *parts) of any leading rows -> the float32 weight [rows, in] (the torch reference)."""

    @abc.abstractmethod
    def max_error(self, weight: torch.Tensor, *parts: torch.Tensor) -> torch.Tensor:
        """float32 [out, in]: the bound |dequantize(quantize(w)) - w| keeps (half a step)."""

    @abc.abstractmethod
    def input_width(self, weight: torch.Tensor) -> int:
        """in, the float weight's columns, of a stored W."""

    @abc.abstractmethod
    def column_spans(self, suffix: str, spans: Ranges, shapes: dict[str, tuple[int, ...]], name: str,
                     size: int) -> Ranges | None:
        """Of the row-parallel weight `name` whose input columns each of `size` ranks takes in `spans`:
        part `suffix`'s spans along dim 1 (None: held whole); `shapes`: suffix -> whole stored shape.
        ConfigError naming group_size where a span would split a group."""

    def check_model(self, model: ModelConfig, group_size: int) -> None:
        """ConfigError naming the field when `model`'s widths do not fit this format."""

    def check_shard(self, out_columns: Ranges, intermediate_columns: Ranges, group_size: int, size: int) -> None:
        """ConfigError naming group_size when a rank's input columns of the row-parallel linears split a group."""
