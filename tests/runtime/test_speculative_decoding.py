"""Draft tokens at the decoder: data in, data out, with a deterministic fake model (logits a
function of the sequence), so the wide matrices run in milliseconds.

Greedy with drafts must equal plain greedy token for token (penalties, bans, stop words, min
length, end id, length applied at each accepted position); sampled requests verify drafts by
rejection sampling, whose first emitted token must be distributed as the target."""
from __future__ import annotations

import random

import pytest
import torch

from runtime.decoding import Decoder, DecodeState, DecodingParams
from runtime.kernels import get_kernels
from runtime.request import FinishReason, RequestOutput

VOCAB = 13


def fake_logits(sequence: list[int]) -> torch.Tensor:
    """float32 [VOCAB], a deterministic function of the last three tokens."""
    gen = torch.Generator().manual_seed(hash(tuple(sequence[-3:])) & 0xFFFFFFFF)
    return torch.randn(VOCAB, generator=gen) * 2.5


def run(params: DecodingParams, prompt: list[int], max_new_tokens: int, propose=None, seed: int = 0):
    """Decode one request to the end -> (tokens, log probs, finish reason, drafts proposed, accepted).
    propose(sequence, rng) -> draft tokens for the next step (None: plain decoding)."""
    decoder = Decoder(get_kernels("torch"))
    record = RequestOutput(0, list(prompt))
    state = DecodeState(params, record, max_new_tokens)
    rng = random.Random(seed)
    log_probs, proposed, accepted = [], 0, 0
    while not state.is_finished:
        sequence = record.sequence(0)
        drafts = tuple(propose(sequence, rng)) if propose else ()
        drafts = drafts[:max(0, max_new_tokens - record.num_generated - 1)]   # the scheduler's clip
        logits = torch.stack([fake_logits(sequence + list(drafts[:j])) for j in range(len(drafts) + 1)])
        (outcome,) = decoder.step([state], logits, [drafts])
        record.apply(outcome)
        log_probs += outcome.log_probs
        proposed += len(drafts)
        accepted += outcome.num_accepted_drafts
        assert outcome.num_accepted_drafts <= len(drafts)
    return record.beams[0], log_probs, state.finish_reason, proposed, accepted


def true_continuation(params, prompt, max_new_tokens):
    tokens, *_ = run(params, prompt, max_new_tokens)
    return lambda sequence, rng: (tokens[len(sequence) - len(prompt):] + [0] * 4)[:4]


def random_drafts(sequence, rng):
    return [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 5))]


def wrong_drafts(params, prompt, max_new_tokens):
    """Drafts that differ from the greedy continuation at every position."""
    tokens, *_ = run(params, prompt, max_new_tokens)
    return lambda sequence, rng: [(t + 1) % VOCAB for t in (tokens[len(sequence) - len(prompt):] + [0] * 3)[:3]]


GREEDY_SETTINGS = [
    dict(),
    dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
    dict(no_repeat_ngram_size=2),
    dict(bad_words=((3,), (4, 5))),
    dict(stop_words=((6, 7),)),
    dict(min_length=5, end_id=2),
    dict(end_id=2),
    dict(temperature=0.7, embedding_bias=torch.linspace(-1, 1, VOCAB)),
]


@pytest.mark.parametrize("settings", GREEDY_SETTINGS, ids=lambda s: ",".join(s) or "plain")
@pytest.mark.parametrize("drafter", ["random", "true", "wrong"])
def test_greedy_with_drafts_equals_plain_greedy(settings, drafter):
    params = DecodingParams(**settings)
    params.validate(VOCAB, 1)
    for prompt in ([1, 2, 3], [8, 8, 8, 9, 10], [11]):
        plain = run(params, prompt, 17)
        propose = {"random": random_drafts, "true": true_continuation(params, prompt, 17),
                   "wrong": wrong_drafts(params, prompt, 17)}[drafter]
        tokens, log_probs, reason, proposed, accepted = run(params, prompt, 17, propose)
        assert (tokens, reason) == (plain[0], plain[2])
        assert log_probs == pytest.approx(plain[1], abs=1e-5)
        if drafter == "wrong":
            assert accepted == 0
        if drafter == "true":   # all but the padding past an end token
            assert proposed > 0 and accepted >= proposed - 4


def test_a_stop_word_completed_inside_an_accepted_run_ends_there():
    params = DecodingParams()
    plain, *_ = run(params, [1, 2, 3], 12)
    stop = (plain[2], plain[3])
    params = DecodingParams(stop_words=(stop,))
    tokens, _, reason, *_ = run(params, [1, 2, 3], 12,
                               true_continuation(DecodingParams(), [1, 2, 3], 12))
    assert (tokens, reason) == (plain[:4], FinishReason.STOP_WORDS)


def first_tokens(params_for_seed, drafts_for_seed, logits_row0, num_seeds, draft_logits=None, threshold=None):
    """The first emitted token of `num_seeds` requests that differ only in seed (and drafts), in one step."""
    decoder = Decoder(get_kernels("torch"))
    states, drafts, rows = [], [], []
    for seed in range(num_seeds):
        state = DecodeState(params_for_seed(seed), RequestOutput(0, [1, 2]), 8)
        state.draft_logits = draft_logits
        state.draft_acceptance_threshold = threshold
        states.append(state)
        drafts.append(tuple(drafts_for_seed(seed)))
        rows += [logits_row0] + [fake_logits([1, 2] + list(drafts[-1][:j])) for j in range(1, len(drafts[-1]) + 1)]
    outcomes = decoder.step(states, torch.stack(rows), drafts)
    return torch.tensor([o.tokens[0] for o in outcomes]), outcomes


@pytest.mark.parametrize("with_draft_logits", [True, False])
def test_rejection_sampling_keeps_the_target_distribution(with_draft_logits):
    """Drafts drawn from q (a distribution unlike the target), or one fixed draft (q one-hot):
    the first emitted token is distributed as the target p (total variation over 3000 seeds)."""
    torch.manual_seed(0)
    row = torch.randn(VOCAB) * 1.5
    target = torch.softmax(row / 0.8, dim=-1)
    draft_row = torch.randn(VOCAB) * 2.0
    q = torch.softmax(draft_row, -1)
    draws = torch.multinomial(q, 3000, replacement=True, generator=torch.Generator().manual_seed(1)).tolist()
    num_seeds = 3000
    tokens, outcomes = first_tokens(
        lambda seed: DecodingParams(temperature=0.8, top_k=VOCAB, random_seed=seed),
        (lambda seed: (draws[seed], 3)) if with_draft_logits else (lambda seed: (int(q.argmax()), 3)),
        row, num_seeds, draft_logits=torch.stack([draft_row, torch.zeros(VOCAB)]) if with_draft_logits else None)
    empirical = torch.bincount(tokens, minlength=VOCAB).float() / num_seeds
    assert 0.5 * float((empirical - target).abs().sum()) < 0.035
    # Some drafts were accepted and some rejected: both branches ran.
    accepted = sum(o.num_accepted_drafts > 0 for o in outcomes)
    assert 0 < accepted < num_seeds


def test_rejection_sampling_is_batch_invariant():
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3))
    alone = [first_tokens(lambda s, k=k: DecodingParams(top_k=5, random_seed=k), lambda s: (4, 5), row, 1)[0].item()
             for k in range(20)]
    together, _ = first_tokens(lambda seed: DecodingParams(top_k=5, random_seed=seed), lambda s: (4, 5), row, 20)
    assert together.tolist() == alone


def test_acceptance_threshold_follows_tensorrt_llm():
    """Accepted iff p(v) >= t * q(v) for every v: q == p accepts at t = 1, rejects above."""
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(5))
    params = lambda seed: DecodingParams(top_k=VOCAB, random_seed=seed)   # noqa: E731
    _, outcomes = first_tokens(params, lambda s: (2,), row, 5, draft_logits=row[None], threshold=1.0)
    assert all(o.num_accepted_drafts == 1 and o.tokens[0] == 2 for o in outcomes)
    _, outcomes = first_tokens(params, lambda s: (2,), row, 5, draft_logits=row[None], threshold=1.01)
    assert all(o.num_accepted_drafts == 0 for o in outcomes)
