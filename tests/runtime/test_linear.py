"""runtime.linear: every CPU matmul kernel equals F.linear; the weight bookkeeping counts a
reordered or tied weight correctly."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime import Engine, ModelRunner
from runtime.linear import CPU_IMPLS, Linear, default_cpu_impl, onednn_available
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


def test_unknown_impl_is_refused_by_name():
    with pytest.raises(ValueError, match="impl: expected one of .* got 'blas'"):
        Linear(torch.ones(2, 2), None, CPU, "blas")


def test_half_precision_weights_take_the_portable_kernel():
    for dtype in (torch.float16, torch.bfloat16):
        assert not onednn_available(dtype)
        assert default_cpu_impl(dtype) == "w_xt"
        with pytest.raises(ValueError, match="oneDNN"):
            Linear(torch.ones(2, 2, dtype=dtype), None, CPU, "onednn")


@pytest.mark.parametrize("impl", IMPLS)
def test_weight_tensors_count_tied_head_once_unless_reordered(tmp_path, impl):
    make_checkpoint(tmp_path, "qwen2")  # ties lm_head to the embeddings
    engine = Engine.from_dir(tmp_path, tokens_per_block=4)
    runner = ModelRunner(engine, num_blocks=4, linear_impl=impl)
    cfg = engine.model_config
    weights = runner.model.weight_tensors()
    assert sum(t.numel() * t.element_size() for t in weights) == (
        sum(t.numel() * t.element_size() for t in engine.weights.values())
        # A reordered head is a second copy of the [V, H] table, which the lookup still needs.
        + (cfg.vocab_size * cfg.hidden_size * 4 if impl == "onednn" else 0))
