"""Falcon: rotary positions, LayerNorm, a GELU MLP, and three decoder layouts, read from the config:
  7B style (`multi_query`, `parallel_attn`): one KV head, a parallel residual sharing one LayerNorm;
  the new decoder architecture (40B / 180B): grouped KV heads (`num_kv_heads`), a parallel residual
  with two LayerNorms (ln_attn, ln_mlp; one where `num_ln_in_parallel_attn` is 1);
  `parallel_attn` false: a sequential residual with two LayerNorms.
The ALiBi variants (Falcon RW, `alibi`: true) scale their bias by 1 / sqrt(head_dim), unlike BLOOM's,
and are refused."""
from __future__ import annotations

from types import MappingProxyType
from typing import Any

from ..config import ConfigError, ModelConfig
from ..loading.weights import LazyTensor, RawWeights, TensorSource, WeightError, renamed
from .base import Architecture, positive_int, rope_from_hf, token_ids

VARIANT = MappingProxyType(dict(position_embedding="rope", rotary_style="neox", rotary_fraction=1.0,
                                norm_type="layernorm", mlp_type="gelu", embedding_norm=False, lm_head_bias=False,
                                sliding_window=None))


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    if hf.get("alibi"):
        raise ConfigError("config.json: alibi=true (the Falcon RW ALiBi variant) is not supported")
    hidden = positive_int(hf, "hidden_size")
    heads = positive_int(hf, "num_attention_heads")
    new_decoder = bool(hf.get("new_decoder_architecture", False))
    parallel = bool(hf.get("parallel_attn", True))
    if new_decoder:
        num_kv_heads = int(hf.get("num_kv_heads") or heads)
        num_norms = hf.get("num_ln_in_parallel_attn") or 2
        if num_norms not in (1, 2) or (num_norms == 1 and not parallel):
            raise ConfigError(f"config.json: num_ln_in_parallel_attn={hf.get('num_ln_in_parallel_attn')!r} with "
                              f"parallel_attn={parallel} is not supported with new_decoder_architecture")
        residual = "parallel" if num_norms == 2 else "parallel_shared_norm"
    else:
        num_kv_heads = 1 if hf.get("multi_query", True) else heads
        residual = "parallel_shared_norm" if parallel else "sequential"
    bias = bool(hf.get("bias", False))
    return ModelConfig(
        architecture="falcon", vocab_size=positive_int(hf, "vocab_size"), hidden_size=hidden,
        num_layers=positive_int(hf, "num_hidden_layers"), num_heads=heads, num_kv_heads=num_kv_heads,
        head_dim=hidden // heads, intermediate_size=int(hf.get("ffn_hidden_size") or 4 * hidden),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), activation=hf.get("activation", "gelu"),
        rope=rope_from_hf(hf), residual=residual, qkv_bias=bias, out_bias=bias, mlp_bias=bias,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)), **VARIANT, **token_ids(hf)).validated()


def _qkv(tensor: LazyTensor, cfg: ModelConfig, name: str, directory: str) -> LazyTensor:
    """Falcon's fused QKV rows [num_kv_heads, group + 2, head_dim] (per KV head: its `group` query
    heads, its key, its value) -> the canonical [all q, all k, all v]; query head kv * group + i
    keeps its index. One layout covers every style: multi-query is num_kv_heads = 1 ([q heads, k,
    v]), the old multi-head layout is group = 1 (per head [q_h, k_h, v_h])."""
    group, d = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    if tensor.shape[0] != cfg.num_kv_heads * (group + 2) * d:
        raise WeightError(f"{directory}: tensor {name!r} has shape {list(tensor.shape)}, expected "
                          f"{cfg.num_kv_heads * (group + 2) * d} rows from the config")
    kv_heads = range(cfg.num_kv_heads)
    blocks = ([kv * (group + 2) + i for kv in kv_heads for i in range(group)]   # head_dim-row blocks
              + [kv * (group + 2) + group for kv in kv_heads] + [kv * (group + 2) + group + 1 for kv in kv_heads])
    return tensor.take_rows([(block * d, (block + 1) * d) for block in blocks])


def read_weights(src: TensorSource, cfg: ModelConfig) -> RawWeights:
    get = src.get
    w: RawWeights = {"embed_tokens": get("transformer.word_embeddings.weight"),
                     **renamed(get, "", "transformer.", (("final_norm", "ln_f"),))}
    norms = {"parallel": (("input_norm", "ln_attn"), ("post_norm", "ln_mlp")),
             "parallel_shared_norm": (("input_norm", "input_layernorm"),),
             "sequential": (("input_norm", "input_layernorm"), ("post_norm", "post_attention_layernorm"))}
    linears = (("out", "self_attention.dense"), ("mlp_in", "mlp.dense_h_to_4h"), ("mlp_out", "mlp.dense_4h_to_h"))
    for layer in range(cfg.num_layers):
        p, q = f"transformer.h.{layer}.", f"layers.{layer}."
        w.update(renamed(get, q, p, norms[cfg.residual]))
        w.update(renamed(get, q, p, linears, ("weight", "bias") if cfg.mlp_bias else ("weight",)))
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            name = p + "self_attention.query_key_value." + kind
            w[q + "qkv." + kind] = _qkv(get(name), cfg, name, src.directory)
    if not cfg.tie_word_embeddings:
        w["lm_head"] = get("lm_head.weight")
    return w


FALCON = Architecture(name="falcon", hf_class_names=("FalconForCausalLM",), variant=VARIANT,
                      config_from_hf=config_from_hf, read_weights=read_weights)
