"""GPT-NeoX / Pythia: a parallel residual with two LayerNorms (or sequential where
`use_parallel_residual` is false), partial rotary (`rotary_pct`) over half-split pairs, a fused
QKV laid out per head, biases, an untied `embed_out` head unless the config ties it."""
from __future__ import annotations

from types import MappingProxyType
from typing import Any

from ..config import ModelConfig
from ..loading.weights import RawWeights, TensorSource, per_head_qkv, renamed
from .base import Architecture, positive_int, rope_from_hf, rotary_fraction_from_hf, token_ids

VARIANT = MappingProxyType(dict(position_embedding="rope", rotary_style="neox", norm_type="layernorm",
                                mlp_type="gelu", mlp_bias=True, embedding_norm=False, lm_head_bias=False,
                                sliding_window=None))


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    hidden = positive_int(hf, "hidden_size")
    heads = positive_int(hf, "num_attention_heads")
    attention_bias = bool(hf.get("attention_bias", True))
    return ModelConfig(
        architecture="gpt_neox", vocab_size=positive_int(hf, "vocab_size"), hidden_size=hidden,
        num_layers=positive_int(hf, "num_hidden_layers"), num_heads=heads, num_kv_heads=heads,
        head_dim=hidden // heads, intermediate_size=positive_int(hf, "intermediate_size"),
        max_position_embeddings=positive_int(hf, "max_position_embeddings"),
        norm_eps=float(hf.get("layer_norm_eps", 1e-5)), activation=hf.get("hidden_act", "gelu"),
        rope=rope_from_hf(hf, "rotary_emb_base"),
        rotary_fraction=rotary_fraction_from_hf(hf, "rotary_pct", default=0.25),
        residual="parallel" if hf.get("use_parallel_residual", True) else "sequential",
        qkv_bias=attention_bias, out_bias=attention_bias,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), **VARIANT, **token_ids(hf)).validated()


def read_weights(src: TensorSource, cfg: ModelConfig) -> RawWeights:
    get = src.get
    w: RawWeights = {"embed_tokens": get("gpt_neox.embed_in.weight"),
                     **renamed(get, "", "gpt_neox.", (("final_norm", "final_layer_norm"),))}
    for layer in range(cfg.num_layers):
        p, q = f"gpt_neox.layers.{layer}.", f"layers.{layer}."
        w.update(renamed(get, q, p, (("input_norm", "input_layernorm"), ("post_norm", "post_attention_layernorm"),
                                     ("mlp_in", "mlp.dense_h_to_4h"), ("mlp_out", "mlp.dense_4h_to_h"))))
        w.update(renamed(get, q, p, (("out", "attention.dense"),), ("weight", "bias") if cfg.out_bias else ("weight",)))
        qkv = p + "attention.query_key_value."
        w[q + "qkv.weight"] = per_head_qkv(get(qkv + "weight"), cfg.num_heads, cfg.head_dim, qkv + "weight",
                                           src.directory)
        if cfg.qkv_bias:
            w[q + "qkv.bias"] = per_head_qkv(get(qkv + "bias"), cfg.num_heads, cfg.head_dim, qkv + "bias",
                                             src.directory)
    if not cfg.tie_word_embeddings:
        w["lm_head"] = get("embed_out.weight")
    return w


GPT_NEOX = Architecture(name="gpt_neox", hf_class_names=("GPTNeoXForCausalLM",), variant=VARIANT,
                        config_from_hf=config_from_hf, read_weights=read_weights)
