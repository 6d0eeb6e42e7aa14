"""The native CPU layer's one format table: the codes declared in runtime/quantization/native_codes.py
and in runtime/kernels/cpu/formats.h agree (a code declared on one side only fails), the weight
formats' entries read their codes from that list, int8 activations are an input type (not format
codes of their own), and a registered weight format without a native kernel is a clear ConfigError."""
from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from runtime.config import ConfigError
from runtime.kernels.cpu import library
from runtime.kernels.cpu.cpu_native import native_ops
from runtime.kernels.torch_kernels.weight_only_linear import QuantizedLinear
from runtime.quantization import INT4, INT8, native_codes, register, supported_formats, unregister
from runtime.quantization.int8 import quantize_int8

FORMATS_H = (library.HERE / "formats.h").read_text()


def declared_in_cpp(enum: str, prefix: str) -> dict[str, int]:
    """name -> code of `enum`'s enumerators k<prefix><Name> in formats.h (names lower-cased)."""
    body = re.search(rf"enum {enum} : int32_t \{{([^}}]*)\}}", FORMATS_H).group(1)
    return {name.lower(): int(code) for name, code in re.findall(rf"k{prefix}(\w+) = (\d+)", body)}


@pytest.mark.parametrize("enum, prefix, declared", [("WeightFormat", "Weight", native_codes.WEIGHT_FORMATS),
                                                    ("InputType", "Input", native_codes.INPUT_TYPES),
                                                    ("KvFormat", "Kv", native_codes.KV_FORMATS)])
def test_both_sides_declare_the_same_codes(enum, prefix, declared):
    assert declared_in_cpp(enum, prefix) == {name: code for code, name in enumerate(declared)}


def test_the_weight_formats_read_their_codes_from_the_one_list():
    assert INT8.native_code == native_codes.WEIGHT_FORMATS.index("int8")
    assert INT4.native_code == native_codes.WEIGHT_FORMATS.index("int4")
    for name in supported_formats():
        assert name in native_codes.WEIGHT_FORMATS


def test_int8_activations_are_an_input_type_not_format_codes():
    # the stored layouts: the four of the engine's own modes and llama.cpp's seven block formats
    assert native_codes.WEIGHT_FORMATS == ("float32", "bf16", "int8", "int4", "q8_0", "q4_0", "q4_1", "q5_0",
                                           "q4_k", "q5_k", "q6_k")
    assert "q8x32" in native_codes.INPUT_TYPES and "q8k" in native_codes.INPUT_TYPES
    sources = {name: (library.HERE / name).read_text() for name in (*library.SOURCES, *library.HEADERS)}
    for name, text in sources.items():
        assert not re.search(r"format == [0-9]|format - 2|native_code \+ 2", text), name


def test_a_registered_format_without_a_native_kernel_is_a_config_error():
    if native_ops() is None:
        pytest.skip("the native CPU kernels cannot run here")
    # int8's arithmetic under a new name and W dtype: a Python entry, but no row in the native table
    wide = register(replace(INT8, name="int8_wide", weight_dtype=torch.int16, suffixes=("_wide_scale",)))
    try:
        q, scale = quantize_int8(torch.randn(8, 64))
        weight = q.to(torch.int16)
        assert wide.native_code is None
        for act_quant in (None, "int8"):
            with pytest.raises(ConfigError, match="^weight_only: weight format 'int8_wide' has no native CPU kernel"):
                QuantizedLinear(weight, scale, None, None, act_quant=act_quant)
    finally:
        unregister("int8_wide")
