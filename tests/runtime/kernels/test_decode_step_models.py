"""The fused generation step on the LLaMA-family variants of Llama 3.x and Qwen3 files: Qwen3's
per-head RMSNorm of queries and keys before rotary, and the `llama3` rope scaling (a Hugging Face
config's rope_parameters, or a GGUF file's rope_freqs tensor). Each from a tiny random checkpoint
(Hugging Face and GGUF, float and kept quantized blocks): the fused step taken, logits, greedy
tokens and KV cache equal to the eager model's (test_decode_step.py's bounds), and greedy tokens
equal to transformers'."""
from __future__ import annotations

import pytest
import torch

from runtime import Engine, ModelRunner
from runtime.config import RopeConfig
from runtime.kernels.torch_kernels.block_linear import BlockLinear, block_ops
from runtime.models.rope import rope_inv_freq
from tests import factories
from tests.runtime import arch_factories
from tests.runtime.kernels.test_decode_step import assert_fused_equals_eager, assert_runs_equal, skip_without_kernels

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from tests.runtime.gguf_factories import Q, llama3_rope_freqs, write_gguf  # noqa: E402 (needs gguf)
from tests.runtime.test_model_parity import ATOL, ROPE_VARIANTS, hf_logits, random_tokens, run_prompt  # noqa: E402

MODES = ["fp32", "int8", "int4", "int8_act", "int8_kv", "bf16"]
GGUF_MODES = ["fp32", "int8", "int8_act"]
BLOCK_KINDS = (Q.Q8_0, Q.Q4_0)   # kept as blocks, run by the format table's kernels


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (checkpoint dir or GGUF file, the transformers model it was written from)."""
    out = {}
    directory = tmp_path_factory.mktemp("qwen3")
    qwen3 = arch_factories.make_checkpoint(directory / "hf", "qwen3", seed=11)
    out["qwen3"] = (directory / "hf", qwen3)
    out["qwen3_gguf"] = (write_gguf(directory / "m.gguf", "qwen3", qwen3), qwen3)
    for kind in BLOCK_KINDS:
        out[f"qwen3_{kind.name}"] = (write_gguf(directory / f"{kind.name}.gguf", "qwen3", qwen3, kind), qwen3)
    directory = tmp_path_factory.mktemp("llama3")
    llama3 = factories.make_checkpoint(directory / "hf", "llama", seed=12, **ROPE_VARIANTS["llama3"])
    out["llama3"] = (directory / "hf", llama3)
    rope_freqs = {"rope_freqs.weight": llama3_rope_freqs(llama3.config)}
    out["llama3_gguf"] = (write_gguf(directory / "m.gguf", "llama", llama3, extra=rope_freqs), llama3)
    for kind in BLOCK_KINDS:
        out[f"llama3_{kind.name}"] = (write_gguf(directory / f"{kind.name}.gguf", "llama", llama3, kind,
                                                 extra=rope_freqs), llama3)
    return out


def test_the_variants_are_what_the_fused_step_must_follow(models):
    """Guards the tests below: the Qwen3 model has q / k norm weights that are not all ones, and the
    llama3 frequencies differ from the unscaled ones (so a fused step ignoring either differs)."""
    engine = Engine.from_dir(models["qwen3"][0])
    assert engine.model_config.qk_norm
    for name in ("layers.0.q_norm.weight", "layers.1.k_norm.weight"):
        assert (engine.weights[name] - 1).abs().max() > 0.05, name
    for name in ("llama3", "llama3_gguf"):
        config = Engine.from_dir(models[name][0]).model_config
        unscaled = rope_inv_freq(RopeConfig(theta=config.rope.theta), config.rotary_dim)
        assert (unscaled / rope_inv_freq(config.rope, config.rotary_dim)).max() > 7.9, name


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_fused_step_equals_the_eager_model(models, name, mode):
    skip_without_kernels()
    assert_fused_equals_eager(models[name][0], mode)


@pytest.mark.parametrize("mode", GGUF_MODES)
@pytest.mark.parametrize("name", ["qwen3_gguf", "llama3_gguf"])
def test_fused_step_equals_the_eager_model_from_gguf(models, name, mode):
    skip_without_kernels()
    assert_fused_equals_eager(models[name][0], mode)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_gguf", "llama3"])
def test_fused_logits_and_greedy_tokens_match_transformers(models, name):
    """(The llama3 GGUF file: tests/runtime/test_gguf_llama3.py.)"""
    skip_without_kernels()
    checkpoint, model = models[name]
    runner = ModelRunner(Engine.from_dir(checkpoint, tokens_per_block=16), num_blocks=8)
    assert runner.decode_step is not None
    tokens = random_tokens(40, seed=5)
    reference = hf_logits(model, tokens)
    run_prompt(runner, tokens[:-1], [0, 1, 2])
    logits = runner.forward(factories.step_inputs([(tokens[-1:], 39, [0, 1, 2])]))["logits"]
    torch.testing.assert_close(logits[0], reference[-1], atol=ATOL, rtol=0)
    prompt = tokens[:12]
    generated = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, 12:].tolist()
    ours, logits = [], run_prompt(runner, prompt, [4, 5])[-1]
    for step in range(12):
        ours.append(int(logits.argmax()))
        logits = runner.forward(factories.step_inputs([(ours[-1:], len(prompt) + step, [4, 5])]))["logits"][0]
    assert ours == generated


@pytest.mark.parametrize("kind", BLOCK_KINDS, ids=lambda kind: kind.name)
@pytest.mark.parametrize("variant", ["qwen3", "llama3"])
def test_fused_step_equals_the_eager_model_on_kept_blocks(models, variant, kind):
    skip_without_kernels()
    if block_ops() is None:
        pytest.skip("the native block kernels do not run here")
    engine = Engine.from_dir(models[f"{variant}_{kind.name}"][0], weight_format="keep", tokens_per_block=4)
    fused, eager = ModelRunner(engine, 64), ModelRunner(engine, 64, fused_decode=False)
    assert fused.decode_step is not None and engine.model_config.qk_norm == (variant == "qwen3")
    assert all(isinstance(linear, BlockLinear) for linear in fused.model.linears.values())
    assert_runs_equal(fused, eager)
