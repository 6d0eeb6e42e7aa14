"""Several greedy generation steps in one call (ModelRunner.decode_greedy): the fused step and the
op-by-op path pick the tokens and log probs that one forward per step and kernels.greedy pick,
write the same KV, stop once every sequence picked its end id, and refuse a block table that
cannot hold the steps; Decoder.accept_steps keeps the picks up to the one that ends a request."""
from __future__ import annotations

import pytest
import torch

from runtime import Engine, ModelRunner
from runtime.decoding import Decoder, DecodeState, DecodingParams
from runtime.request import FinishReason, RequestOutput
from tests.factories import make_checkpoint, step_inputs

PROMPTS = [[5, 9, 17, 3, 44, 2, 90], [7, 7, 31], [100, 12, 8, 61, 61, 5, 23, 77, 14, 2, 3]]
NUM_STEPS = 9
TPB = 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("decode_greedy")
    make_checkpoint(path, "llama")
    return Engine.from_dir(path, tokens_per_block=TPB)


def tables(prompts, num_steps: int) -> list[list[int]]:
    """Disjoint block ids covering each prompt + num_steps tokens, rotated (not in pool order)."""
    out, next_block = [], 0
    for p in prompts:
        n = -(-(len(p) + num_steps) // TPB)
        out.append([next_block + (j + 1) % n for j in range(n)])
        next_block += n
    return out


def prefill(runner: ModelRunner, prompts, block_tables) -> list[int]:
    """Context steps; -> each sequence's first (greedy) token."""
    outputs = runner.forward(step_inputs([(p, 0, t) for p, t in zip(prompts, block_tables)]))
    tokens, _ = runner.kernels.greedy(outputs["logits"])
    return tokens.tolist()


def one_step_at_a_time(runner: ModelRunner, prompts, block_tables, first, num_steps):
    tokens, log_probs, fed = [], [], first
    for k in range(num_steps):
        outputs = runner.forward(step_inputs([([t], len(p) + k, table)
                                              for t, p, table in zip(fed, prompts, block_tables)]))
        picked, lp = runner.kernels.greedy(outputs["logits"])
        tokens.append(picked)
        log_probs.append(lp)
        fed = picked.tolist()
    return torch.stack(tokens, 1), torch.stack(log_probs, 1)


@pytest.mark.parametrize("fused", [True, False])
def test_several_steps_equal_one_forward_per_step(engine, fused):
    block_tables = tables(PROMPTS, NUM_STEPS)
    num_blocks = sum(len(t) for t in block_tables)
    reference = ModelRunner(engine, num_blocks)
    first = prefill(reference, PROMPTS, block_tables)
    want_tokens, want_log_probs = one_step_at_a_time(reference, PROMPTS, block_tables, first, NUM_STEPS)

    runner = ModelRunner(engine, num_blocks, fused_decode=fused)
    if fused and runner.decode_step is None:
        pytest.skip("this kernel backend has no fused generation step")
    assert prefill(runner, PROMPTS, block_tables) == first
    steps = runner.decode_greedy(step_inputs([([t], len(p), table) for t, p, table in
                                              zip(first, PROMPTS, block_tables)]), NUM_STEPS)
    assert steps.tokens.tolist() == want_tokens.tolist()
    torch.testing.assert_close(steps.log_probs, want_log_probs, rtol=0, atol=1e-5)
    # The KV of every fed token was written where one step at a time writes it.
    torch.testing.assert_close(runner.kv_pool, reference.kv_pool, rtol=0, atol=1e-5)


def test_the_call_ends_once_every_sequence_picked_its_end_id(engine):
    block_tables = tables(PROMPTS, NUM_STEPS)
    runner = ModelRunner(engine, sum(len(t) for t in block_tables))
    first = prefill(runner, PROMPTS, block_tables)
    inputs = step_inputs([([t], len(p), table) for t, p, table in zip(first, PROMPTS, block_tables)])
    full = runner.decode_greedy(inputs, NUM_STEPS).tokens
    # Sequence 0 ends at its 3rd pick, sequence 1 at its 5th, sequence 2 never: all the steps.
    ends = [full[0, 2].item(), full[1, 4].item(), None]
    assert runner.decode_greedy(inputs, NUM_STEPS, ends).tokens.shape == (3, NUM_STEPS)
    ends[2] = full[2, 5].item()
    last = max(next(j for j in range(NUM_STEPS) if full[i, j].item() == e) for i, e in enumerate(ends))
    stopped = runner.decode_greedy(inputs, NUM_STEPS, ends)
    assert stopped.tokens.tolist() == full[:, :last + 1].tolist()


def test_a_table_too_short_for_the_steps_is_refused(engine):
    prompt = PROMPTS[0]                      # 7 tokens: blocks 0 and 1 hold 8
    runner = ModelRunner(engine, 4)
    (first,) = prefill(runner, [prompt], [[0, 1]])
    inputs = step_inputs([([first], len(prompt), [0, 1])])
    with pytest.raises(ValueError, match=r"block_tables: must hold every sequence's past \+ 3 tokens"):
        runner.decode_greedy(inputs, 3)      # positions 7, 8, 9: block 2 of a 2-block table
    with pytest.raises(ValueError, match="num_steps: must be an integer >= 1, got 0"):
        runner.decode_greedy(inputs, 0)
    assert runner.decode_greedy(inputs, 1).tokens.shape == (1, 1)


def state(end_id=None, stop_words=(), max_new_tokens=20, generated=(4,)) -> DecodeState:
    record = RequestOutput(1, [1, 2, 3], 1)
    record.beams[0].extend(generated)
    return DecodeState(DecodingParams(end_id=end_id, stop_words=stop_words), record, max_new_tokens)


def test_accept_steps_keeps_the_picks_up_to_the_one_that_ends():
    picks, log_probs = [10, 11, 12, 13], [-0.5, -1.0, -1.5, -2.0]
    every = Decoder.accept_steps(state(), picks, log_probs)
    assert (every.tokens, every.num_accepted_drafts, every.finish_reason) == ((10, 11, 12, 13), 3, None)
    assert every.cum_log_prob == pytest.approx(-5.0)
    end = Decoder.accept_steps(state(end_id=12), picks, log_probs)   # the end id is not output; its log prob counts
    assert (end.tokens, end.num_accepted_drafts, end.finish_reason) == ((10, 11), 2, FinishReason.END_ID)
    assert end.cum_log_prob == pytest.approx(-3.0)
    stop = Decoder.accept_steps(state(stop_words=((4, 10, 11),)), picks, log_probs)   # spans the earlier token
    assert (stop.tokens, stop.finish_reason) == ((10, 11), FinishReason.STOP_WORDS)
    length = Decoder.accept_steps(state(max_new_tokens=3), picks, log_probs)
    assert (length.tokens, length.finish_reason) == ((10, 11), FinishReason.LENGTH)
    with pytest.raises(AssertionError):
        Decoder.accept_steps(DecodeState(DecodingParams(top_k=5), RequestOutput(1, [1], 1), 4), picks, log_probs)
