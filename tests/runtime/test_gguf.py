"""GGUF checkpoints (runtime.loading.gguf_file, gguf_archs, gguf_checkpoint): tiny files written as llama.cpp
writes them load with their source checkpoint's config and weights exactly, and with transformers'
GGUF loading's (weights, logits, greedy tokens); every tensor type de-quantizes as gguf.quants does;
tensor-parallel ranks get their slices; hostile files are ValueErrors naming the field or tensor."""
from __future__ import annotations

import dataclasses
import os

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from runtime import (ConfigError, Engine, GenerationInput, GenerationOutput, GptSession, ModelRunner, SamplingConfig,
                     WeightError, WorldConfig)
from runtime.loading.gguf_file import GgufFile
from runtime.parallel.tensor_shard import TensorShard
from tests import factories
from tests.runtime import arch_factories
from tests.runtime.gguf_factories import Q, k_quant_blocks, random_blocks, state_dict_copy, write_gguf, write_tensors

transformers = pytest.importorskip("transformers")
NUM_NEW_TOKENS = 8


def make_model(case: str, seed: int = 0, **overrides):
    if case in ("llama", "qwen2", "gpt2", "mistral"):
        return factories.hf_model(case, seed, **overrides)
    return arch_factories.hf_model(case, seed, **overrides)


def assert_same_weights(a: Engine, b: Engine) -> None:
    assert a.weights.keys() == b.weights.keys()
    for name in a.weights:
        assert torch.equal(a.weights[name], b.weights[name]), name


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- the source checkpoint, exactly --------------------------------------------------------------

# case -> (llama.cpp family, model factory case, overrides)
SOURCE_CASES = {
    "llama": ("llama", "llama", {}),
    "llama_tied_biased": ("llama", "llama", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "qwen2": ("qwen2", "qwen2", {}),
    "qwen3": ("qwen3", "qwen3", {}),
    "gpt2": ("gpt2", "gpt2", {}),
    "gpt_neox": ("gpt_neox", "gpt_neox", {}),
    "gpt_neox_sequential": ("gpt_neox", "gpt_neox_sequential", {}),
    "falcon_7b": ("falcon", "falcon_7b", {}),
    "falcon_new_decoder": ("falcon", "falcon_new_decoder", {}),
    "falcon_new_decoder_one_norm": ("falcon", "falcon_new_decoder_one_norm", {}),
    "phi": ("phi", "phi", {}),
    "phi3": ("phi3", "phi3", {}),
    "bloom": ("bloom", "bloom", {}),
    "bloom_6_heads": ("bloom", "bloom_6_heads", {}),
    "gptj": ("gptj", "gptj", {}),
}


@pytest.mark.parametrize("case", SOURCE_CASES)
def test_loads_its_source_checkpoints_config_and_weights(tmp_path, case):
    family, factory_case, overrides = SOURCE_CASES[case]
    model = make_model(factory_case, seed=len(case), **overrides)
    model.save_pretrained(tmp_path / "hf")
    source = Engine.from_dir(tmp_path / "hf")
    loaded = Engine.from_dir(write_gguf(tmp_path / "m.gguf", family, model))
    # GGUF stores the norm epsilon as a float32.
    assert loaded.model_config == dataclasses.replace(source.model_config,
                                                      norm_eps=float(np.float32(source.model_config.norm_eps)))
    assert_same_weights(loaded, source)
    assert loaded.num_bytes_read == sum(4 * t.numel() for t in loaded.weights.values())


# -- transformers' GGUF loading of the same file -------------------------------------------------

def transformers_engine(model, directory) -> Engine:
    """The canonical weights of a transformers model, through our HF checkpoint reader."""
    os.makedirs(directory)
    save_file(state_dict_copy(model), os.path.join(directory, "model.safetensors"))
    model.config.to_json_file(os.path.join(directory, "config.json"))
    return Engine.from_dir(directory)


def assert_matches_transformers(tmp_path, family: str, model, matmul_type=Q.F32, unmapped=()) -> None:
    """Weights exactly, config (but the `unmapped` fields transformers does not read from a GGUF),
    context logits and greedy tokens of ours and of transformers' GGUF loading."""
    # de-quantized, as transformers loads it (kept blocks: tests/runtime/test_gguf_blocks.py)
    ours = Engine.from_dir(write_gguf(tmp_path / "m.gguf", family, model, matmul_type), tokens_per_block=8,
                           weight_format="dequantize")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf",
                                                                  attn_implementation="eager").eval()
    theirs = transformers_engine(reference, tmp_path / "hf")
    ignore = {field: getattr(ours.model_config, field) for field in unmapped}
    assert ours.model_config == dataclasses.replace(theirs.model_config, **ignore)
    assert_same_weights(ours, theirs)
    prompt = random_tokens(12, seed=1)
    logits = ModelRunner(ours, 4).forward(factories.step_inputs([(prompt, 0, [0, 1])], context_logits=True))
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits["context_logits"], expected, atol=1e-4, rtol=1e-4)
    session = GptSession(GptSession.Config(max_batch_size=1, max_beam_width=1, max_sequence_length=32),
                         ours.model_config, WorldConfig(), ours)
    output = GenerationOutput()
    session.generate(output, GenerationInput(end_id=-1, pad_id=0, ids=torch.tensor([prompt], dtype=torch.int32),
                                             lengths=torch.tensor([12], dtype=torch.int32),
                                             max_new_tokens=NUM_NEW_TOKENS), SamplingConfig())
    greedy = reference.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0].tolist()
    assert output.ids[0, 0].tolist() == greedy


# case -> (family, factory case, overrides, fields transformers does not map from a GGUF); the sizes
# are those transformers' GGUF mappings can express (GPT-2: n_ctx 1024 and a 4 h MLP; Falcon: 4 h).
TRANSFORMERS_CASES = {
    "llama": ("llama", "llama", {}, ()),
    "qwen2": ("qwen2", "qwen2", {}, ()),
    # transformers reads no head_dim from a Qwen3 file (its default, 128, is real Qwen3's)
    "qwen3": ("qwen3", "qwen3", dict(head_dim=128), ()),
    "gpt2": ("gpt2", "gpt2", dict(n_inner=None, n_positions=1024), ()),
    "falcon_7b": ("falcon", "falcon_7b", dict(ffn_hidden_size=256), ("norm_eps",)),
    "phi3": ("phi3", "phi3", dict(partial_rotary_factor=1.0, sliding_window=None), ()),
    "bloom": ("bloom", "bloom", {}, ()),
}


@pytest.mark.parametrize("case", TRANSFORMERS_CASES)
def test_matches_transformers_gguf_loading(tmp_path, case):
    family, factory_case, overrides, unmapped = TRANSFORMERS_CASES[case]
    assert_matches_transformers(tmp_path, family, make_model(factory_case, seed=3, **overrides), unmapped=unmapped)


@pytest.mark.parametrize("kind", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda k: k.name)
def test_quantized_llama_matches_transformers(tmp_path, kind):
    assert_matches_transformers(tmp_path, "llama", make_model("llama", seed=4), kind)


def test_k_quant_llama_matches_transformers(tmp_path):
    """Q2_K to Q6_K (256-element blocks: a model 256 wide), from random blocks (gguf cannot quantize them)."""
    kinds = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]

    def stored(name: str, w: np.ndarray):
        kind = kinds[sum(map(ord, name)) % len(kinds)]
        return k_quant_blocks(kind, w.shape[0], w.shape[1], seed=sum(map(ord, name))), kind

    model = make_model("llama", seed=5, hidden_size=256, intermediate_size=256, num_hidden_layers=1)
    assert_matches_transformers(tmp_path, "llama", model, stored)


# -- every tensor type ---------------------------------------------------------------------------

def dequantizable_types() -> list[Q]:
    out = []
    for kind in Q:
        block_size = gguf.GGML_QUANT_SIZES[kind][0]
        try:
            with np.errstate(all="ignore"):
                gguf.quants.dequantize(random_blocks(kind, 1, max(256, block_size)), kind)
        except NotImplementedError:
            continue
        out.append(kind)
    return out


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_every_tensor_type_dequantizes_as_gguf_does(tmp_path):
    kinds = dequantizable_types()
    assert {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
            Q.Q6_K} <= set(kinds)
    blocks = {kind: random_blocks(kind, 3, 512, seed=int(kind)) for kind in kinds}   # NaN and inf included
    stored = {f"t.{kind.name}": (data, kind) for kind, data in blocks.items()}
    file = GgufFile(write_tensors(tmp_path / "types.gguf", stored))
    for kind, data in blocks.items():
        expected = gguf.quants.dequantize(data, kind).astype(np.float32)
        got = file.read(f"t.{kind.name}")
        assert got.dtype == torch.float32 and got.shape == (3, 512), kind.name
        assert np.array_equal(got.numpy(), expected, equal_nan=True), kind.name
        torch.testing.assert_close(file.read(f"t.{kind.name}", torch.bfloat16), got.to(torch.bfloat16), atol=0,
                                   rtol=0, equal_nan=True)


@pytest.mark.parametrize("kind", [Q.I8, Q.I32, Q.F64], ids=lambda k: k.name)
def test_a_type_without_floats_names_the_tensor(tmp_path, kind):
    values = np.zeros((2, 32), dtype={Q.I8: np.int8, Q.I32: np.int32, Q.F64: np.float64}[kind])
    file = GgufFile(write_tensors(tmp_path / "ints.gguf", {"blk.0.x.weight": (values, None)}))
    with pytest.raises(WeightError, match=r"'blk\.0\.x\.weight'.*" + kind.name):
        file.read("blk.0.x.weight")


# -- tensor parallelism, paths -------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    """A tiny GQA LLaMA as an F32 GGUF file (2 layers, vocab 128)."""
    return write_gguf(tmp_path_factory.mktemp("gguf") / "llama.gguf", "llama", make_model("llama", seed=6))


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_loads_its_slices(llama_gguf, size):
    whole = Engine.from_dir(llama_gguf)
    for rank in range(size):
        shard = TensorShard.of(whole.model_config, rank, size)
        ranked = Engine.from_dir(llama_gguf, shard=(rank, size))
        assert ranked.shard == shard
        for name, tensor in whole.weights.items():
            assert torch.equal(ranked.weights[name], shard.slice(name, tensor)), (rank, name)


def test_a_directory_holding_one_gguf_loads_and_two_are_refused(llama_gguf, tmp_path):
    os.symlink(llama_gguf, tmp_path / "model.gguf")
    assert_same_weights(Engine.from_dir(tmp_path), Engine.from_dir(llama_gguf))
    os.symlink(llama_gguf, tmp_path / "other.gguf")
    with pytest.raises(ConfigError, match="model.gguf, other.gguf"):
        Engine.from_dir(tmp_path)
    with pytest.raises(ConfigError, match="not a directory or a .gguf file"):
        Engine.from_dir(tmp_path / "missing.gguf")


def test_build_dtype_and_the_mistral_label(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama", make_model("llama", seed=7), name="Mistral-7B-Instruct")
    engine = Engine.from_dir(path, dtype="bfloat16")
    assert engine.model_config.architecture == "mistral"
    whole = Engine.from_dir(path)
    assert all(t.dtype == torch.bfloat16 for t in engine.weights.values())
    assert all(torch.equal(engine.weights[n], whole.weights[n].to(torch.bfloat16)) for n in whole.weights)
