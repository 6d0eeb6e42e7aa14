"""The weight-format registry: config value (BuildConfig.weight_only) or stored layout -> `WeightFormat`.

Holds the built-in entries (int8, int4) and any registered later; config validation, the engine
loader, tensor-parallel slicing and the kernel backends look entries up here, so adding a format
is one new module (and its kernels).

NOTE: a stored layout names its format twice: by W's dtype where the tensors are at hand (the
kernels), by the part names beside W where only names and shapes are (tensor-parallel slicing of
files not yet read); every entry differs from every other in both.
"""
from __future__ import annotations

from collections.abc import Container

import torch

from ..errors import ConfigError
from .format import WeightFormat
from .int4 import INT4
from .int8 import INT8

_NAME_TO_FORMAT: dict[str, WeightFormat] = {}


def register(weight_format: WeightFormat) -> WeightFormat:
    """Add an entry; its name, W dtype and part names must be new."""
    for other in _NAME_TO_FORMAT.values():
        for field, is_taken in (("name", other.name == weight_format.name),
                                ("weight_dtype", other.weight_dtype == weight_format.weight_dtype),
                                ("suffixes", set(other.suffixes) == set(weight_format.suffixes))):
            if is_taken:
                raise ValueError(f"{field}: {getattr(weight_format, field)!r} is already registered by weight "
                                 f"format {other.name!r}")
    _NAME_TO_FORMAT[weight_format.name] = weight_format
    return weight_format


def unregister(name: str) -> None:
    if _NAME_TO_FORMAT.pop(name, None) is None:
        raise ValueError(f"name: weight format {name!r} is not registered")


def supported_formats() -> tuple[str, ...]:
    """The config values of the registered entries (BuildConfig.weight_only besides None)."""
    return tuple(_NAME_TO_FORMAT)


def lookup(weight_only: object) -> WeightFormat:
    """The entry for the config value `weight_only`, or ConfigError naming it."""
    weight_format = _NAME_TO_FORMAT.get(weight_only) if isinstance(weight_only, str) else None
    if weight_format is None:
        raise ConfigError(f"weight_only: unsupported value {weight_only!r}; supported: None, "
                          f"{', '.join(map(repr, _NAME_TO_FORMAT))}")
    return weight_format


def lookup_build(weight_only: str | None) -> WeightFormat | None:
    """lookup(weight_only), None for None (weights stay in the compute dtype)."""
    return None if weight_only is None else lookup(weight_only)


def lookup_dtype(weight_dtype: torch.dtype) -> WeightFormat | None:
    """The entry whose W is stored as `weight_dtype`; None: no quantized format (a float weight)."""
    return next((f for f in _NAME_TO_FORMAT.values() if f.weight_dtype == weight_dtype), None)


def lookup_stored(names: Container[str], base: str) -> WeightFormat | None:
    """The entry whose parts stored beside the weight `base` are all in `names` (the one with the
    most parts when several are); None: `base` is stored in float."""
    found = [f for f in _NAME_TO_FORMAT.values() if all(base + suffix in names for suffix in f.suffixes)]
    return max(found, key=lambda f: len(f.suffixes), default=None)


def split_part(name: str) -> tuple[str, str]:
    """(the weight's name, the part's suffix) of a stored tensor name: ("W", "_scale") for
    "W_scale"; (name, "") for a weight itself."""
    for weight_format in _NAME_TO_FORMAT.values():
        for suffix in weight_format.suffixes:
            if name.endswith(suffix):
                return name[:-len(suffix)], suffix
    return name, ""


for _format in (INT8, INT4):
    register(_format)
