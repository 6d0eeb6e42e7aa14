"""cuda_src/token_filters.cu (guided-decoding bitmask, min-p, top log probs) on emu equals the
torch reference; on a CUDA device too when there is one. The references themselves are checked
against a direct computation."""
from __future__ import annotations

import pytest
import torch

from runtime.kernels.cuda.cuda_backend import cuda_available

NEG_INF = float("-inf")


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def random_bitmask(rows: int, vocab: int, seed: int, extra_words: int = 0) -> torch.Tensor:
    words = -(-vocab // 32) + extra_words
    return torch.randint(-2 ** 31, 2 ** 31, (rows, words), dtype=torch.int64,
                         generator=torch.Generator().manual_seed(seed)).to(torch.int32)


def backends(emu):
    out = [emu]
    if cuda_available():
        from runtime.kernels import get_kernels
        out.append(get_kernels("cuda"))
    return out


def on(kernels, t: torch.Tensor) -> torch.Tensor:
    return t.to("cuda") if kernels.name == "cuda" else t


@pytest.mark.parametrize("vocab, extra_words", [(1, 0), (31, 0), (32, 0), (100, 1), (1000, 0)])
def test_token_bitmask_equals_torch(emu, reference, vocab, extra_words):
    logits = random_logits(5, vocab, vocab)
    rows = torch.tensor([4, 0, 2])
    bitmask = random_bitmask(3, vocab, vocab + 1, extra_words)
    expected = logits.clone()
    reference.apply_token_bitmask(expected, rows, bitmask)
    for kernels in backends(emu):
        got = on(kernels, logits.clone())
        kernels.apply_token_bitmask(got, on(kernels, rows), on(kernels, bitmask))
        assert torch.equal(got.cpu(), expected)


def test_token_bitmask_reference_is_the_bit_layout():
    from runtime.kernels.torch_kernels.torch_decoder import apply_token_bitmask
    logits = torch.zeros(1, 40)
    mask = torch.tensor([[(1 << 3) | (1 << 31), 1 << 7]], dtype=torch.int64).to(torch.int32)   # bits 3, 31, 39
    apply_token_bitmask(logits, torch.tensor([0]), mask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [3, 31, 39]


@pytest.mark.parametrize("vocab", [3, 257, 5000])
def test_min_p_equals_torch(emu, reference, vocab):
    logits = random_logits(4, vocab, vocab)
    logits[3] = NEG_INF                                   # a row of -inf stays as it is
    rows = torch.tensor([0, 1, 3])
    min_p = torch.tensor([0.05, 0.5, 0.1])
    expected = logits.clone()
    reference.apply_min_p(expected, rows, min_p)
    direct = torch.softmax(logits[1], -1) < 0.5 * torch.softmax(logits[1], -1).max()
    assert torch.equal(torch.isinf(expected[1]), direct)
    assert torch.isfinite(expected[1]).sum() >= 1
    for kernels in backends(emu):
        got = on(kernels, logits.clone())
        kernels.apply_min_p(got, on(kernels, rows), on(kernels, min_p))
        assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("vocab, k", [(1, 1), (50, 5), (1000, 20), (4096, 1)])
def test_top_log_probs_equal_torch(emu, reference, vocab, k):
    logits = random_logits(6, vocab, vocab + k)
    if vocab >= 8:
        logits[1, :8] = 2.5                              # ties: lower ids first
        logits[2, vocab // 2:] = NEG_INF
    values, ids = reference.top_log_probs(logits, k)
    direct = torch.log_softmax(logits, -1)
    assert torch.allclose(values, direct.gather(1, ids))
    assert bool((values[:, :-1] >= values[:, 1:]).all())
    if vocab >= 8 and k >= 5:
        assert ids[1, :5].tolist() == [0, 1, 2, 3, 4] or logits[1].max() > 2.5
    for kernels in backends(emu):
        got_values, got_ids = kernels.top_log_probs(on(kernels, logits), k)
        assert torch.equal(got_ids.cpu(), ids)
        torch.testing.assert_close(got_values.cpu(), values, atol=1e-5, rtol=0)
