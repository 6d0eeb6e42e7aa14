"""GPT-2: learned positions, LayerNorm, GELU MLP, biases everywhere, Conv1D ([in, out]) weights."""
from __future__ import annotations

from types import MappingProxyType
from typing import Any

from ..config import ConfigError, ModelConfig
from ..loading.weights import LazyTensor, RawWeights, TensorSource, WeightError, renamed
from .base import Architecture, positive_int, token_ids

VARIANT = MappingProxyType(dict(
    position_embedding="learned", rope=None, rotary_style=None, rotary_fraction=None, norm_type="layernorm",
    mlp_type="gelu", residual="sequential", qkv_bias=True, out_bias=True, mlp_bias=True, sliding_window=None,
    embedding_norm=False, lm_head_bias=False))


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(flag):
            raise ConfigError(f"config.json: {flag}=true is not supported")
    if hf.get("scale_attn_weights", True) is False:
        raise ConfigError("config.json: scale_attn_weights=false is not supported")
    hidden = positive_int(hf, "n_embd", "hidden_size")
    heads = positive_int(hf, "n_head", "num_attention_heads")
    inner = hf.get("n_inner")
    return ModelConfig(
        architecture="gpt2", vocab_size=positive_int(hf, "vocab_size"), hidden_size=hidden,
        num_layers=positive_int(hf, "n_layer", "num_hidden_layers"), num_heads=heads,
        num_kv_heads=heads, head_dim=hidden // heads, intermediate_size=int(inner) if inner else 4 * hidden,
        max_position_embeddings=positive_int(hf, "n_positions", "max_position_embeddings"),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        activation=hf.get("activation_function", "gelu_new"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)), **VARIANT, **token_ids(hf)).validated()


def read_weights(src: TensorSource, cfg: ModelConfig) -> RawWeights:
    prefix = "transformer." if "transformer.wte.weight" in src.names() else ""

    def get(name: str) -> LazyTensor:
        return src.get(prefix + name)

    def conv1d(name: str) -> LazyTensor:  # GPT-2's Conv1D stores [in, out]
        tensor = get(name)
        if tensor.dim() != 2:
            raise WeightError(f"{src.directory}: tensor {prefix + name!r} has shape {list(tensor.shape)}, "
                              "expected a 2-D [in, out] Conv1D weight")
        return tensor.t()

    w: RawWeights = {"embed_tokens": get("wte.weight"), "position_embeddings": get("wpe.weight"),
                     **renamed(get, "", "", (("final_norm", "ln_f"),))}
    for layer in range(cfg.num_layers):
        p, q = f"h.{layer}.", f"layers.{layer}."
        w.update(renamed(get, q, p, (("input_norm", "ln_1"), ("post_norm", "ln_2"))))
        for ours, theirs in (("qkv", "attn.c_attn"), ("out", "attn.c_proj"), ("mlp_in", "mlp.c_fc"),
                             ("mlp_out", "mlp.c_proj")):
            w[q + ours + ".weight"], w[q + ours + ".bias"] = conv1d(p + theirs + ".weight"), get(p + theirs + ".bias")
    if not cfg.tie_word_embeddings:
        w["lm_head"] = src.get("lm_head.weight")
    return w


GPT2 = Architecture(name="gpt2", hf_class_names=("GPT2LMHeadModel",), variant=VARIANT,
                    config_from_hf=config_from_hf, read_weights=read_weights)
