"""Token ids and word-list entries outside the vocabulary are refused by the runtime's own entry
points (ModelRunner.forward, GptSession.generate) before any embedding lookup or kernel runs,
whoever calls them (the manager validates them at admission as well)."""
from __future__ import annotations

import pytest
import torch

from runtime import Engine, GenerationInput, GenerationOutput, GptSession, ModelRunner, SamplingConfig, WorldConfig
from tests.factories import TINY, make_checkpoint, step_inputs

VOCAB = TINY["vocab_size"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("token_ids")
    make_checkpoint(root, "llama")
    return Engine.from_dir(root)


@pytest.mark.parametrize("bad", [VOCAB, -1, 1 << 31])
def test_model_runner_refuses_out_of_vocab_ids_before_the_forward(engine, bad, monkeypatch):
    runner = ModelRunner(engine, num_blocks=4)
    reached = []
    monkeypatch.setattr(runner.model, "forward", lambda *a, **k: reached.append(1), raising=False)
    inputs = step_inputs([([3, 4, 5], 0, [0])])
    inputs["input_ids"] = torch.tensor([3, 4, bad], dtype=torch.int64)   # the embedding lookup would index it
    with pytest.raises(ValueError, match="input_ids"):
        runner.forward(inputs)
    assert not reached


def session(engine) -> GptSession:
    return GptSession(GptSession.Config(max_batch_size=2, max_beam_width=2, max_sequence_length=64),
                      engine.model_config, WorldConfig(), engine)


def generation_input(ids: list[int], **kwargs) -> GenerationInput:
    inp = GenerationInput(-1, 0, torch.tensor([ids], dtype=torch.int32), torch.tensor([len(ids)], dtype=torch.int32),
                          **kwargs)
    inp.max_new_tokens = 4
    return inp


@pytest.mark.parametrize("ids", [[3, VOCAB], [-2, 3]])
def test_gpt_session_refuses_out_of_vocab_prompt_ids(engine, ids):
    with pytest.raises(ValueError, match="GenerationInput.ids"):
        session(engine).generate(GenerationOutput(), generation_input(ids), SamplingConfig())


@pytest.mark.parametrize("name", ["bad_words_list", "stop_words_list"])
@pytest.mark.parametrize("token", [VOCAB, -5])
def test_gpt_session_refuses_out_of_vocab_word_list_entries(engine, name, token):
    words = torch.tensor([[3, token], [2, -1]], dtype=torch.int32)   # one word of two tokens
    with pytest.raises(ValueError, match=name):
        session(engine).generate(GenerationOutput(), generation_input([3, 4], **{name: words}), SamplingConfig())
