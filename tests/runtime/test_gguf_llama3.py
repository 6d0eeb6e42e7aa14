"""LLaMA 3.x GGUF files: llama.cpp's converter writes the `llama3` rope scaling as a `rope_freqs`
tensor (one divisor per rotated pair). Ours reads it into the rotary frequencies: the same
frequencies, logits and greedy tokens as the Hugging Face checkpoint the file was made from, in the
eager path and the fused step; a bad tensor is refused by name."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from runtime import ConfigError, Engine, ModelRunner
from runtime.models.rope import rope_inv_freq
from tests import factories
from tests.runtime.gguf_factories import llama3_rope_freqs, write_gguf
from tests.runtime.test_model_parity import ATOL, ROPE_VARIANTS, hf_logits, random_tokens, run_prompt

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """(GGUF path, HF checkpoint dir, transformers model) of one tiny LLaMA with llama3 rope scaling."""
    directory = tmp_path_factory.mktemp("llama3")
    model = factories.make_checkpoint(directory / "hf", "llama", seed=2, **ROPE_VARIANTS["llama3"])
    path = write_gguf(directory / "m.gguf", "llama", model, extra={"rope_freqs.weight": llama3_rope_freqs(model.config)})
    return path, directory / "hf", model


def test_rope_freqs_become_the_checkpoints_frequencies(llama3):
    path, hf_dir, _ = llama3
    ours, source = Engine.from_dir(path).model_config, Engine.from_dir(hf_dir).model_config
    assert ours.rope.scaling_type == "freq_factors" and source.rope.scaling_type == "llama3"
    # the three llama3 bands: unscaled, smoothed, divided by the factor
    assert ours.rope.freq_factors[0] == 1.0 and ours.rope.freq_factors[-1] == 8.0
    assert any(1.0 < f < 8.0 for f in ours.rope.freq_factors)
    torch.testing.assert_close(rope_inv_freq(ours.rope, ours.rotary_dim), rope_inv_freq(source.rope, source.rotary_dim),
                               atol=0, rtol=1e-6)
    assert dataclasses.replace(ours, rope=source.rope, norm_eps=source.norm_eps) == source


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_logits_and_greedy_tokens_match_transformers(llama3, fused):
    path, _, model = llama3
    runner = ModelRunner(Engine.from_dir(path, tokens_per_block=16), num_blocks=8, fused_decode=fused)
    tokens = random_tokens(60, seed=3)
    reference = hf_logits(model, tokens)
    torch.testing.assert_close(run_prompt(runner, tokens[:-1], [0, 1, 2, 3]), reference[:-1], atol=ATOL, rtol=0)
    # one generation step at position 59 (the fused step where `fused`) rotates as transformers does
    logits = runner.forward(factories.step_inputs([(tokens[-1:], 59, [0, 1, 2, 3])]))["logits"]
    torch.testing.assert_close(logits[0], reference[-1], atol=ATOL, rtol=0)
    assert (runner.decode_step is not None) == fused
    prompt = tokens[:20]
    generated = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, 20:].tolist()
    ours, logits = [], run_prompt(runner, prompt, [4, 5, 6, 7])[-1]
    for step in range(8):
        ours.append(int(logits.argmax()))
        logits = runner.forward(factories.step_inputs([(ours[-1:], len(prompt) + step, [4, 5, 6, 7])]))["logits"][0]
    assert ours == generated


@pytest.mark.parametrize("values, message", [
    (np.full(8, np.nan, dtype=np.float32), "finite number > 0"),
    (np.zeros(8, dtype=np.float32), "finite number > 0"),
    (np.ones(5, dtype=np.float32), "5 factors for 8 rotated pairs"),
])
def test_a_bad_rope_freqs_tensor_is_refused_by_name(tmp_path, values, message):
    model = factories.hf_model("llama", seed=2, **ROPE_VARIANTS["llama3"])
    path = write_gguf(tmp_path / "m.gguf", "llama", model, extra={"rope_freqs.weight": values})
    with pytest.raises(ConfigError, match=message) as error:
        Engine.from_dir(path)
    assert "rope" in str(error.value)
