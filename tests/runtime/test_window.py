"""Attention window and sink tokens in ModelRunner: equal a dense attention under the mask
k <= q and (k > q - w or k < s) (transformers with that 4D mask is the reference), also while
decoding over block tables whose released entries are negative and whose released blocks hold
another sequence's garbage."""
from __future__ import annotations

import pytest
import torch

from runtime import Engine, ModelRunner
from runtime.model_runner import effective_window
from tests.factories import make_checkpoints, step_inputs

ATOL = 1e-4
VOCAB = 128


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def masked_reference(model, tokens: list[int], window: int, sink: int) -> torch.Tensor:
    """transformers logits [n, V] with the window/sink mask given as a 4D additive mask."""
    n = len(tokens)
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = (k <= q) & ((k > q - window) | (k < sink))
    mask = torch.zeros(n, n).masked_fill(~visible, float("-inf"))[None, None]
    with torch.no_grad():
        return model(torch.tensor([tokens]), attention_mask=mask).logits[0]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (checkpoint dir, transformers model)."""
    return make_checkpoints(tmp_path_factory)


@pytest.mark.parametrize("window, sink", [(6, 3), (6, 0), (5, 4), (1, 1), (4, 8)])
def test_one_shot_context_equals_the_masked_reference(models, window, sink):
    path, model = models["llama"]
    tokens = random_tokens(22, seed=window * 10 + sink)
    runner = ModelRunner(Engine.from_dir(path, tokens_per_block=4), 8, max_attention_window=window,
                         sink_token_length=sink)
    out = runner.forward(step_inputs([(tokens, 0, list(range(6)))], context_logits=True))["context_logits"]
    torch.testing.assert_close(out, masked_reference(model, tokens, window, sink), atol=ATOL, rtol=0)


@pytest.mark.parametrize("tokens_per_block", [1, 4])
@pytest.mark.parametrize("window, sink, chunks", [(6, 3, [5, 1, 1, 7, 1, 1, 1]), (5, 0, [3, 6, 1, 1, 4]),
                                                  (8, 4, [9, 1, 1, 1, 1, 2, 1])])
def test_decoding_with_released_blocks_equals_the_masked_reference(models, tokens_per_block, window, sink, chunks):
    """A sequence computed in chunks (1 = a generation step); after each step the blocks no later
    query can see are released (entry -1) and handed to another sequence that fills them with NaN."""
    path, model = models["llama"]
    tokens = random_tokens(sum(chunks), seed=tokens_per_block)
    reference = masked_reference(model, tokens, window, sink)
    tpb = tokens_per_block
    num_table_blocks = -(-len(tokens) // tpb)
    runner = ModelRunner(Engine.from_dir(path, tokens_per_block=tpb), num_table_blocks + 2,
                         max_attention_window=window, sink_token_length=sink)
    table = list(reversed(range(num_table_blocks)))
    past, num_released = 0, 0
    for n in chunks:
        out = runner.forward(step_inputs([(tokens[past:past + n], past, table)], context_logits=True))
        torch.testing.assert_close(out["context_logits"], reference[past:past + n], atol=ATOL, rtol=0,
                                   msg=f"chunk at {past}")
        past += n
        first = -(-sink // tpb)
        for j in range(first, (past - window + 1) // tpb):
            if table[j] >= 0:
                runner.kv_pool[:, :, table[j]] = float("nan")   # now another sequence's block
                table[j] = -1
                num_released += 1
    assert num_released > 0, "the sequence must outgrow its window for the test to mean anything"


def test_a_model_window_and_a_configured_window_use_the_smaller(models):
    path, model = models["mistral"]
    assert model.config.sliding_window == 8
    engine = Engine.from_dir(path, tokens_per_block=4)
    tokens = random_tokens(20, seed=3)
    inputs = step_inputs([(tokens, 0, list(range(5)))], context_logits=True)
    smaller = ModelRunner(engine, 5, max_attention_window=5, sink_token_length=2)
    assert (smaller.attention_window, smaller.sink_token_length) == (5, 2)
    torch.testing.assert_close(smaller.forward(inputs)["context_logits"], masked_reference(model, tokens, 5, 2),
                               atol=ATOL, rtol=0)
    larger = ModelRunner(engine, 5, max_attention_window=12)
    assert larger.attention_window == 8
    with torch.no_grad():
        own = model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(larger.forward(inputs)["context_logits"], own, atol=ATOL, rtol=0)


def test_effective_window_and_sinks_without_a_window():
    assert effective_window(None, None) is None
    assert effective_window(8, None) == 8
    assert effective_window(None, 5) == 5
    assert effective_window(8, 5) == 5 and effective_window(5, 8) == 5


def test_sinks_without_any_window_change_nothing(models):
    path, model = models["llama"]
    runner = ModelRunner(Engine.from_dir(path, tokens_per_block=4), 6, sink_token_length=4)
    assert (runner.attention_window, runner.sink_token_length) == (None, 0)


@pytest.mark.parametrize("table, ok", [
    ([0, -1, 2, 3, 4], True),     # keys 4..7: outside the window of queries from 16, not sinks
    ([0, -1, -1, 3, 4], False),   # keys 8..11: the query at 16 sees keys from 11 on (w = 6)
    ([-1, 1, 2, 3, 4], False),    # the sink block is read
    ([0, 1, 2, -1, 4], False),    # block of keys 12..15 is in the window
    ([0, 1, 2, 3, -1], False),    # the new token's block
])
def test_negative_entries_are_accepted_only_where_nothing_is_read(models, table, ok):
    path, _ = models["llama"]
    runner = ModelRunner(Engine.from_dir(path, tokens_per_block=4), 5, max_attention_window=6, sink_token_length=2)
    inputs = step_inputs([([5], 16, table)])
    if ok:
        runner.forward(inputs)
    else:
        with pytest.raises(ValueError, match="block_tables"):
            runner.forward(inputs)


@pytest.mark.parametrize("name, value", [("max_attention_window", 0), ("max_attention_window", 2.5),
                                         ("sink_token_length", -1)])
def test_bad_window_settings_are_refused(models, name, value):
    path, _ = models["llama"]
    with pytest.raises(ValueError, match=name):
        ModelRunner(Engine.from_dir(path, tokens_per_block=4), 4, **{name: value})


def test_gpt_session_generates_under_the_configured_window(models):
    """GptSession.Config.kv_cache_config's window and sinks: greedy tokens equal transformers'
    greedy continuation under the window/sink mask, step by step."""
    from types import SimpleNamespace

    from runtime import GenerationInput, GenerationOutput, GptSession, SamplingConfig, WorldConfig

    path, model = models["llama"]
    engine = Engine.from_dir(path, tokens_per_block=4)
    kv = SimpleNamespace(max_attention_window=6, sink_token_length=2)
    session = GptSession(GptSession.Config(1, 1, 64, kv_cache_config=kv), engine.model_config, WorldConfig(), engine)
    prompt = random_tokens(9, seed=11)
    out = GenerationOutput()
    session.generate(out, GenerationInput(-1, 0, torch.tensor([prompt], dtype=torch.int32), torch.tensor([9]),
                                          max_new_tokens=10), SamplingConfig())
    tokens = list(prompt)
    for _ in range(10):
        tokens.append(int(masked_reference(model, tokens, window=6, sink=2)[-1].argmax()))
    assert out.ids[0, 0, :19].tolist() == tokens
    unwindowed = list(prompt)
    for _ in range(10):
        unwindowed.append(int(masked_reference(model, unwindowed, window=1000, sink=0)[-1].argmax()))
    assert unwindowed != tokens, "the window should change this continuation"
