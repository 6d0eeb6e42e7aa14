"""The native paged decode attention (runtime/kernels/cpu/attention.h) at the edges of its tiling:
keys taken four at a time (1-9 visible keys, block-crossing and partial blocks), head sizes with and
without a 16- or 8-column tail, 1, 3, 5 and 12 query heads per KV head, the window and sink spans
(window start inside a block, sinks past the length, window 0, window past the start, released
blocks), over each KV format (float32, int8 with row scales, bf16) against torch_attention."""
from __future__ import annotations

import pytest
import torch

from runtime.kernels.cpu import cpu_native
from runtime.kernels.cpu.cpu_native_bf16 import bf16_ops
from runtime.kernels.kv_quant import dequantize, quantize_rows
from runtime.kernels.torch_kernels import torch_attention

pytestmark = pytest.mark.skipif(cpu_native.native_ops() is None, reason="native CPU kernels cannot run here")

TPB, NUM_BLOCKS, BLOCKS_PER_SEQ = 5, 40, 5
SEQ_LENS = [1, 2, 3, 4, 5, 7, 9, 23]
# (window, sink): none; sinks alone; a window starting inside a block; sinks past some lengths;
# a window longer than every sequence; a window reaching back exactly to the sinks.
SPANS = [(None, 0), (0, 2), (6, 0), (6, 2), (3, 8), (100, 1), (21, 2)]


def visible_blocks(length: int, window: int | None, sink: int) -> set[int]:
    """Block indices (in a sequence's table) that hold a key the decode query at length - 1 sees."""
    keys = range(length) if window is None else [j for j in range(length) if j >= length - window or j < sink]
    return {j // TPB for j in keys}


def problem(num_heads: int, num_kv_heads: int, head_dim: int, window: int | None, sink: int, seed: int):
    """(q, k, v, tables with released blocks as -1, the same tables for the reference, lens)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(NUM_BLOCKS, TPB, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(NUM_BLOCKS, TPB, num_kv_heads, head_dim, generator=gen)
    tables = torch.randperm(NUM_BLOCKS, generator=gen)[:len(SEQ_LENS) * BLOCKS_PER_SEQ]
    tables = tables.view(len(SEQ_LENS), BLOCKS_PER_SEQ).int()
    released = tables.clone()
    for row, length in enumerate(SEQ_LENS):
        seen = visible_blocks(length, window, sink)
        for block in range(BLOCKS_PER_SEQ):
            if block not in seen:
                released[row, block] = -1
    q = torch.randn(len(SEQ_LENS), num_heads, head_dim, generator=gen)
    return q, k, v, released, tables, torch.tensor(SEQ_LENS)


HEADS = [(3, 3), (9, 3), (10, 2), (12, 1)]   # group 1, 3 (SmolLM2), 5; 12: past the groups compiled as constants (1-8)
HEAD_DIMS = [64, 80, 37, 8]


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS, ids=["group1", "group3", "group5", "group12"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("window,sink", SPANS)
def test_float32_cache(num_heads, num_kv_heads, head_dim, window, sink):
    q, k, v, released, tables, lens = problem(num_heads, num_kv_heads, head_dim, window, sink, seed=head_dim)
    got = cpu_native.native_ops().decode_attention(q, k, v, released, lens, head_dim ** -0.5, window, sink)
    want = torch_attention.decode_attention(q, k, v, tables, lens, head_dim ** -0.5, window, sink)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS, ids=["group1", "group3", "group5", "group12"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("window,sink", SPANS)
def test_int8_cache(num_heads, num_kv_heads, head_dim, window, sink):
    q, k, v, released, tables, lens = problem(num_heads, num_kv_heads, head_dim, window, sink, seed=head_dim + 1)
    (k8, k_scales), (v8, v_scales) = quantize_rows(k, torch.int8), quantize_rows(v, torch.int8)
    got = cpu_native.native_ops().decode_attention_int8(q, k8, v8, k_scales, v_scales, released, lens,
                                                       head_dim ** -0.5, window, sink)
    want = torch_attention.decode_attention(q, dequantize(k8, k_scales), dequantize(v8, v_scales), tables, lens,
                                            head_dim ** -0.5, window, sink)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS, ids=["group1", "group3", "group5", "group12"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("window,sink", SPANS)
def test_bf16_cache(num_heads, num_kv_heads, head_dim, window, sink):
    ops = bf16_ops()
    if ops is None:
        pytest.skip("native bf16 kernels cannot run here")
    q, k, v, released, tables, lens = problem(num_heads, num_kv_heads, head_dim, window, sink, seed=head_dim + 2)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    got = ops.decode_attention(q, k, v, released, lens, head_dim ** -0.5, window, sink)
    # the reference in float32 over the same bf16 values; the kernel rounds its output to bf16 once
    want = torch_attention.decode_attention(q.float(), k.float(), v.float(), tables, lens, head_dim ** -0.5,
                                            window, sink)
    torch.testing.assert_close(got.float(), want, atol=1e-5, rtol=2 ** -8)


@pytest.mark.parametrize("head_dim", [64, 37])
def test_scores_far_below_zero(head_dim):
    """Every score of a chunk far below zero (the keys point away from the queries: scores ~ -150,
    whose exp underflows float32):
    the weights are taken from the chunk's own maximum, never from a tile's padding past its last
    key (a maximum of 0 there would round every weight to 0 and the output to NaN)."""
    q, k, v, released, tables, lens = problem(9, 3, head_dim, None, 0, seed=5)
    q, k = q.abs() * 6, -k.abs() * 6
    got = cpu_native.native_ops().decode_attention(q, k, v, released, lens, head_dim ** -0.5, None, 0)
    want = torch_attention.decode_attention(q, k, v, tables, lens, head_dim ** -0.5, None, 0)
    assert want.isfinite().all()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
