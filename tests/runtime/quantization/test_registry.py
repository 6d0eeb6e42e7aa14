"""The weight-format registry (runtime/quantization): every entry round-trips within the bound it
declares, lookups by config value and by stored layout, the ConfigErrors naming a bad value, and
a kernel backend refusing a KV storage dtype it does not declare."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from runtime.config import BuildConfig, ConfigError
from runtime.kernels import TorchKernels
from runtime.kernels.cuda.cuda_backend import CudaKernels
from runtime.kernels.kv_quant import check_kv_storage
from runtime.kernels.torch_kernels.torch_dense import dequantize
from runtime.precision import QuantMode
from runtime.quantization import (INT4, INT8, lookup, lookup_dtype, lookup_stored, register, split_part,
                                  supported_formats, unregister)
from runtime.quantization.stored import quantize_weights, stored_layout
from runtime.loading.weights import expected_shapes
from runtime.models import model_config_from_hf
from tests.factories import hf_config

MODELS = Path(__file__).resolve().parents[3] / "runtime" / "models"


@pytest.mark.parametrize("name", supported_formats())
@pytest.mark.parametrize("group_size", [32, 128])
def test_every_format_round_trips_within_its_declared_bound(name, group_size):
    weight_format = lookup(name)
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(1)) * 0.2
    stored = weight_format.quantize(weight, group_size)
    layout = weight_format.stored_layout(48, 256, group_size)
    assert [(t.dtype, tuple(t.shape)) for t in stored] == list(layout.values())
    assert list(layout) == ["", *weight_format.suffixes]
    assert weight_format.input_width(stored[0]) == 256
    restored = weight_format.dequantize(*stored)
    assert ((restored - weight).abs() <= weight_format.max_error(*stored) + 1e-6).all()
    assert torch.equal(dequantize(*stored), restored)   # the kernels' reference finds it by W's dtype


def test_lookup_by_config_value_and_by_stored_layout():
    assert supported_formats() == ("int8", "int4")
    assert lookup("int8") is INT8 and lookup("int4") is INT4
    assert lookup_dtype(torch.int8) is INT8 and lookup_dtype(torch.uint8) is INT4
    assert lookup_dtype(torch.float32) is None
    assert lookup_stored({"w", "w_scale"}, "w") is INT8
    assert lookup_stored({"w", "w_scale", "w_min"}, "w") is INT4
    assert lookup_stored({"w", "v_scale"}, "w") is None
    assert split_part("layers.0.qkv.weight_min") == ("layers.0.qkv.weight", "_min")
    assert split_part("lm_head") == ("lm_head", "")
    assert INT8.quant_mode.is_int8_weight_only() and INT4.quant_mode.is_int4_weight_only()


def test_stored_layout_of_a_build_is_what_quantize_writes():
    cfg = model_config_from_hf(hf_config("llama").to_dict())
    for name in supported_formats():
        build = BuildConfig(weight_only=name, group_size=32)
        weights = {n: torch.randn(shape) for n, shape in expected_shapes(cfg).items()}
        quantized = quantize_weights(weights, cfg, build)
        for stored_name, (dtype, shape) in stored_layout(cfg, build).items():
            assert (quantized[stored_name].dtype, tuple(quantized[stored_name].shape)) == (dtype, shape)


@pytest.mark.parametrize("value", ["fp4", "INT8", 8])
def test_an_unknown_format_is_a_config_error_naming_the_value(value):
    with pytest.raises(ConfigError, match=f"weight_only: unsupported value {value!r}"):
        lookup(value)
    with pytest.raises(ConfigError, match="weight_only"):
        BuildConfig(weight_only=value).validated()


def test_register_refuses_a_taken_name_dtype_or_layout_and_a_new_entry_is_found():
    with pytest.raises(ValueError, match="name"):
        register(INT8)
    with pytest.raises(ValueError, match="weight_dtype"):
        register(dataclasses.replace(INT8, name="int8b"))
    with pytest.raises(ValueError, match="suffixes"):
        register(dataclasses.replace(INT8, name="fp8", weight_dtype=torch.float8_e4m3fn))
    fp8 = register(dataclasses.replace(INT8, name="fp8", weight_dtype=torch.float8_e4m3fn, suffixes=("_fp8_scale",),
                                       quant_mode=QuantMode(0)))
    try:
        assert lookup("fp8") is fp8 and lookup_dtype(torch.float8_e4m3fn) is fp8
        assert BuildConfig(weight_only="fp8").validated().weight_only == "fp8"
    finally:
        unregister("fp8")
    assert "fp8" not in supported_formats()


@pytest.mark.parametrize("backend", [TorchKernels, CudaKernels], ids=lambda c: c.__name__)
def test_a_backend_refuses_a_kv_storage_dtype_it_does_not_declare(backend):
    for dtype in backend.kv_storage_dtypes:
        check_kv_storage(backend, "auto", dtype)
    if torch.float8_e4m3fn in backend.kv_storage_dtypes:
        return
    with pytest.raises(ConfigError, match=r"kv_cache_dtype: 'fp8' stores torch.float8_e4m3fn.*'cuda'"):
        check_kv_storage(backend, "fp8", torch.float8_e4m3fn)


@pytest.mark.parametrize("path", sorted(MODELS.glob("*.py")), ids=lambda p: p.name)
def test_no_format_string_is_compared_under_runtime_models(path):
    literals = {node.value for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Constant)}
    assert not literals & set(supported_formats())
