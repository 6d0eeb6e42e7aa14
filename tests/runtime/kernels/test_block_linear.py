"""BlockLinear (runtime.kernels.torch_kernels.block_linear): a weight of row segments in different
block formats against F.linear of its de-quantized weight, on the de-quantized-tile path (where the
native block kernels do not run) and through the native kernels' API (ReferenceBlockOps: a
recording stand-in with their signature) at every row count, bias and accumulation too; and the
table lookup `rows` against the de-quantized weight, on the native kernels' x8 layout too."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from runtime.kernels import get_kernels
from runtime.kernels.cpu.blocks import unpack_x8
from runtime.kernels.torch_kernels import block_linear
from runtime.kernels.torch_kernels.block_linear import TILE_OUTPUTS, BlockLinear, block_ops
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


@pytest.mark.parametrize("rows", [1, 16, 17, 300])
def test_the_native_kernels_take_every_row_count_per_segment(monkeypatch, rows):
    ops = ReferenceBlockOps()
    monkeypatch.setattr(block_linear, "block_ops", lambda: ops)
    parts = segments(["q4_1", "q5_0"], [48, 16], 256, seed=1)
    bias = torch.randn(64)
    linear = BlockLinear(parts, bias)
    x = torch.randn(rows, 256)
    torch.testing.assert_close(linear(x), F.linear(x, dequantized(parts), bias), atol=1e-4, rtol=1e-4)
    assert ops.calls == [("linear", "q4_1", rows), ("linear", "q5_0", rows)]


@pytest.mark.parametrize("path", ["tiles", "reference", "native"])
def test_rows_gathers_each_segment_once_equal_to_the_dequantized_weight(monkeypatch, path):
    """Ids in any order, repeated, in whole x8 groups and in the tail rows after the last group
    (44 = 5 groups of 8 + 4), across three segments; an id outside is an IndexError naming it."""
    if path == "native" and block_ops() is None:
        pytest.skip("the native block kernels do not run here")
    if path != "native":
        monkeypatch.setattr(block_linear, "block_ops", (lambda: None) if path == "tiles" else ReferenceBlockOps)
    parts = segments(["q4_0", "q4_k", "q8_0"], [44, 19, 32], 512, seed=4)
    linear = BlockLinear(parts, None)
    ids = torch.tensor([43, 0, 7, 8, 40, 43, 63, 44, 50, 94, 62, 3, 3, 41], dtype=torch.int64)
    assert torch.equal(linear.rows(ids), dequantized(parts)[ids])
    if path == "native":
        assert linear.kernels[0].layout == "x8"
    with pytest.raises(IndexError, match="row 95 "):
        linear.rows(torch.tensor([1, 95]))


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
def test_one_segment_rows_come_from_one_native_lookup(fmt):
    """One segment (a tied GGUF table) looks its rows up in one native call (bm_blk_rows: the x8
    groups' bytes gathered by x8_row_gather's map; q5_0 unpacks its groups): bit for bit the
    de-quantized rows, in whole groups and in the tail rows (21 = 2 groups of 8 + 5); an id outside
    is an IndexError naming it."""
    if block_ops() is None:
        pytest.skip("the native block kernels do not run here")
    parts = segments([fmt], [21], 512, seed=5)
    linear = BlockLinear(parts, None)
    assert linear.kernels[0].layout == "x8"
    ids = torch.tensor([20, 0, 7, 8, 15, 16, 20, 3, 9], dtype=torch.int64)
    assert torch.equal(linear.rows(ids), dequantized(parts)[ids])
    with pytest.raises(IndexError, match="row 21 "):
        linear.rows(torch.tensor([1, 21]))
    with pytest.raises(IndexError, match="row -1 "):
        linear.rows(torch.tensor([-1]))


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
    assert isinstance(prepared, BlockLinear)
    if prepared.kernels is not None and prepared.kernels[0].layout == "x8":   # the one copy is the repacked one
        assert prepared.weight is prepared.kernels[0].blocks
        assert torch.equal(unpack_x8(prepared.weight, "q6_k", 256), parts[0][1])
    else:
        assert prepared.weight is parts[0][1]
