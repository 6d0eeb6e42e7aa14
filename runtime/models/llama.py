"""The LLaMA family: rotary positions (half-split), RMSNorm, gated SiLU MLP, GQA, optional biases and
sliding window. LLaMA and Mistral share one mapping; Qwen2 always has q/k/v biases and its window only
where `use_sliding_window` says so (on every layer); Qwen3 drops the biases (unless `attention_bias`)
and normalizes each query and key head (q_norm / k_norm) before the rotation."""
from __future__ import annotations

from types import MappingProxyType
from typing import Any

from ..config import ConfigError, ModelConfig
from ..loading.weights import RawWeights, TensorSource, fused
from .base import Architecture, positive_int, rope_from_hf, rotary_fraction_from_hf, token_ids

VARIANT = MappingProxyType(dict(position_embedding="rope", rotary_style="neox", rotary_fraction=1.0,
                                norm_type="rmsnorm", mlp_type="gated", residual="sequential", embedding_norm=False,
                                lm_head_bias=False, qk_norm=False))
QWEN3_VARIANT = MappingProxyType({**VARIANT, "qk_norm": True})


def config_from_hf(hf: dict[str, Any], architecture: str = "llama", **fields: Any) -> ModelConfig:
    """A LLaMA-style config.json -> ModelConfig named `architecture`; `fields` replace mapped ones."""
    if "rotary_fraction" not in fields and rotary_fraction_from_hf(hf) != 1.0:
        # NOTE: transformers' LLaMA would build partial frequencies and then rotate the whole head.
        raise ConfigError("rope_parameters: partial_rotary_factor != 1 is not supported")
    hidden = positive_int(hf, "hidden_size")
    heads = positive_int(hf, "num_attention_heads")
    window = hf.get("sliding_window")
    attention_bias = bool(hf.get("attention_bias", False))
    mapped = dict(
        architecture=architecture, vocab_size=positive_int(hf, "vocab_size"), hidden_size=hidden,
        num_layers=positive_int(hf, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads), head_dim=int(hf.get("head_dim") or hidden // heads),
        intermediate_size=positive_int(hf, "intermediate_size"),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), activation=hf.get("hidden_act", "silu"),
        rope=rope_from_hf(hf), qkv_bias=attention_bias, out_bias=attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)), tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=int(window) if window is not None else None, **VARIANT, **token_ids(hf))
    mapped.update(fields)
    return ModelConfig(**mapped).validated()


def read_weights(src: TensorSource, cfg: ModelConfig) -> RawWeights:
    get = src.get
    h, i = cfg.hidden_size, cfg.intermediate_size
    qkv_rows = {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size}
    w: RawWeights = {"embed_tokens": get("model.embed_tokens.weight"), "final_norm.weight": get("model.norm.weight")}
    for layer in range(cfg.num_layers):
        p, q = f"model.layers.{layer}.", f"layers.{layer}."
        w[q + "input_norm.weight"] = get(p + "input_layernorm.weight")
        w[q + "post_norm.weight"] = get(p + "post_attention_layernorm.weight")
        attn = p + "self_attn."
        w[q + "qkv.weight"] = fused(src, {attn + f"{x}_proj.weight": (n, h) for x, n in qkv_rows.items()})
        if cfg.qk_norm:
            w[q + "q_norm.weight"], w[q + "k_norm.weight"] = get(attn + "q_norm.weight"), get(attn + "k_norm.weight")
        if cfg.qkv_bias:
            w[q + "qkv.bias"] = fused(src, {attn + f"{x}_proj.bias": (n,) for x, n in qkv_rows.items()})
        w[q + "out.weight"] = get(attn + "o_proj.weight")
        if cfg.out_bias:
            w[q + "out.bias"] = get(attn + "o_proj.bias")
        w[q + "mlp_in.weight"] = fused(src, {p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h)})
        w[q + "mlp_out.weight"] = get(p + "mlp.down_proj.weight")
        if cfg.mlp_bias:
            w[q + "mlp_in.bias"] = fused(src, {p + "mlp.gate_proj.bias": (i,), p + "mlp.up_proj.bias": (i,)})
            w[q + "mlp_out.bias"] = get(p + "mlp.down_proj.bias")
    if not cfg.tie_word_embeddings:
        w["lm_head"] = get("lm_head.weight")
    return w


def _mistral_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    return config_from_hf(hf, "mistral")


def _qwen_window(hf: dict[str, Any], family: str) -> int | None:
    """The window of every layer where `use_sliding_window` says so (None otherwise); a window on a
    subset of the layers is a ConfigError."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    if window is not None:
        max_window_layers = hf.get("max_window_layers", hf.get("num_hidden_layers"))
        if max_window_layers is not None and int(max_window_layers) < positive_int(hf, "num_hidden_layers"):
            raise ConfigError(f"config.json: {family} sliding window on a subset of layers "
                              f"(max_window_layers={max_window_layers}) is not supported")
    return int(window) if window is not None else None


def _qwen2_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    return config_from_hf(hf, "qwen2", qkv_bias=True, sliding_window=_qwen_window(hf, "Qwen2"))


def _qwen3_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    return config_from_hf(hf, "qwen3", qk_norm=True, sliding_window=_qwen_window(hf, "Qwen3"))


LLAMA = Architecture(name="llama", hf_class_names=("LlamaForCausalLM",), variant=VARIANT,
                     config_from_hf=config_from_hf, read_weights=read_weights)
MISTRAL = Architecture(name="mistral", hf_class_names=("MistralForCausalLM",), variant=VARIANT,
                       config_from_hf=_mistral_config_from_hf, read_weights=read_weights)
QWEN2 = Architecture(name="qwen2", hf_class_names=("Qwen2ForCausalLM",), variant=VARIANT,
                     config_from_hf=_qwen2_config_from_hf, read_weights=read_weights)
QWEN3 = Architecture(name="qwen3", hf_class_names=("Qwen3ForCausalLM",), variant=QWEN3_VARIANT,
                     config_from_hf=_qwen3_config_from_hf, read_weights=read_weights)
