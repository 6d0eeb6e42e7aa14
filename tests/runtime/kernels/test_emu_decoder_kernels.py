"""The decoding kernels on emu (cuda_src/philox.cu, logits_processing.cu, sampling.cu,
beam_search.cu on CPU threads) equal the torch reference: Philox bit for bit (Random123's known
answers included), penalties and bans exactly, greedy / log-softmax / sampled tokens exactly with
log probs within 1e-5 (draws within float rounding of a CDF step excepted), beam candidates
exactly; a GptSession run yields the torch backend's tokens; with BATCH_MANAGER_TSAN=1,
ThreadSanitizer finds no race in them."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime import rng
from tests.runtime.test_decoder_kernels import PHILOX_KNOWN_ANSWERS

NEG_INF = float("-inf")
REPO = Path(__file__).resolve().parents[3]


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


# --- Philox -------------------------------------------------------------------------------------

@pytest.mark.parametrize("counter, key, expected", PHILOX_KNOWN_ANSWERS)
def test_philox_block_function_matches_random123_known_answers(emu, counter, key, expected):
    as_int32 = lambda words: torch.tensor(np.array([words], dtype=np.uint32).view(np.int32))  # noqa: E731
    out = torch.empty(1, 4, dtype=torch.int32)
    emu.decoding.philox_raw(out, as_int32(counter), as_int32(key))
    assert tuple(int(x) for x in out.numpy().view(np.uint32)[0]) == expected


def test_uniforms_are_bit_identical_to_the_reference_generator(emu, reference):
    gen = np.random.default_rng(0)
    seeds = [0, 1, 2 ** 32 - 1, 2 ** 32, 2 ** 63, 2 ** 64 - 1] + [int(s) for s in gen.integers(0, 2 ** 64, 90,
                                                                                                    dtype=np.uint64)]
    steps = [0, 1, 2 ** 32 + 5, 7, 0, 3] + gen.integers(0, 4096, 90).tolist()
    beams = [0, 0, 3, 1, 2 ** 32 - 1, 0] + gen.integers(0, 8, 90).tolist()
    as_int64 = torch.tensor(np.array(seeds, dtype=np.uint64).view(np.int64))
    got = emu.uniforms(as_int64, torch.tensor(steps), torch.tensor(beams))
    expected = rng.uniforms(seeds, steps, beams)
    assert got.dtype == torch.float32 and np.array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))
    assert torch.equal(got, reference.uniforms(as_int64, torch.tensor(steps), torch.tensor(beams)))
    # (seed 0, step 0, beam 0) is the all-zero known answer: x0 = 0x6627E8D5
    assert got[0].item() == (0x6627E8D5 >> 8) * 2.0 ** -24


def test_no_uniforms_for_no_rows(emu):
    empty = torch.zeros(0, dtype=torch.int64)
    assert emu.uniforms(empty, empty, empty).shape == (0,)


# --- penalties and bans ---------------------------------------------------------------------------

def penalty_case(num_rows: int, vocab: int, picked: list[int], max_len: int, seed: int, bias: bool):
    gen = torch.Generator().manual_seed(seed)
    n = len(picked)
    logits = torch.randn(num_rows, vocab, generator=gen) * 4
    logits[0, :3] = NEG_INF  # banned entries stay -inf
    lengths = torch.randint(0, max_len + 1, (n,), generator=gen)
    token_ids = torch.randint(0, vocab, (n, max_len), generator=gen)
    token_ids[:, :max_len // 2] = torch.randint(0, min(4, vocab), (n, max_len // 2), generator=gen)  # repeats
    args = dict(
        rows=torch.tensor(picked), token_ids=token_ids, token_lengths=lengths,
        embedding_bias=torch.randn(n, vocab, generator=gen) if bias else None,
        temperature=torch.rand(n, generator=gen) * 1.5 + 0.3,
        repetition_penalty=torch.rand(n, generator=gen) * 1.5 + 0.5,
        presence_penalty=torch.randn(n, generator=gen), frequency_penalty=torch.randn(n, generator=gen) * 0.3,
        min_lengths=torch.randint(0, 4, (n,), generator=gen), num_generated=torch.randint(0, 4, (n,), generator=gen),
        end_ids=torch.randint(-1, vocab, (n,), generator=gen))
    return logits, args


@pytest.mark.parametrize("vocab, picked, max_len, bias", [
    (1, [0], 3, False), (33, [2, 0], 7, True), (300, [1, 4, 3], 40, True), (1000, [0, 5], 1, False),
    (77, [3], 0, True)])
def test_penalties_equal_the_reference_exactly(emu, reference, vocab, picked, max_len, bias):
    logits, args = penalty_case(6, vocab, picked, max_len, seed=vocab, bias=bias)
    expected = logits.clone()
    reference.apply_penalties(expected, **args)
    emu.apply_penalties(logits, **args)
    assert torch.equal(logits, expected)


def test_penalties_on_strided_columns_are_written_back(emu, reference):
    wide, args = penalty_case(4, 100, [1, 2], 9, seed=3, bias=True)
    logits = wide[:, :50]  # rows 100 apart: used in place
    args["embedding_bias"] = args["embedding_bias"][:, :50].contiguous()
    args["token_ids"] = args["token_ids"] % 50
    args["end_ids"] = args["end_ids"] % 50
    expected = wide.clone()
    reference.apply_penalties(expected[:, :50], **args)
    emu.apply_penalties(logits, **args)
    assert torch.equal(wide, expected)
    columns = wide.t()[:30]  # [30, 4] with column stride 100: a contiguous copy, then copied back
    expected = columns.clone()
    small = dict(args, embedding_bias=None, token_ids=args["token_ids"] % 4, end_ids=args["end_ids"] % 4)
    reference.apply_penalties(expected, **small)
    emu.apply_penalties(columns, **small)
    assert torch.equal(columns, expected)


def test_ban_tokens_equal_the_reference(emu, reference):
    logits = random_logits(5, 70, seed=1)
    expected = logits.clone()
    rows, tokens = torch.tensor([0, 4, 4, 2, 0, 4]), torch.tensor([69, 0, 33, 5, 69, 1])
    reference.ban_tokens(expected, rows, tokens)
    emu.ban_tokens(logits, rows, tokens)
    assert torch.equal(logits, expected)
    emu.ban_tokens(logits, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert torch.equal(logits, expected)


# --- greedy and log-softmax --------------------------------------------------------------------------

def logits_cases():
    ties = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 0.0, 0.0, 3.0], [NEG_INF, -2.0, NEG_INF, -2.0]])
    banned = random_logits(4, 515, seed=2)
    banned[:, ::3] = NEG_INF
    return {"ties": ties, "one_row": random_logits(1, 50, seed=3), "one_token": random_logits(3, 1, seed=4),
            "vocab_1000": random_logits(3, 1000, seed=5), "banned": banned,
            "rounded": random_logits(6, 129, seed=6).round()}


@pytest.mark.parametrize("case", list(logits_cases()))
def test_greedy_equals_the_reference(emu, reference, case):
    logits = logits_cases()[case]
    tokens, log_probs = emu.greedy(logits)
    expected_tokens, expected_log_probs = reference.greedy(logits)
    assert tokens.tolist() == expected_tokens.tolist()
    assert not log_probs.isnan().any()
    torch.testing.assert_close(log_probs, expected_log_probs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", list(logits_cases()))
def test_log_softmax_equals_the_reference(emu, reference, case):
    logits = logits_cases()[case]
    got = emu.log_softmax(logits)
    assert not got.isnan().any()
    torch.testing.assert_close(got, reference.log_softmax(logits), atol=1e-5, rtol=0)


def test_greedy_and_log_softmax_of_no_rows(emu):
    tokens, log_probs = emu.greedy(torch.zeros(0, 10))
    assert tokens.shape == log_probs.shape == (0,)
    assert emu.log_softmax(torch.zeros(0, 10)).shape == (0, 10)


# --- sampling ----------------------------------------------------------------------------------------

def ambiguous_rows(reference, logits, top_k, top_p, uniforms, tolerance=1e-5, cut_tolerance=1e-6) -> torch.Tensor:
    """bool [R]: rows whose draw lies within float rounding of a CDF step, or whose top-p cut does."""
    kept = reference.top_k_top_p_mask(logits, top_k, top_p)
    weights = torch.exp(logits.double() - logits.double().max(-1, keepdim=True).values).masked_fill(~kept, 0.0)
    cdf = weights.cumsum(-1) / weights.sum(-1, keepdim=True)
    near = (cdf - uniforms.double()[:, None]).abs().min(-1).values < tolerance
    p_on = (top_p > 0) & (top_p < 1)
    pool = reference.top_k_top_p_mask(logits, top_k, torch.zeros_like(top_p))  # the top-k set p is relative to
    probs = torch.softmax(logits.double().masked_fill(~pool, NEG_INF), -1)
    ordered = probs.sort(dim=-1, descending=True).values
    exclusive = (ordered.cumsum(-1) - ordered)[:, 1:]  # the first token is always kept
    near |= p_on & ((exclusive - top_p.double()[:, None]).abs() < cut_tolerance).any(-1)
    return near


def check_sample(emu, reference, logits, top_k, top_p, uniforms, normalize, min_checked=0.95) -> None:
    tokens, log_probs = emu.sample(logits, top_k, top_p, uniforms, normalize)
    dense = logits.contiguous()
    expected_tokens, expected_log_probs = reference.sample(dense, top_k, top_p, uniforms, normalize)
    assert tokens.dtype == torch.int64 and log_probs.dtype == torch.float32
    assert not log_probs.isnan().any()
    checked = ~ambiguous_rows(reference, dense, top_k, top_p, uniforms)
    assert tokens[checked].tolist() == expected_tokens[checked].tolist()
    torch.testing.assert_close(log_probs[checked], expected_log_probs[checked], atol=1e-5, rtol=0)
    kept = reference.top_k_top_p_mask(dense, top_k, top_p)
    assert bool(kept[torch.arange(len(tokens))[checked], tokens[checked]].all())
    assert float(checked.double().mean()) >= min_checked


def draws_of_one_row(row: torch.Tensor, top_k: int, top_p: float, num_draws: int, seed: int, normalize=True):
    """One logits row (as a stride-0 expansion) with num_draws uniforms."""
    u = torch.rand(num_draws, generator=torch.Generator().manual_seed(seed))
    return (row[None].expand(num_draws, -1), torch.full((num_draws,), top_k), torch.full((num_draws,), top_p), u,
            torch.full((num_draws,), normalize))


@pytest.mark.parametrize("vocab, top_k, top_p", [
    (300, 0, 0.0), (300, 20, 0.0), (300, 0, 0.7), (300, 50, 0.6), (1000, 200, 0.95), (77, 1, 0.0),
    (77, 77, 0.0), (77, 500, 0.5), (515, 0, 1e-6), (515, 0, 1.0), (40, 7, 0.999)])
def test_sampled_tokens_equal_the_reference_over_many_draws(emu, reference, vocab, top_k, top_p):
    row = random_logits(1, vocab, seed=vocab + top_k, scale=2.0)[0]
    check_sample(emu, reference, *draws_of_one_row(row, top_k, top_p, 100, seed=top_k, normalize=top_k % 2 == 0))


@pytest.mark.parametrize("seed", range(4))
def test_mixed_rows_equal_the_reference(emu, reference, seed):
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = 40, [64, 257, 700, 33][seed]
    logits = torch.randn(rows, vocab, generator=gen) * torch.linspace(0.3, 6.0, rows)[:, None]
    logits[::5] = logits[::5].round()  # ties
    logits[1::6, ::4] = NEG_INF       # bans
    top_k = torch.tensor([0, 1, 3, 40, 0, 0, 200, 5, 2, 1000])[torch.randint(0, 10, (rows,), generator=gen)]
    top_p = torch.tensor([0.0, 0.0, 0.5, 0.9, 0.3, 0.999, 1.0, 1e-4])[torch.randint(0, 8, (rows,), generator=gen)]
    normalize = torch.rand(rows, generator=gen) < 0.5
    check_sample(emu, reference, logits, top_k, top_p, torch.rand(rows, generator=gen), normalize, min_checked=0.9)


@pytest.mark.parametrize("vocab", [2000, 3000])
def test_blocks_of_several_warps_equal_the_reference(emu, reference, vocab):
    """4 and 6 warps per row (decoding_block): cross-warp reductions, radix digits and scan segments."""
    from runtime.kernels.cuda.decoding_launchers import decoding_block
    assert decoding_block(vocab, emu.config) == 32 * -(-vocab // 512)
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=gen) * 3
    logits[::4] = logits[::4].round()
    top_k = torch.tensor([0, 1, 50, 0, 400, 0] * 2)
    top_p = torch.tensor([0.0, 0.0, 0.8, 0.6, 0.0, 1e-3] * 2)
    u, normalize = torch.rand(12, generator=gen), torch.rand(12, generator=gen) < 0.5
    check_sample(emu, reference, logits, top_k, top_p, u, normalize, min_checked=0.9)
    tokens, log_probs = emu.greedy(logits)
    assert tokens.tolist() == reference.greedy(logits)[0].tolist()
    torch.testing.assert_close(emu.log_softmax(logits), reference.log_softmax(logits), atol=1e-5, rtol=0)
    log_probs = torch.log_softmax(logits[1:4], -1)  # rows without ties (torch's topk orders ties arbitrarily)
    for ours, theirs in zip(emu.beam_candidates(log_probs, torch.tensor([-1.0, -2.0, -3.0]), 6, 0.3),
                            reference.beam_candidates(log_probs, torch.tensor([-1.0, -2.0, -3.0]), 6, 0.3)):
        assert torch.equal(ours, theirs)


def test_ties_at_the_kth_place_keep_the_lowest_ids(emu, reference):
    row = torch.tensor([1.0, 3.0, 2.0, 3.0, 3.0, 0.0, 3.0])
    logits, top_k, top_p, u, normalize = draws_of_one_row(row, 2, 0.0, 64, seed=1)
    tokens, log_probs = emu.sample(logits, top_k, top_p, u, normalize)
    assert set(tokens.tolist()) == {1, 3}
    assert tokens.tolist() == [1 if x < 0.5 else 3 for x in u.tolist()]
    torch.testing.assert_close(log_probs, torch.full((64,), -0.6931472), atol=1e-6, rtol=0)
    check_sample(emu, reference, logits, top_k, top_p, u, normalize)


def test_ties_at_the_top_p_cut_keep_the_lowest_ids(emu, reference):
    # Eight tied tokens of ~0.12 each: p = 0.3 keeps three of them, the three lowest ids.
    row = torch.full((20,), -3.0)
    row[[2, 5, 6, 9, 11, 15, 17, 19]] = 1.0
    logits, top_k, top_p, u, normalize = draws_of_one_row(row, 0, 0.3, 48, seed=2)
    tokens, _ = emu.sample(logits, top_k, top_p, u, normalize)
    assert set(tokens.tolist()) == {2, 5, 6}
    check_sample(emu, reference, logits, top_k, top_p, u, normalize)
    # the same cut inside a top-k that itself splits a tie
    logits, top_k, top_p, u, normalize = draws_of_one_row(row, 5, 0.5, 48, seed=3)
    tokens, _ = emu.sample(logits, top_k, top_p, u, normalize)
    assert set(tokens.tolist()) == {2, 5, 6}
    check_sample(emu, reference, logits, top_k, top_p, u, normalize)


def test_top_p_is_relative_to_the_top_k_mass(emu, reference):
    row = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    # top-k 2 keeps 0.4 / 0.3 (4/7, 3/7 of its mass): p = 0.5 keeps token 0 only; over the vocabulary it
    # would keep 0 and 1.
    logits, top_k, top_p, u, normalize = draws_of_one_row(row, 2, 0.5, 32, seed=4)
    tokens, log_probs = emu.sample(logits, top_k, top_p, u, normalize)
    assert tokens.tolist() == [0] * 32 and log_probs.abs().max() < 1e-6
    _, full = emu.sample(logits, top_k, top_p, u, torch.zeros(32, dtype=torch.bool))
    torch.testing.assert_close(full, torch.full((32,), float(row[0])), atol=1e-6, rtol=0)


def test_top_k_beyond_the_finite_tokens_never_draws_a_banned_one(emu, reference):
    row = random_logits(1, 50, seed=5)[0]
    row[5:] = NEG_INF
    for top_k, top_p in ((10, 0.0), (50, 0.0), (10, 0.99), (0, 0.0)):
        logits, k, p, u, normalize = draws_of_one_row(row, top_k, top_p, 40, seed=top_k)
        tokens, log_probs = emu.sample(logits, k, p, u, normalize)
        assert (tokens < 5).all() and torch.isfinite(log_probs).all()
        check_sample(emu, reference, logits, k, p, u, normalize)


def test_extreme_uniforms_and_a_single_token(emu, reference):
    """u = 0 draws the first kept token, u = 1 - 2^-24 the last one: no float rounding in play."""
    row = random_logits(1, 90, seed=6)[0]
    u = torch.tensor([0.0, 1.0 - 2.0 ** -24, 0.5])
    for top_k, top_p in ((0, 0.0), (3, 0.0), (0, 0.4)):
        args = (row[None].expand(3, -1), torch.full((3,), top_k), torch.full((3,), top_p), u,
                torch.ones(3, dtype=torch.bool))
        tokens, log_probs = emu.sample(*args)
        expected_tokens, expected_log_probs = reference.sample(args[0].contiguous(), *args[1:])
        assert tokens.tolist() == expected_tokens.tolist()
        torch.testing.assert_close(log_probs, expected_log_probs, atol=1e-5, rtol=0)
    tokens, log_probs = emu.sample(torch.tensor([[1.5]]), torch.tensor([0]), torch.tensor([0.5]), torch.tensor([0.9]),
                                   torch.tensor([True]))
    assert tokens.tolist() == [0] and log_probs.tolist() == [0.0]


def test_no_rows_to_sample(emu):
    empty = torch.zeros(0)
    tokens, log_probs = emu.sample(torch.zeros(0, 8), empty.long(), empty, empty, empty.bool())
    assert tokens.shape == log_probs.shape == (0,)


# --- beam candidates -----------------------------------------------------------------------------------

@pytest.mark.parametrize("num_beams, vocab, num_candidates", [(1, 50, 2), (3, 300, 6), (4, 3, 8), (2, 5, 40),
                                                              (4, 129, 8)])
@pytest.mark.parametrize("diversity_rate", [0.0, 0.7])
def test_beam_candidates_equal_the_reference_exactly(emu, reference, num_beams, vocab, num_candidates, diversity_rate):
    gen = torch.Generator().manual_seed(num_beams * vocab)
    log_probs = torch.log_softmax(torch.randn(num_beams, vocab, generator=gen) * 2, -1)
    running = -torch.rand(num_beams, generator=gen) * 5
    got = emu.beam_candidates(log_probs, running, num_candidates, diversity_rate)
    expected = reference.beam_candidates(log_probs, running, num_candidates, diversity_rate)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.int64
    for ours, theirs in zip(got, expected):
        assert torch.equal(ours, theirs)


def stable_beam_candidates(log_probs, running, num_candidates, diversity_rate):
    """The documented order by a stable sort: score desc, ties by the lower token id within a beam;
    rank score - d * r desc, ties by the lower (beam, r)."""
    num_beams, vocab = log_probs.shape
    per_beam = min(num_candidates, vocab)
    scores = log_probs + running[:, None]
    order = scores.argsort(dim=-1, descending=True, stable=True)[:, :per_beam]
    values = scores.gather(1, order)
    ranked = values - diversity_rate * torch.arange(per_beam, dtype=torch.float32)[None, :]
    flat = ranked.reshape(-1).argsort(descending=True, stable=True)[:num_candidates]
    return values.reshape(-1)[flat], flat // per_beam, order.reshape(-1)[flat]


@pytest.mark.parametrize("diversity_rate", [0.0, 0.5])
def test_beam_candidate_ties_go_to_the_lower_beam_and_token(emu, diversity_rate):
    log_probs = torch.tensor([[-1.0, -2.0, -1.0, -3.0, -2.0], [-2.0, -1.0, -1.0, -2.0, NEG_INF],
                              [-1.5, -1.0, -2.5, -1.0, -1.0]])
    running = torch.tensor([-1.0, -1.0, -1.0])
    got = emu.beam_candidates(log_probs, running, 6, diversity_rate)
    for ours, theirs in zip(got, stable_beam_candidates(log_probs, running, 6, diversity_rate)):
        assert torch.equal(ours, theirs)
    if diversity_rate == 0.0:
        assert got[1].tolist() == [0, 0, 1, 1, 2, 2] and got[2].tolist() == [0, 2, 1, 2, 1, 3]


def test_beam_candidates_rank_banned_tokens_last(emu, reference):
    log_probs = torch.log_softmax(random_logits(2, 40, seed=8), -1)
    log_probs[:, 3:] = NEG_INF
    running = torch.tensor([-0.5, -0.7])
    got = emu.beam_candidates(log_probs, running, 4, 0.0)
    expected = reference.beam_candidates(log_probs, running, 4, 0.0)
    for ours, theirs in zip(got, expected):
        assert torch.equal(ours, theirs)
    scores, _, tokens = emu.beam_candidates(log_probs, running, 8, 0.0)
    assert torch.isfinite(scores[:6]).all() and (tokens[:6] < 3).all() and torch.isinf(scores[6:]).all()


# --- end to end ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sessions(tmp_path_factory, emu):
    from runtime import Engine, GptSession, WorldConfig
    from tests.factories import make_checkpoint
    path = tmp_path_factory.mktemp("llama_decoding")
    make_checkpoint(path, "llama", seed=3)
    engine = Engine.from_dir(path, tokens_per_block=4)
    config = GptSession.Config(max_batch_size=4, max_beam_width=3, max_sequence_length=32)
    return {name: GptSession(config, engine.model_config, WorldConfig(), engine, kernels=kernels)
            for name, kernels in (("torch", "torch"), ("emu", emu))}


def generate_both(sessions, prompts, sampling, end_id=-1, max_new=8, **inputs):
    from runtime import GenerationInput, GenerationOutput
    outputs = {}
    for name, session in sessions.items():
        inp = GenerationInput(end_id=end_id, pad_id=0, ids=torch.tensor([t for p in prompts for t in p]),
                              lengths=torch.tensor([len(p) for p in prompts]), packed=True, max_new_tokens=max_new,
                              **inputs)
        outputs[name] = GenerationOutput()
        session.generate(outputs[name], inp, sampling)
    return outputs["emu"], outputs["torch"]


PROMPTS = [[5, 17, 99, 3], [42, 7], [100, 101, 102, 8, 9, 60], [77]]


def test_gpt_session_seeded_sampling_with_mixed_settings_equals_torch(sessions):
    from runtime import SamplingConfig
    sampling = SamplingConfig(top_k=[5, 0, 1000, 20], top_p=[0.0, 0.8, 0.0, 0.7], temperature=[0.8, 1.0, 1.3, 1.0],
                              repetition_penalty=[1.0, 1.3, 1.0, 1.1], presence_penalty=[0.0, 0.0, 0.4, 0.0],
                              frequency_penalty=[0.0, 0.0, 0.2, 0.0], top_p_decay=[1.0, 1.0, 1.0, 0.9],
                              min_length=[0, 0, 3, 0], no_repeat_ngram_size=[0, 2, 0, 0],
                              random_seed=[1, 2 ** 64 - 5, 3, 4])
    bias = torch.zeros(128)
    bias[[10, 20, 30]] = 1.5
    emu_out, torch_out = generate_both(sessions, PROMPTS, sampling, end_id=2, embedding_bias=bias)
    assert torch.equal(emu_out.ids, torch_out.ids) and torch.equal(emu_out.lengths, torch_out.lengths)
    torch.testing.assert_close(emu_out.log_probs, torch_out.log_probs, atol=1e-4, rtol=0)
    torch.testing.assert_close(emu_out.cum_log_probs, torch_out.cum_log_probs, atol=1e-4, rtol=0)


def test_gpt_session_greedy_and_beam_search_equal_torch(sessions):
    from runtime import SamplingConfig
    emu_out, torch_out = generate_both(sessions, PROMPTS[:2], SamplingConfig(top_k=1, repetition_penalty=1.2))
    assert torch.equal(emu_out.ids, torch_out.ids)
    sampling = SamplingConfig(beam_width=3, beam_search_diversity_rate=[0.0, 0.6], length_penalty=1.0)
    emu_out, torch_out = generate_both(sessions, PROMPTS[1:3], sampling, end_id=2)
    assert torch.equal(emu_out.ids, torch_out.ids) and torch.equal(emu_out.lengths, torch_out.lengths)
    torch.testing.assert_close(emu_out.cum_log_probs, torch_out.cum_log_probs, atol=1e-4, rtol=0)


# --- races --------------------------------------------------------------------------------------------------

@pytest.mark.skipif(os.environ.get("BATCH_MANAGER_TSAN") != "1",
                    reason="ThreadSanitizer over the decoding kernels takes ~45 s; set BATCH_MANAGER_TSAN=1")
def test_the_decoding_kernels_are_race_free_under_thread_sanitizer():
    library = subprocess.run(["g++", "-print-file-name=libtsan.so"], capture_output=True, text=True).stdout.strip()
    if not library or not os.path.isabs(library) or not os.path.exists(library):
        pytest.skip("ThreadSanitizer runtime (libtsan) not installed")
    env = {**os.environ, "LD_PRELOAD": library, "TSAN_OPTIONS": "halt_on_error=1 exitcode=66",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "tests.runtime.kernels.tsan_decoding_probe"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    if "FATAL: ThreadSanitizer" in done.stderr:
        pytest.skip(f"ThreadSanitizer cannot run here: {done.stderr.strip().splitlines()[0]}")
    assert done.returncode == 0, done.stderr[-3000:]
