"""GPT-J: a parallel residual sharing one LayerNorm, partial rotary (`rotary_dim`) over interleaved
pairs, separate bias-free q/k/v/out projections, a GELU MLP with biases, an lm_head with a bias."""
from __future__ import annotations

from types import MappingProxyType
from typing import Any

from ..config import ModelConfig, RopeConfig
from ..loading.weights import RawWeights, TensorSource, fused, renamed
from .base import Architecture, positive_int, token_ids

VARIANT = MappingProxyType(dict(
    position_embedding="rope", rotary_style="interleaved", norm_type="layernorm", mlp_type="gelu",
    residual="parallel_shared_norm", qkv_bias=False, out_bias=False, mlp_bias=True, embedding_norm=False,
    lm_head_bias=True, sliding_window=None))


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    hidden = positive_int(hf, "n_embd", "hidden_size")
    heads = positive_int(hf, "n_head", "num_attention_heads")
    head_dim = hidden // heads
    # NOTE: rotary_dim null makes transformers' GPT-J rotate by hidden_size (not head_dim) frequencies,
    # which fits no head; such a config is refused as missing the field.
    rotary_dim = positive_int(hf, "rotary_dim")
    inner = hf.get("n_inner")
    return ModelConfig(
        architecture="gptj", vocab_size=positive_int(hf, "vocab_size"), hidden_size=hidden,
        num_layers=positive_int(hf, "n_layer", "num_hidden_layers"), num_heads=heads, num_kv_heads=heads,
        head_dim=head_dim, intermediate_size=int(inner) if inner else 4 * hidden,
        max_position_embeddings=positive_int(hf, "n_positions", "max_position_embeddings"),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), activation=hf.get("activation_function", "gelu_new"),
        rope=RopeConfig(theta=10000.0), rotary_fraction=rotary_dim / head_dim,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), **VARIANT, **token_ids(hf)).validated()


def read_weights(src: TensorSource, cfg: ModelConfig) -> RawWeights:
    get, h = src.get, cfg.hidden_size
    w: RawWeights = {"embed_tokens": get("transformer.wte.weight"), "lm_head.bias": get("lm_head.bias"),
                     **renamed(get, "", "transformer.", (("final_norm", "ln_f"),))}
    for layer in range(cfg.num_layers):
        p, q = f"transformer.h.{layer}.", f"layers.{layer}."
        w.update(renamed(get, q, p, (("input_norm", "ln_1"), ("mlp_in", "mlp.fc_in"), ("mlp_out", "mlp.fc_out"))))
        w[q + "qkv.weight"] = fused(src, {p + f"attn.{x}_proj.weight": (h, h) for x in "qkv"})
        w[q + "out.weight"] = get(p + "attn.out_proj.weight")
    if not cfg.tie_word_embeddings:
        w["lm_head"] = get("lm_head.weight")
    return w


GPTJ = Architecture(name="gptj", hf_class_names=("GPTJForCausalLM",), variant=VARIANT,
                    config_from_hf=config_from_hf, read_weights=read_weights)
