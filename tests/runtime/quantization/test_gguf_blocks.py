"""The block format entries (runtime.quantization.gguf_blocks): geometry and type ids against the gguf
package, de-quantization bit for bit `gguf.quants.dequantize` (random blocks and our quantizer's),
our Q8_0 / Q4_0 / Q4_1 / Q5_0 quantizers' bytes equal to `gguf.quants.quantize`, and the checks of
a stored tensor (NaN / infinite scales, partial blocks)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from runtime.errors import ConfigError
from runtime.loading.tensor_files import WeightError
from runtime.quantization.gguf_blocks import BLOCK_FORMATS, block_format, format_of_type
from tests.runtime.gguf_factories import random_blocks

Q = gguf.GGMLQuantizationType
GGUF_QUANTIZED = ("q8_0", "q4_0", "q4_1", "q5_0")   # the formats the gguf package quantizes


def finite_random_blocks(name: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """Random stored bytes of `name` whose float16 scales are finite (any magnitude, any sign)."""
    fmt = BLOCK_FORMATS[name]
    blocks = random_blocks(Q[fmt.type_name], rows, columns, seed)
    view = blocks.reshape(-1, fmt.block_bytes)
    rng = np.random.default_rng(seed + 1)
    for at in fmt.scale_offsets:
        scales = rng.standard_normal(view.shape[0]).astype(np.float16) * np.float16(0.01)
        view[:, at:at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks


def bits(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_geometry_and_type_ids_are_ggmls(name):
    fmt = BLOCK_FORMATS[name]
    kind = Q[fmt.type_name]
    assert (fmt.type_id, fmt.block_elems, fmt.block_bytes) == (kind.value, *gguf.GGML_QUANT_SIZES[kind])
    assert format_of_type(kind.value) is fmt and block_format(name, "x") is fmt
    assert fmt.row_bytes(512) == 512 // fmt.block_elems * fmt.block_bytes and fmt.columns(fmt.row_bytes(512)) == 512


@pytest.mark.parametrize("name", BLOCK_FORMATS)
@pytest.mark.parametrize("rows, columns", [(1, 256), (3, 512), (17, 2304)])
def test_dequantization_is_ggufs_bit_for_bit_on_random_blocks(name, rows, columns):
    blocks = finite_random_blocks(name, rows, columns, seed=rows)
    expected = gguf.quants.dequantize(blocks, Q[BLOCK_FORMATS[name].type_name])
    ours = BLOCK_FORMATS[name].dequantize(torch.from_numpy(blocks))
    assert ours.shape == (rows, columns) and ours.dtype == torch.float32
    assert np.array_equal(bits(ours.numpy()), bits(expected))


@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_dequantization_of_our_quantizers_blocks_is_ggufs(name):
    fmt = BLOCK_FORMATS[name]
    values = np.random.default_rng(3).standard_normal((5, 768)).astype(np.float32)
    values[0] = 0.0                       # an all-zero row: zero scales
    values[1, :256] *= 1e-3               # small blocks beside large ones
    blocks = fmt.quantize(values)
    assert blocks.dtype == np.uint8 and blocks.shape == (5, fmt.row_bytes(768))
    ours = fmt.dequantize(torch.from_numpy(blocks)).numpy()
    assert np.array_equal(bits(ours), bits(gguf.quants.dequantize(blocks, Q[fmt.type_name])))
    step = np.abs(values).max() / (7 if fmt.name in ("q4_0", "q4_1", "q4_k") else 15)
    assert np.abs(ours - values).max() < step   # a real quantization, not noise


@pytest.mark.parametrize("name", GGUF_QUANTIZED)
@pytest.mark.parametrize("scale", [1.0, 1e-4, 300.0])
def test_our_quantizers_write_ggufs_bytes(name, scale):
    fmt = BLOCK_FORMATS[name]
    rng = np.random.default_rng(int(scale * 10) + len(name))
    values = (rng.standard_normal((9, 1024)) * scale).astype(np.float32)
    values[2, 32:64] = 0.0                          # a zero block
    values[3, :32] = np.linspace(-1, 1, 32)         # exact halves of a step
    values[4, :32] = -values[4, :32].max() * 2      # a constant block
    assert np.array_equal(fmt.quantize(values), gguf.quants.quantize(values, Q[fmt.type_name]))


@pytest.mark.parametrize("name", BLOCK_FORMATS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_nan_or_infinite_scale_names_the_tensor(name, bad):
    fmt = BLOCK_FORMATS[name]
    blocks = finite_random_blocks(name, 4, 512, seed=7)
    fmt.check_blocks(torch.from_numpy(blocks), "blk.0.attn_q.weight")   # finite: passes
    view = blocks.reshape(-1, fmt.block_bytes)
    view[5, fmt.scale_offsets[-1]:fmt.scale_offsets[-1] + 2] = np.array([bad], np.float16).view(np.uint8)
    with pytest.raises(WeightError, match=r"blk\.0\.attn_q\.weight.*block 5"):
        fmt.check_blocks(torch.from_numpy(blocks), "blk.0.attn_q.weight")


@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_rows_of_partial_blocks_name_the_tensor(name):
    fmt = BLOCK_FORMATS[name]
    with pytest.raises(ConfigError, match=r"'lm_head'.*not whole"):
        fmt.check_columns(fmt.block_elems + 16, "lm_head")
    with pytest.raises(ConfigError, match=r"'w'"):
        fmt.quantize(np.zeros((2, fmt.block_elems // 2), np.float32), "w")
    with pytest.raises(ValueError, match="NaN"):
        fmt.quantize(np.full((1, fmt.block_elems), np.nan, np.float32))


def test_an_unknown_format_name_is_a_config_error():
    with pytest.raises(ConfigError, match=r"engine\.json.*'q2_k'.*q8_0"):
        block_format("q2_k", "engine.json")
    assert format_of_type(Q.Q2_K.value) is None and format_of_type(Q.F32.value) is None
