"""BlockLinear (runtime.kernels.torch_kernels.block_linear): a weight of row segments in different
block formats against F.linear of its de-quantized weight, on the de-quantized-tile path (every
row count; also where the native block kernels run, above their row limit) and through the
native kernels' API (ReferenceBlockOps: a recording stand-in with their signature), bias and accumulation too."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from runtime.kernels import get_kernels
from runtime.kernels.torch_kernels import block_linear
from runtime.kernels.torch_kernels.block_linear import NATIVE_MAX_ROWS, TILE_OUTPUTS, BlockLinear
from runtime.quantization.gguf_blocks import BLOCK_FORMATS
from tests.runtime.gguf_factories import ReferenceBlockOps


def segments(names: list[str], rows: list[int], columns: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for name, n in zip(names, rows):
        fmt = BLOCK_FORMATS[name]
        out.append((fmt, torch.from_numpy(fmt.quantize(rng.standard_normal((n, columns)).astype(np.float32)))))
    return out


def dequantized(parts) -> torch.Tensor:
    return torch.cat([fmt.dequantize(blocks) for fmt, blocks in parts])


@pytest.mark.parametrize("rows", [1, 3, 8, 17, 300])
def test_mixed_segments_match_the_dequantized_weight_on_tiles(monkeypatch, rows):
    monkeypatch.setattr(block_linear, "block_ops", lambda: None)
    parts = segments(["q4_k", "q6_k", "q8_0"], [TILE_OUTPUTS + 40, 64, 24], 512)
    bias = torch.randn(sum(b.shape[0] for _, b in parts))
    linear = BlockLinear(parts, bias)
    assert linear.ops is None and linear.weight is parts[0][1] and linear.in_features == 512
    x = torch.randn(rows, 512)
    expected = F.linear(x, dequantized(parts), bias)
    torch.testing.assert_close(linear(x), expected, atol=1e-4, rtol=1e-4)
    residual = torch.randn_like(expected)
    torch.testing.assert_close(linear.add_to(x, residual.clone()), residual + expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(linear(x.bfloat16()).float(), expected, atol=0.5, rtol=5e-2)
    assert torch.equal(linear.dequantized(), dequantized(parts))


def test_the_native_kernels_take_few_rows_per_segment_and_tiles_take_many(monkeypatch):
    ops = ReferenceBlockOps()
    monkeypatch.setattr(block_linear, "block_ops", lambda: ops)
    parts = segments(["q4_1", "q5_0"], [48, 16], 256, seed=1)
    bias = torch.randn(64)
    linear = BlockLinear(parts, bias)
    weight = dequantized(parts)
    x = torch.randn(NATIVE_MAX_ROWS, 256)
    torch.testing.assert_close(linear(x), F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
    assert ops.calls == [("linear", "q4_1", NATIVE_MAX_ROWS), ("linear", "q5_0", NATIVE_MAX_ROWS)]
    ops.calls.clear()
    many = torch.randn(NATIVE_MAX_ROWS + 1, 256)
    torch.testing.assert_close(linear(many), F.linear(many, weight, bias), atol=1e-4, rtol=1e-4)
    assert [call[0] for call in ops.calls] == ["dequantize", "dequantize"]


def test_one_segment_accumulates_into_the_residual_natively(monkeypatch):
    ops = ReferenceBlockOps()
    monkeypatch.setattr(block_linear, "block_ops", lambda: ops)
    parts = segments(["q8_0"], [40], 64, seed=2)
    linear = BlockLinear(parts, None)
    x, residual = torch.randn(2, 64), torch.randn(2, 40)
    expected = residual + F.linear(x, dequantized(parts))
    out = linear.add_to(x, residual)
    assert out is residual   # in place, one pass
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_the_torch_backend_prepares_block_linears():
    parts = segments(["q6_k"], [8], 256, seed=3)
    prepared = get_kernels("torch").prepare_block_linear(parts, None)
    assert isinstance(prepared, BlockLinear) and prepared.weight is parts[0][1]
