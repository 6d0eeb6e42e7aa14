"""The architecture registry (runtime/models): every entry maps its tiny HF config and loads its
checkpoint; unknown architectures are clear errors; engine.json files written before the variant
fields existed load with their architecture's values; a new entry needs no change to shared code."""
from __future__ import annotations

import ast
import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime import ConfigError, Engine, ModelConfig, ModelRunner, SUPPORTED_ARCHITECTURES, build_engine
from runtime.config import RopeConfig
from runtime.models import (Architecture, lookup, lookup_hf, model_config_from_dict, model_config_from_hf, register,
                            supported_architectures, unregister)
from runtime.loading.weights import TensorSource, Weights, expected_shapes, fused
from tests.factories import make_checkpoint, step_inputs

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
SHARED_MODULES = ("config.py", "loading/weights.py", "models/transformer.py", "models/rope.py", "models/alibi.py",
                  "quantization/stored.py", "kernels/torch_kernels/linear.py", "kernels/torch_kernels/weight_only_linear.py", "engine.py",
                  "model_runner.py", "session.py")
# The entries whose tiny checkpoints tests.factories makes (the first release's architectures); the
# later ones have theirs in tests/runtime/arch_factories.py and their own tests (test_more_architectures.py).
FACTORY_ARCHS = ("gpt2", "llama", "mistral", "qwen2")

# ModelConfig as engine.json recorded it before the registry (format version 1, first release).
V1_MODEL_FIELDS = {"architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                   "head_dim", "intermediate_size", "max_position_embeddings", "norm_type", "norm_eps",
                   "mlp_type", "activation", "position_embedding", "rope", "qkv_bias", "out_bias", "mlp_bias",
                   "tie_word_embeddings", "sliding_window", "bos_token_id", "eos_token_id", "pad_token_id"}

ROTARY = dict(position_embedding="rope", rotary_style="neox", rotary_fraction=1.0, norm_type="rmsnorm",
              mlp_type="gated", residual="sequential", qkv_bias=False, out_bias=False, mlp_bias=False,
              rope=RopeConfig(theta=10000.0))
# arch -> the ModelConfig fields its tiny factory config maps to (beyond the shared TINY sizes).
EXPECTED = {
    "gpt2": dict(position_embedding="learned", rope=None, rotary_style=None, rotary_fraction=None,
                 norm_type="layernorm", mlp_type="gelu", residual="sequential", activation="gelu_new",
                 qkv_bias=True, out_bias=True, mlp_bias=True, num_kv_heads=4, tie_word_embeddings=True,
                 sliding_window=None, norm_eps=1e-5),
    "llama": dict(ROTARY, activation="silu", num_kv_heads=2, tie_word_embeddings=False, sliding_window=None),
    "mistral": dict(ROTARY, activation="silu", num_kv_heads=2, tie_word_embeddings=False, sliding_window=8),
    "qwen2": dict(ROTARY, activation="silu", qkv_bias=True, num_kv_heads=1, tie_word_embeddings=True,
                  sliding_window=None),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> tiny factory checkpoint dir, for every registered architecture."""
    paths = {}
    for seed, arch in enumerate(FACTORY_ARCHS):
        paths[arch] = tmp_path_factory.mktemp(arch)
        make_checkpoint(paths[arch], arch, seed=seed)
    return paths


def context_logits(engine: Engine) -> torch.Tensor:
    """float32 [20, V]: the logits of one fresh 20-token prompt."""
    tokens = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    num_blocks = -(-len(tokens) // engine.build_config.tokens_per_block)
    runner = ModelRunner(engine, num_blocks)
    inputs = step_inputs([(tokens, 0, list(range(num_blocks)))], context_logits=True)
    return runner.forward(inputs)["context_logits"]


def hf_config(directory) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


def test_builtin_entries_are_the_supported_architectures():
    assert SUPPORTED_ARCHITECTURES == ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gptj", "gpt_neox", "bloom", "falcon",
                                       "phi", "phi3") == supported_architectures()
    assert set(EXPECTED) == set(FACTORY_ARCHS)
    from tests.runtime.arch_factories import hf_config
    from tests.runtime.test_more_architectures import EXPECTED as MORE_EXPECTED
    covered = {fields["architecture"] for fields in MORE_EXPECTED.values()}
    assert covered | set(FACTORY_ARCHS) == set(SUPPORTED_ARCHITECTURES)
    assert {hf_config(case).model_type for case in MORE_EXPECTED} == covered


@pytest.mark.parametrize("arch", FACTORY_ARCHS)
def test_entry_maps_its_config_and_loads_its_checkpoint(checkpoints, arch):
    hf = hf_config(checkpoints[arch])
    entry = lookup_hf(hf)
    assert entry is lookup(arch) and entry.name == arch
    cfg = model_config_from_hf(hf)
    assert cfg.architecture == arch
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.max_position_embeddings) == (128, 64, 2, 4, 16, 96, 256)
    assert {name: getattr(cfg, name) for name in EXPECTED[arch]} == EXPECTED[arch]
    assert {name: getattr(cfg, name) for name in entry.variant} == dict(entry.variant)

    engine = Engine.from_dir(checkpoints[arch])
    assert engine.model_config == cfg
    assert {name: tuple(t.shape) for name, t in engine.weights.items()} == expected_shapes(cfg)
    tensors = load_file(os.path.join(checkpoints[arch], "model.safetensors"))
    embed = tensors["transformer.wte.weight" if arch == "gpt2" else "model.embed_tokens.weight"]
    assert torch.equal(engine.weights["embed_tokens"], embed)


def test_lookup_by_hf_class_name_when_model_type_is_absent(checkpoints):
    hf = hf_config(checkpoints["qwen2"])
    del hf["model_type"]
    assert hf["architectures"] == ["Qwen2ForCausalLM"]
    assert lookup_hf(hf) is lookup("qwen2")


def test_unknown_architecture_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match=r"model_type='mamba'.*\['MambaForCausalLM'\].*"
                                          r"supported: gpt2, llama, mistral, qwen2, qwen3, gptj, gpt_neox, bloom, falcon, "
                                          r"phi, phi3"):
        model_config_from_hf({"model_type": "mamba", "architectures": ["MambaForCausalLM"]})
    with pytest.raises(ConfigError, match="architecture: unsupported 'mamba'; supported: gpt2, llama"):
        lookup("mamba")
    with pytest.raises(ConfigError, match="architecture: unsupported None"):
        model_config_from_dict({"vocab_size": 8})


def test_register_refuses_a_taken_name_or_class_name():
    with pytest.raises(ValueError, match="name: architecture 'llama' is already registered"):
        register(lookup("llama"))
    with pytest.raises(ValueError, match=r"hf_class_names: \['LlamaForCausalLM'\] already read by 'llama'"):
        register(dataclasses.replace(lookup("llama"), name="llama_copy"))
    with pytest.raises(ValueError, match="name: architecture 'mamba' is not registered"):
        unregister("mamba")
    assert supported_architectures() == SUPPORTED_ARCHITECTURES


# --- engine.json written before the variant fields ---------------------------------------------

@pytest.mark.parametrize("arch", FACTORY_ARCHS)  # the architectures engine.json files of that release can hold
def test_engine_json_without_variant_fields_takes_the_architecture_values(checkpoints, tmp_path, arch):
    built = build_engine(checkpoints[arch], tmp_path, max_seq_len=64, tokens_per_block=16)
    data = json.loads((tmp_path / "engine.json").read_text())
    data["model"] = {name: value for name, value in data["model"].items() if name in V1_MODEL_FIELDS}
    assert set(data["model"]) == V1_MODEL_FIELDS
    (tmp_path / "engine.json").write_text(json.dumps(data))
    loaded = Engine.from_dir(tmp_path)
    assert loaded.model_config == built.model_config
    assert loaded.model_config.to_dict() == model_config_from_dict(built.model_config.to_dict()).to_dict()
    torch.testing.assert_close(context_logits(loaded), context_logits(built), atol=0, rtol=0)


@pytest.mark.parametrize("field,value,message", [
    ("residual", "post_norm", "residual: unsupported 'post_norm'; supported: 'sequential', 'parallel', "
                              "'parallel_shared_norm'"),
    ("rotary_style", "gptj", "rotary_style: unsupported 'gptj'"),
    ("rotary_fraction", 0.1, r"rotary_fraction: must be in \(0, 1\] and rotate an even number .* got 0.1"),
    ("rotary_fraction", 1.5, r"rotary_fraction: must be in \(0, 1\]"),
    ("position_embedding", "alibi", "rope: must be set exactly when position_embedding is 'rope'"),
    ("norm_type", "batchnorm", "norm_type: unsupported 'batchnorm'"),
    ("rotary_style", None, "rotary_style: must be set exactly when position_embedding is 'rope'"),
    ("position_embedding", "learned", "rope: must be set exactly when position_embedding is 'rope'"),
])
def test_variants_the_model_does_not_implement_are_refused(checkpoints, field, value, message):
    cfg = Engine.from_dir(checkpoints["llama"]).model_config
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(cfg, **{field: value}).validated()


# --- a new architecture is one new module --------------------------------------------------------

TOY_VARIANT = dict(position_embedding="rope", rotary_style="neox", rotary_fraction=1.0, norm_type="rmsnorm",
                   mlp_type="gated", residual="sequential")
# toy tensor name -> llama tensor name ({i}: layer); the toy keeps q/k/v and gate/up apart.
TOY_TO_LLAMA = {"tok.w": "model.embed_tokens.weight", "norm_f.w": "model.norm.weight", "head.w": "lm_head.weight"}
TOY_LAYER_TO_LLAMA = {"ln1.w": "input_layernorm.weight", "ln2.w": "post_attention_layernorm.weight",
                      "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
                      "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
                      "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight"}


def toy_config_from_hf(hf: dict) -> ModelConfig:
    return ModelConfig(
        architecture="toy", vocab_size=hf["vocab"], hidden_size=hf["d_model"], num_layers=hf["n_layers"],
        num_heads=hf["n_heads"], num_kv_heads=hf["n_kv_heads"], head_dim=hf["d_model"] // hf["n_heads"],
        intermediate_size=hf["d_ff"], max_position_embeddings=hf["max_len"], norm_eps=hf["eps"],
        activation="silu", rope=RopeConfig(theta=hf["theta"]), qkv_bias=False, out_bias=False, mlp_bias=False,
        tie_word_embeddings=False, sliding_window=None, **TOY_VARIANT).validated()


def toy_read_weights(src: TensorSource, cfg: ModelConfig) -> Weights:
    h, i = cfg.hidden_size, cfg.intermediate_size
    w = {"embed_tokens": src.get("tok.w"), "final_norm.weight": src.get("norm_f.w"), "lm_head": src.get("head.w")}
    for layer in range(cfg.num_layers):
        p, q = f"blocks.{layer}.", f"layers.{layer}."
        w[q + "input_norm.weight"], w[q + "post_norm.weight"] = src.get(p + "ln1.w"), src.get(p + "ln2.w")
        w[q + "qkv.weight"] = fused(src, {p + "wq": (cfg.q_size, h), p + "wk": (cfg.kv_size, h),
                                          p + "wv": (cfg.kv_size, h)})
        w[q + "out.weight"] = src.get(p + "wo")
        w[q + "mlp_in.weight"] = fused(src, {p + "w_gate": (i, h), p + "w_up": (i, h)})
        w[q + "mlp_out.weight"] = src.get(p + "w_down")
    return w


@pytest.fixture
def toy_arch():
    entry = register(Architecture(name="toy", hf_class_names=("ToyForCausalLM",), variant=TOY_VARIANT,
                                  config_from_hf=toy_config_from_hf, read_weights=toy_read_weights))
    yield entry
    unregister("toy")


def write_toy_checkpoint(llama_dir, directory: Path) -> None:
    """The llama checkpoint's weights under the toy's own config keys and tensor names."""
    llama = hf_config(llama_dir)
    directory.mkdir()
    config = dict(model_type="toy", architectures=["ToyForCausalLM"], vocab=llama["vocab_size"],
                  d_model=llama["hidden_size"], n_layers=llama["num_hidden_layers"],
                  n_heads=llama["num_attention_heads"], n_kv_heads=llama["num_key_value_heads"],
                  d_ff=llama["intermediate_size"], max_len=llama["max_position_embeddings"],
                  eps=llama["rms_norm_eps"], theta=llama.get("rope_theta", 10000.0))
    (directory / "config.json").write_text(json.dumps(config))
    tensors = load_file(os.path.join(llama_dir, "model.safetensors"))
    renamed = {toy: tensors[name] for toy, name in TOY_TO_LLAMA.items()}
    for layer in range(config["n_layers"]):
        renamed.update({f"blocks.{layer}.{toy}": tensors[f"model.layers.{layer}.{name}"]
                        for toy, name in TOY_LAYER_TO_LLAMA.items()})
    assert len(renamed) == len(tensors)
    save_file(renamed, os.fspath(directory / "model.safetensors"))


def test_a_registered_entry_loads_its_checkpoint_without_shared_code_changes(checkpoints, tmp_path, toy_arch):
    write_toy_checkpoint(checkpoints["llama"], tmp_path / "toy")
    toy, llama = Engine.from_dir(tmp_path / "toy"), Engine.from_dir(checkpoints["llama"])
    assert toy.model_config == dataclasses.replace(llama.model_config, architecture="toy", bos_token_id=None,
                                                   eos_token_id=None, pad_token_id=None)
    torch.testing.assert_close(context_logits(toy), context_logits(llama), atol=0, rtol=0)

    built = build_engine(tmp_path / "toy", tmp_path / "engine", max_seq_len=64)
    assert Engine.from_dir(tmp_path / "engine").model_config == built.model_config
    unregister("toy")
    try:
        for directory in ("toy", "engine"):
            with pytest.raises(ConfigError, match="'toy'"):
                Engine.from_dir(tmp_path / directory)
    finally:
        register(toy_arch)


@pytest.mark.parametrize("module", SHARED_MODULES)
def test_shared_code_never_names_an_architecture(module):
    tree = ast.parse((RUNTIME / module).read_text())
    literals = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)}
    assert not literals & set(SUPPORTED_ARCHITECTURES)
