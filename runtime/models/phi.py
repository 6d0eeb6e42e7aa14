"""Phi (phi-1, phi-1.5, phi-2): a parallel residual sharing one LayerNorm, partial rotary
(`partial_rotary_factor`) over half-split pairs, biases everywhere, an lm_head with a bias.
Phi-3 (`phi3`) is the LLaMA block with fused qkv_proj / gate_up_proj tensors and optional partial
rotary: it reuses llama.py's mapping."""
from __future__ import annotations

from types import MappingProxyType
from typing import Any

from ..config import ConfigError, ModelConfig
from ..loading.weights import RawWeights, TensorSource, fused, renamed
from . import llama
from .base import Architecture, positive_int, rope_from_hf, rotary_fraction_from_hf, token_ids

VARIANT = MappingProxyType(dict(position_embedding="rope", rotary_style="neox", norm_type="layernorm",
                                mlp_type="gelu", residual="parallel_shared_norm", qkv_bias=True, out_bias=True,
                                mlp_bias=True, embedding_norm=False, lm_head_bias=True, sliding_window=None))
PHI3_VARIANT = MappingProxyType({name: value for name, value in llama.VARIANT.items() if name != "rotary_fraction"})


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    if hf.get("qk_layernorm"):
        raise ConfigError("config.json: qk_layernorm=true is not supported")
    hidden = positive_int(hf, "hidden_size")
    heads = positive_int(hf, "num_attention_heads")
    return ModelConfig(
        architecture="phi", vocab_size=positive_int(hf, "vocab_size"), hidden_size=hidden,
        num_layers=positive_int(hf, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads), head_dim=hidden // heads,
        intermediate_size=positive_int(hf, "intermediate_size"),
        max_position_embeddings=positive_int(hf, "max_position_embeddings"),
        norm_eps=float(hf.get("layer_norm_eps", 1e-5)), activation=hf.get("hidden_act", "gelu_new"),
        rope=rope_from_hf(hf), rotary_fraction=rotary_fraction_from_hf(hf, default=0.5),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), **VARIANT, **token_ids(hf)).validated()


def read_weights(src: TensorSource, cfg: ModelConfig) -> RawWeights:
    get, h = src.get, cfg.hidden_size
    w: RawWeights = {"embed_tokens": get("model.embed_tokens.weight"), "lm_head.bias": get("lm_head.bias"),
                     **renamed(get, "", "model.", (("final_norm", "final_layernorm"),))}
    qkv_rows = {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size}
    for layer in range(cfg.num_layers):
        p, q = f"model.layers.{layer}.", f"layers.{layer}."
        w.update(renamed(get, q, p, (("input_norm", "input_layernorm"), ("out", "self_attn.dense"),
                                     ("mlp_in", "mlp.fc1"), ("mlp_out", "mlp.fc2"))))
        w[q + "qkv.weight"] = fused(src, {p + f"self_attn.{x}_proj.weight": (n, h) for x, n in qkv_rows.items()})
        w[q + "qkv.bias"] = fused(src, {p + f"self_attn.{x}_proj.bias": (n,) for x, n in qkv_rows.items()})
    if not cfg.tie_word_embeddings:
        w["lm_head"] = get("lm_head.weight")
    return w


def phi3_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    return llama.config_from_hf(hf, "phi3", rotary_fraction=rotary_fraction_from_hf(hf),
                                norm_eps=float(hf.get("rms_norm_eps", 1e-5)))


def phi3_read_weights(src: TensorSource, cfg: ModelConfig) -> RawWeights:
    get = src.get
    w: RawWeights = {"embed_tokens": get("model.embed_tokens.weight"), "final_norm.weight": get("model.norm.weight")}
    for layer in range(cfg.num_layers):
        p, q = f"model.layers.{layer}.", f"layers.{layer}."
        w.update(renamed(get, q, p, (("input_norm", "input_layernorm"), ("post_norm", "post_attention_layernorm"),
                                     ("qkv", "self_attn.qkv_proj"), ("out", "self_attn.o_proj"),
                                     ("mlp_in", "mlp.gate_up_proj"), ("mlp_out", "mlp.down_proj")), ("weight",)))
    if not cfg.tie_word_embeddings:
        w["lm_head"] = get("lm_head.weight")
    return w


PHI = Architecture(name="phi", hf_class_names=("PhiForCausalLM",), variant=VARIANT,
                   config_from_hf=config_from_hf, read_weights=read_weights)
PHI3 = Architecture(name="phi3", hf_class_names=("Phi3ForCausalLM",), variant=PHI3_VARIANT,
                    config_from_hf=phi3_config_from_hf, read_weights=phi3_read_weights)
