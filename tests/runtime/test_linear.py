"""runtime.kernels.torch_kernels.linear: every CPU matmul kernel equals F.linear; the oneDNN path sees a bounded set of
row counts; the weight bookkeeping counts a reordered or tied weight correctly."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime import Engine, ModelRunner
import runtime.kernels.torch_kernels.linear as linear_module
from runtime.kernels.torch_kernels.linear import (CPU_IMPLS, MAX_KERNEL_ROWS, Linear, bucket_rows, default_cpu_impl, kernel_rows,
                                    onednn_available)
from tests.factories import make_checkpoint

IMPLS = [impl for impl in CPU_IMPLS if impl != "onednn" or onednn_available(torch.float32)]
CPU = torch.device("cpu")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_linear_matches_f_linear(impl, with_bias, rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
    x = torch.randn(rows, 40, generator=gen)
    linear = Linear(weight, bias if with_bias else None, CPU, impl)
    y = linear(x)
    assert y.shape == (rows, 48) and linear.impl == impl
    torch.testing.assert_close(y, F.linear(x, weight, bias if with_bias else None), atol=1e-5, rtol=1e-5)


def test_row_buckets_are_few_and_pad_little():
    buckets = {bucket_rows(rows) for rows in range(1, MAX_KERNEL_ROWS + 1)}
    assert len(buckets) == 43 and max(buckets) == MAX_KERNEL_ROWS
    for rows in range(1, MAX_KERNEL_ROWS + 1):
        padded = bucket_rows(rows)
        assert 0 <= padded - rows <= max(7, rows // 8), rows   # at most 12.5 % above 64 rows
    for rows in (0, MAX_KERNEL_ROWS + 1):
        with pytest.raises(ValueError, match=f"rows: expected 1..{MAX_KERNEL_ROWS}, got {rows}"):
            bucket_rows(rows)


def test_long_inputs_run_in_full_chunks_and_a_bucketed_rest():
    assert kernel_rows(34) == [(34, 40)]
    assert kernel_rows(2 * MAX_KERNEL_ROWS) == [(MAX_KERNEL_ROWS, MAX_KERNEL_ROWS)] * 2
    assert kernel_rows(2 * MAX_KERNEL_ROWS + 452) == [(MAX_KERNEL_ROWS, MAX_KERNEL_ROWS)] * 2 + [(452, 480)]
    for rows in range(1, 3 * MAX_KERNEL_ROWS, 37):
        assert sum(taken for taken, _ in kernel_rows(rows)) == rows


@pytest.mark.skipif(not onednn_available(torch.float32), reason="oneDNN linear not in this torch build")
def test_onednn_kernel_sees_bounded_shapes_and_results_equal_f_linear(monkeypatch):
    """Every row count 1..2600 reaches the kernel as one of the 43 buckets, unchanged in value."""
    seen = set()

    def recording(x, weight, bias):
        seen.add(tuple(x.shape))
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    monkeypatch.setattr(linear_module, "_onednn_linear", recording)
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(24, 40, generator=gen), torch.randn(24, generator=gen)
    linear = Linear(weight, bias, CPU, "onednn")
    x = torch.randn(2600, 40, generator=gen)
    for rows in list(range(1, 300)) + [1023, 1024, 1025, 2048, 2600]:
        torch.testing.assert_close(linear(x[:rows]), F.linear(x[:rows], weight, bias), atol=1e-5, rtol=1e-5)
    strided = x[:90, :].t().contiguous().t()   # a column-major input, as w_xt views are
    torch.testing.assert_close(linear(strided), F.linear(strided, weight, bias), atol=1e-5, rtol=1e-5)
    assert {rows for rows, _ in seen} <= {bucket_rows(r) for r in range(1, MAX_KERNEL_ROWS + 1)}
    assert len(seen) <= 43 and all(cols == 40 for _, cols in seen)


def test_unknown_impl_is_refused_by_name():
    with pytest.raises(ValueError, match="impl: expected one of .* got 'blas'"):
        Linear(torch.ones(2, 2), None, CPU, "blas")


def test_float16_weights_take_the_portable_kernel():
    assert not onednn_available(torch.float16)
    assert default_cpu_impl(torch.float16) == "w_xt"
    with pytest.raises(ValueError, match="oneDNN"):
        Linear(torch.ones(2, 2, dtype=torch.float16), None, CPU, "onednn")
    # bf16 goes to oneDNN's bf16 GEMM wherever this build has one (tests/runtime/test_bf16_native.py)
    assert default_cpu_impl(torch.bfloat16) == ("onednn" if onednn_available(torch.bfloat16) else "w_xt")


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("impl", IMPLS)
def test_weight_tensors_count_tied_head_once_unless_reordered(tmp_path, monkeypatch, impl, native):
    if not native:   # no native kernel: oneDNN's reordered weight is the one copy of each matmul weight
        monkeypatch.setattr(linear_module, "native_ops", lambda: None)
    make_checkpoint(tmp_path, "qwen2")  # ties lm_head to the embeddings
    engine = Engine.from_dir(tmp_path, tokens_per_block=4)
    runner = ModelRunner(engine, num_blocks=4, linear_impl=impl)
    cfg = engine.model_config
    weights = runner.model.weight_tensors()
    reordered = impl == "onednn" and runner.model.lm_head.plain is None
    assert reordered == (impl == "onednn" and (not native or linear_module.native_ops() is None))
    assert sum(t.numel() * t.element_size() for t in weights) == (
        sum(t.numel() * t.element_size() for t in engine.weights.values())
        # A reordered head is a second copy of the [V, H] table, which the lookup still needs.
        + (cfg.vocab_size * cfg.hidden_size * 4 if reordered else 0))
