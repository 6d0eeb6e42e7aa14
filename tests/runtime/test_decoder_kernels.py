"""The torch decoding kernels against independent references: Random123's Philox answers,
transformers' top-k / top-p warpers, an inverse CDF in float64, fixed-seed frequencies, and a
numpy transcription of the penalty semantics."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from runtime import rng
from runtime.kernels import TorchKernels
from runtime.kernels.torch_kernels import torch_decoder

KERNELS = TorchKernels()

# Random123's published Philox4x32-10 known answers: (counter, key, output).
PHILOX_KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def random_logits(rows: int, vocab: int, seed: int, scale: float = 5.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


# --- the generator ------------------------------------------------------------------------------

@pytest.mark.parametrize("counter, key, expected", PHILOX_KNOWN_ANSWERS)
def test_philox_matches_random123_known_answers(counter, key, expected):
    out = rng.philox4x32(np.array([counter], dtype=np.uint32), np.array([key], dtype=np.uint32))
    assert tuple(int(x) for x in out[0]) == expected


def test_uniforms_are_a_function_of_seed_step_beam_only():
    seeds, steps, beams = [7, 2 ** 64 - 1, 7, 0], [0, 3, 1, 0], [0, 2, 0, 1]
    together = rng.uniforms(seeds, steps, beams)
    alone = [rng.uniforms([s], [t], [b])[0] for s, t, b in zip(seeds, steps, beams)]
    assert together.tolist() == alone
    assert len(set(together.tolist())) == 4
    assert together.dtype == np.float32 and (together >= 0).all() and (together < 1).all()
    # Exact multiples of 2^-24: a CUDA kernel computing (x >> 8) * 2^-24 in float32 agrees bit for bit.
    assert ((together * 2 ** 24) % 1 == 0).all()


# --- top-k / top-p --------------------------------------------------------------------------------

def hf_filtered(row: torch.Tensor, k: int, p: float) -> torch.Tensor:
    scores = row[None].clone()
    if k > 0:
        scores = TopKLogitsWarper(top_k=k)(None, scores)
    if 0 < p < 1:
        scores = TopPLogitsWarper(top_p=p)(None, scores)
    return scores[0]


@pytest.mark.parametrize("case", ["top_k", "top_p", "both"])
def test_top_k_top_p_keep_what_transformers_warpers_keep(case):
    rows, vocab = 24, 1000
    logits = random_logits(rows, vocab, seed=1)
    gen = torch.Generator().manual_seed(2)
    top_k = torch.randint(1, 300, (rows,), generator=gen) if case != "top_p" else torch.zeros(rows, dtype=torch.int64)
    top_p = (torch.rand(rows, generator=gen) * 0.9 + 0.05 if case != "top_k" else torch.zeros(rows))
    kept = KERNELS.top_k_top_p_mask(logits, top_k, top_p)
    for r in range(rows):
        reference = hf_filtered(logits[r], int(top_k[r]), float(top_p[r]))
        assert torch.equal(kept[r], torch.isfinite(reference)), f"row {r}"
        ours = torch.softmax(logits[r].masked_fill(~kept[r], float("-inf")), -1)
        torch.testing.assert_close(ours, torch.softmax(reference, -1), atol=1e-7, rtol=0)


def test_top_k_ties_keep_exactly_k_lowest_ids_first():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, 0.0]])
    kept = KERNELS.top_k_top_p_mask(logits, torch.tensor([2]), torch.tensor([0.0]))
    assert kept[0].tolist() == [False, True, False, True, False, False]


def test_tiny_top_p_keeps_only_the_most_probable_token():
    logits = random_logits(4, 300, seed=3)
    kept = KERNELS.top_k_top_p_mask(logits, torch.zeros(4, dtype=torch.int64), torch.full((4,), 1e-6))
    assert kept.sum(-1).tolist() == [1, 1, 1, 1]
    assert kept.int().argmax(-1).tolist() == logits.argmax(-1).tolist()


def test_sampled_token_is_the_inverse_cdf_of_the_injected_uniform():
    rows, vocab, draws = 6, 500, 400
    logits = random_logits(rows, vocab, seed=4, scale=2.0)
    top_k = torch.tensor([0, 50, 0, 200, 1, 7])
    top_p = torch.tensor([0.0, 0.0, 0.8, 0.6, 0.0, 0.95])
    kept = KERNELS.top_k_top_p_mask(logits, top_k, top_p)
    u = torch.rand(draws, generator=torch.Generator().manual_seed(5))
    checked = 0
    for r in range(rows):
        probs = torch.softmax(logits[r].double().masked_fill(~kept[r], float("-inf")), -1)
        cdf = probs.cumsum(-1)
        # Skip draws within 1e-5 of a CDF step: float32 sums may put those on either side.
        near = (cdf[None, :] - u[:, None].double()).abs().min(-1).values < 1e-5
        expected = torch.searchsorted(cdf, u.double(), right=True).clamp(max=vocab - 1)
        tokens, _ = KERNELS.sample(logits[r].expand(draws, vocab).contiguous(), top_k[r].expand(draws),
                                   top_p[r].expand(draws), u, torch.ones(draws, dtype=torch.bool))
        assert tokens[~near].tolist() == expected[~near].tolist(), f"row {r}"
        assert bool(kept[r, tokens].all())
        checked += int((~near).sum())
    assert checked > rows * draws * 0.95


def test_fixed_seed_frequencies_follow_the_filtered_distribution():
    vocab, num_draws = 16, 40_000
    logits = torch.linspace(2.0, -2.0, vocab)[None]
    top_k, top_p = torch.tensor([10]), torch.tensor([0.9])
    kept = KERNELS.top_k_top_p_mask(logits, top_k, top_p)[0]
    target = torch.softmax(logits[0].masked_fill(~kept, float("-inf")), -1)
    u = torch.from_numpy(rng.uniforms(list(range(num_draws)), [0] * num_draws, [0] * num_draws))
    tokens, _ = KERNELS.sample(logits.expand(num_draws, vocab).contiguous(), top_k.expand(num_draws),
                               top_p.expand(num_draws), u, torch.ones(num_draws, dtype=torch.bool))
    freq = torch.bincount(tokens, minlength=vocab).double() / num_draws
    assert freq[~kept].sum() == 0, "a zero-probability token was drawn"
    # Deterministic (fixed seeds); the bound is ~5x the expected total variation at this size.
    assert 0.5 * (freq - target.double()).abs().sum() < 0.015


def test_sample_log_probs_normalised_over_the_kept_set_or_the_vocabulary():
    logits = random_logits(3, 64, seed=6)
    top_k = torch.tensor([5, 5, 0])
    top_p = torch.tensor([0.0, 0.0, 0.0])
    u = torch.tensor([0.3, 0.3, 0.7])
    tokens, normalised = KERNELS.sample(logits, top_k, top_p, u, torch.tensor([True, False, True]))
    kept = KERNELS.top_k_top_p_mask(logits, top_k, top_p)
    for r in range(3):
        full = torch.log_softmax(logits[r], -1)[tokens[r]]
        renorm = torch.log_softmax(logits[r].masked_fill(~kept[r], float("-inf")), -1)[tokens[r]]
        expected = full if r == 1 else renorm
        assert normalised[r].item() == pytest.approx(expected.item(), abs=1e-5)


def test_greedy_takes_the_first_maximum_and_its_log_prob():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 0.0, 0.0, 3.0]])
    tokens, log_probs = KERNELS.greedy(logits)
    assert tokens.tolist() == [1, 0]
    torch.testing.assert_close(log_probs, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


# --- penalties and bans ---------------------------------------------------------------------------

def numpy_penalties(logits, tokens, bias, temperature, rep, presence, freq, min_length, num_generated, end_id):
    """TensorRT-LLM's order, transcribed: bias, temperature, repetition, presence, frequency, min length."""
    x = logits.astype(np.float64) + (0 if bias is None else bias)
    x = x / temperature
    counts = np.bincount(tokens, minlength=len(x))
    for t in range(len(x)):
        if counts[t]:
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
            x[t] -= presence
            x[t] -= freq * counts[t]
    if num_generated < min_length and end_id >= 0:
        x[end_id] = -np.inf
    return x


def test_penalties_follow_the_documented_order_on_selected_rows_only():
    vocab = 50
    logits = random_logits(4, vocab, seed=7)
    original = logits.clone()
    gen = torch.Generator().manual_seed(8)
    sequences = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (12, 3)]
    bias = torch.randn(2, vocab, generator=gen)
    settings = dict(temperature=[0.7, 1.5], rep=[1.3, 0.8], presence=[0.5, -0.2], freq=[0.1, 0.3],
                    min_length=[4, 1], num_generated=[2, 5], end_id=[9, 11])
    rows = torch.tensor([2, 0])
    token_ids = torch.tensor([seq + [0] * (12 - len(seq)) for seq in sequences])
    KERNELS.apply_penalties(
        logits, rows, token_ids, torch.tensor([12, 3]), bias, torch.tensor(settings["temperature"]),
        torch.tensor(settings["rep"]), torch.tensor(settings["presence"]), torch.tensor(settings["freq"]),
        torch.tensor(settings["min_length"]), torch.tensor(settings["num_generated"]), torch.tensor(settings["end_id"]))
    for j, row in enumerate(rows.tolist()):
        expected = numpy_penalties(original[row].numpy(), np.array(sequences[j]), bias[j].numpy(),
                                   *(settings[k][j] for k in settings))
        np.testing.assert_allclose(logits[row].numpy(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits[[1, 3]], original[[1, 3]])
    assert logits[2, 9] == float("-inf") and logits[0, 11] != float("-inf")


@pytest.mark.parametrize("n, tokens, expected", [
    (2, [5, 6, 7, 5], [6]),
    (3, [1, 2, 3, 1, 2, 9, 1, 2], [3, 9]),
    (1, [4, 4, 8], [4, 8]),
    (3, [1, 2], []),
    (2, [3, 4, 5], []),
])
def test_repeat_ngram_bans(n, tokens, expected):
    assert KERNELS.repeat_ngram_bans(torch.tensor(tokens), n).tolist() == expected


def test_ban_tokens_sets_minus_infinity_on_the_pairs_only():
    logits = torch.zeros(2, 5)
    KERNELS.ban_tokens(logits, torch.tensor([0, 1, 1]), torch.tensor([3, 0, 4]))
    assert torch.isinf(logits).nonzero().tolist() == [[0, 3], [1, 0], [1, 4]]


@pytest.mark.parametrize("vocab", [50, 3000])
def test_fast_sampling_paths_equal_the_masked_definition(vocab):
    """Top-k rows (with and without ties at the k-th place), top-p rows whose nucleus fits the
    1024 candidates or not, and full-distribution rows: the same tokens and log probs as the
    whole-vocabulary definition."""
    rows = 48
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(rows, vocab, generator=gen) * torch.linspace(0.2, 6.0, rows)[:, None]
    logits[::7] = logits[::7].round()  # plenty of ties
    top_k = torch.tensor([0, 1, 3, 40, 0, 0, 200, 5] * 6)
    top_p = torch.tensor([0.0, 0.0, 0.5, 0.9, 0.3, 0.999, 0.0, 1.0] * 6)
    u = torch.rand(rows, generator=gen)
    normalize = torch.arange(rows) % 3 != 0
    fast = KERNELS.sample(logits, top_k, top_p, u, normalize)
    slow = torch_decoder.sample_masked(logits, top_k, top_p, u, normalize)
    assert fast[0].tolist() == slow[0].tolist()
    torch.testing.assert_close(fast[1], slow[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("vocab", [50, 3000])
def test_top_k_rows_with_fewer_allowed_tokens_than_k_equal_the_definition(vocab):
    """Rows masked to fewer than k finite logits (a guide's bitmask): the fast path, where the
    k-th place is an -inf tie, draws and scores as the whole-vocabulary definition."""
    rows = 32
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    allowed = torch.rand(rows, vocab, generator=gen) < torch.linspace(0.001, 0.05, rows)[:, None]
    allowed[:, 7] = True                                 # at least one token per row
    logits = logits.masked_fill(~allowed, float("-inf"))
    top_k = torch.tensor([50, 20, 200, 64] * 8)
    top_p = torch.tensor([0.0, 0.9, 0.5, 0.0] * 8)
    u = torch.rand(rows, generator=gen)
    normalize = torch.arange(rows) % 2 == 0
    fast = KERNELS.sample(logits, top_k, top_p, u, normalize)
    slow = torch_decoder.sample_masked(logits, top_k, top_p, u, normalize)
    assert fast[0].tolist() == slow[0].tolist()
    torch.testing.assert_close(fast[1], slow[1], atol=1e-5, rtol=0)
    assert bool(allowed.gather(1, fast[0][:, None]).all())


def rows_with_no_allowed_token(vocab: int, seed: int):
    """Six rows, 1 and 4 all -inf (a guide's mask and the bans leaving nothing), 3 all NaN; the
    others keep a few finite logits. -> (logits, top_k, top_p, uniforms, normalize)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, vocab, generator=gen) * 3
    logits[[0, 2, 5], 4:] = float("-inf")
    logits[[1, 4]] = float("-inf")
    logits[3] = float("nan")
    return (logits, torch.tensor([0, 0, 2, 5, 40, 0]), torch.tensor([0.0, 0.9, 0.0, 0.5, 0.0, 0.7]),
            torch.rand(6, generator=gen), torch.tensor([True, False, True, True, False, True]))


@pytest.mark.parametrize("vocab", [9, 300])
def test_a_row_with_no_allowed_token_yields_no_token_never_token_0(vocab):
    """Greedy, the sampler and its definition: NO_TOKEN and -inf for the empty rows; every other
    row draws as it does alone (a token whose logit is -inf is never chosen)."""
    logits, top_k, top_p, u, normalize = rows_with_no_allowed_token(vocab, seed=vocab)
    empty, drawn = [1, 3, 4], [0, 2, 5]
    for tokens, log_probs, alone in (
            (*KERNELS.greedy(logits), KERNELS.greedy(logits[drawn])),
            (*KERNELS.sample(logits, top_k, top_p, u, normalize),
             KERNELS.sample(logits[drawn], top_k[drawn], top_p[drawn], u[drawn], normalize[drawn])),
            (*torch_decoder.sample_masked(logits, top_k, top_p, u, normalize),
             KERNELS.sample(logits[drawn], top_k[drawn], top_p[drawn], u[drawn], normalize[drawn]))):
        assert tokens[empty].tolist() == [torch_decoder.NO_TOKEN] * 3
        assert log_probs[empty].tolist() == [float("-inf")] * 3
        assert tokens[drawn].tolist() == alone[0].tolist() and all(t < 4 for t in tokens[drawn].tolist())
        torch.testing.assert_close(log_probs[drawn], alone[1], atol=1e-5, rtol=0)
