"""BLOOM: ALiBi positions, a LayerNorm on the embeddings, a fused QKV laid out per head, biases
everywhere, a tanh-GELU MLP, tied embeddings."""
from __future__ import annotations

from types import MappingProxyType
from typing import Any

from ..config import ConfigError, ModelConfig
from ..loading.weights import RawWeights, TensorSource, per_head_qkv, renamed
from .base import Architecture, positive_int, token_ids

VARIANT = MappingProxyType(dict(
    position_embedding="alibi", rope=None, rotary_style=None, rotary_fraction=None, norm_type="layernorm",
    mlp_type="gelu", residual="sequential", qkv_bias=True, out_bias=True, mlp_bias=True, embedding_norm=True,
    lm_head_bias=False, sliding_window=None,
    # NOTE: BLOOM's gelu is the tanh approximation with sqrt(2 / pi) rounded to 0.79788456 (relative
    # difference 1e-9, far below the float32 parity tolerance).
    activation="gelu_pytorch_tanh"))
# ALiBi has no position table; this only bounds the default max_seq_len of an HF directory served as is.
DEFAULT_MAX_POSITIONS = 2048


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    if hf.get("apply_residual_connection_post_layernorm"):
        raise ConfigError("config.json: apply_residual_connection_post_layernorm=true is not supported")
    hidden = positive_int(hf, "hidden_size", "n_embed")
    heads = positive_int(hf, "n_head", "num_attention_heads")
    positions = hf.get("max_position_embeddings", hf.get("seq_length"))
    return ModelConfig(
        architecture="bloom", vocab_size=positive_int(hf, "vocab_size"), hidden_size=hidden,
        num_layers=positive_int(hf, "n_layer", "num_hidden_layers"), num_heads=heads, num_kv_heads=heads,
        head_dim=hidden // heads, intermediate_size=4 * hidden,
        max_position_embeddings=int(positions) if positions else DEFAULT_MAX_POSITIONS,
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)), **VARIANT, **token_ids(hf)).validated()


def read_weights(src: TensorSource, cfg: ModelConfig) -> RawWeights:
    prefix = "transformer." if "transformer.word_embeddings.weight" in src.names() else ""

    def get(name: str):
        return src.get(prefix + name)

    w: RawWeights = {"embed_tokens": get("word_embeddings.weight"),
                     **renamed(get, "", "", (("embed_norm", "word_embeddings_layernorm"), ("final_norm", "ln_f")))}
    for layer in range(cfg.num_layers):
        p, q = f"h.{layer}.", f"layers.{layer}."
        w.update(renamed(get, q, p, (("input_norm", "input_layernorm"), ("post_norm", "post_attention_layernorm"),
                                     ("out", "self_attention.dense"), ("mlp_in", "mlp.dense_h_to_4h"),
                                     ("mlp_out", "mlp.dense_4h_to_h"))))
        for kind in ("weight", "bias"):
            name = p + "self_attention.query_key_value." + kind
            w[q + "qkv." + kind] = per_head_qkv(get(name), cfg.num_heads, cfg.head_dim, prefix + name, src.directory)
    if not cfg.tie_word_embeddings:
        w["lm_head"] = src.get("lm_head.weight")
    return w


BLOOM = Architecture(name="bloom", hf_class_names=("BloomForCausalLM",), variant=VARIANT,
                     config_from_hf=config_from_hf, read_weights=read_weights)
