"""GGUF metadata -> ModelConfig, one entry per llama.cpp architecture that the registry can run.

Each entry builds the HF `config.json` dict its registry entry reads (runtime.models) from the file's
`{arch}.*` and `tokenizer.ggml.*` keys and its tensor names, so that one mapping per architecture
(config_from_hf) serves both formats. Called by runtime.loading.gguf_checkpoint.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch

from ..config import ConfigError, ModelConfig
from .gguf_file import GgufFile
from ..models import lookup

# Tensors that change what the model computes in ways the runtime does not implement.
UNSUPPORTED_TENSORS = {"rope_factors_long.weight": "LongRoPE factors", "rope_factors_short.weight": "LongRoPE factors"}
# Tensors that are part of the config, not weights: llama.cpp's converter writes LLaMA 3's rope
# scaling as one divisor per rotated pair of dims (read by Keys.rope).
ROPE_FREQS = "rope_freqs.weight"


class Keys:
    """The `{arch}.*` values of one file, checked as they are read (ConfigError naming the key)."""

    def __init__(self, file: GgufFile, arch: str):
        self.file, self.arch = file, arch

    def key(self, suffix: str) -> str:
        return f"{self.arch}.{suffix}"

    def count(self, suffix: str, required: bool = True) -> int | None:
        key = self.key(suffix)
        value = self.file.get_int(key)
        if value is None and required:
            raise ConfigError(f"{self.file.path}: metadata {key!r}: missing")
        if value is not None and value <= 0:
            raise ConfigError(f"{self.file.path}: metadata {key!r}: must be a positive integer, got {value}")
        return value

    def number(self, suffix: str, default: float | None = None) -> float | None:
        value = self.file.get_float(self.key(suffix))
        return default if value is None else value

    def positive_number(self, suffix: str, default: float | None = None) -> float | None:
        """number(), or ConfigError naming the key unless it is a finite number > 0 (or absent)."""
        value = self.number(suffix, default)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{self.file.path}: metadata {self.key(suffix)!r}: must be a finite number > 0, "
                              f"got {value}")
        return value

    def has_tensor(self, name: str) -> bool:
        return name in self.file.tensors

    @property
    def hidden(self) -> int:
        return self.count("embedding_length")

    @property
    def heads(self) -> int:
        return self.count("attention.head_count")

    def head_dim(self, free: bool) -> int:
        """attention.key_length where `free` (the architecture allows any), else hidden / heads; the
        value length must be the same."""
        key_length = self.count("attention.key_length", required=False)
        if (not free or key_length is None) and self.heads > self.hidden:
            raise ConfigError(f"{self.file.path}: metadata {self.key('attention.head_count')!r}: {self.heads} "
                              f"heads exceed {self.key('embedding_length')!r} {self.hidden} (no head dim)")
        head_dim = key_length if free and key_length is not None else self.hidden // self.heads
        for suffix in ("attention.key_length", "attention.value_length"):
            value = self.count(suffix, required=False)
            if value is not None and value != head_dim:
                raise ConfigError(f"{self.file.path}: metadata {self.key(suffix)!r}: {value} is not supported "
                                  f"(expected {head_dim})")
        return head_dim

    def rotary_fraction(self, head_dim: int, whole: bool = False) -> float:
        """The rotated share of the head; `whole`: ConfigError unless all of it rotates."""
        rotary_dim = self.count("rope.dimension_count", required=False) or head_dim
        if rotary_dim > head_dim:
            raise ConfigError(f"{self.file.path}: metadata {self.key('rope.dimension_count')!r}: {rotary_dim} "
                              f"exceeds the head dim {head_dim}")
        if whole and rotary_dim != head_dim:
            raise ConfigError(f"{self.file.path}: metadata {self.key('rope.dimension_count')!r}: rotating part of "
                              f"the head is not supported for {self.arch}")
        return rotary_dim / head_dim

    def vocab_size(self) -> int:
        value = self.count("vocab_size", required=False)
        if value is None:
            value = self.file.num_items("tokenizer.ggml.tokens") or None
        if value is None and "token_embd.weight" in self.file.tensors:
            value = self.file.tensors["token_embd.weight"].shape[0]
        if not value:
            raise ConfigError(f"{self.file.path}: metadata {self.key('vocab_size')!r}: missing (and no "
                              "tokenizer.ggml.tokens)")
        return value

    def rope(self) -> dict[str, Any]:
        """rope_theta, and rope_scaling where the file scales positions linearly or by per-pair
        frequency factors (the `rope_freqs` tensor: LLaMA 3's scaling; each factor finite and > 0)."""
        out: dict[str, Any] = {"rope_theta": self.positive_number("rope.freq_base", 10000.0)}
        kind = self.file.get_str(self.key("rope.scaling.type"))
        factor = self.positive_number("rope.scaling.factor")
        if kind is None and self.positive_number("rope.scale_linear", 1.0) != 1.0:   # the older spelling
            kind, factor = "linear", self.number("rope.scale_linear")
        if kind == "linear" and factor is None:
            raise ConfigError(f"{self.file.path}: metadata {self.key('rope.scaling.factor')!r}: missing")
        if ROPE_FREQS in self.file.tensors:
            if kind == "linear" and factor != 1.0:
                raise ConfigError(f"{self.file.path}: tensor {ROPE_FREQS!r} with metadata "
                                  f"{self.key('rope.scaling.type')!r} 'linear': two rope scalings at once")
            factors = self.file.read(ROPE_FREQS).reshape(-1)
            if not bool(torch.isfinite(factors).all()) or not bool((factors > 0).all()):
                raise ConfigError(f"{self.file.path}: tensor {ROPE_FREQS!r}: every factor must be a finite number "
                                  "> 0")
            out["rope_scaling"] = {"rope_type": "freq_factors", "factors": factors.tolist()}
        elif kind == "linear" and factor != 1.0:
            out["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        elif kind not in (None, "none", "linear"):
            raise ConfigError(f"{self.file.path}: metadata {self.key('rope.scaling.type')!r}: unsupported "
                              f"{kind!r}; supported: none, linear")
        return out

    def layer_norm_eps(self, default: float = 1e-5) -> float:
        return self.number("attention.layer_norm_epsilon", default)

    def rms_norm_eps(self, default: float = 1e-6) -> float:
        return self.number("attention.layer_norm_rms_epsilon", default)

    def common(self) -> dict[str, Any]:
        """vocab_size, tie_word_embeddings (no `output.weight`) and the special token ids."""
        ids = {name: self.file.get_int(f"tokenizer.ggml.{key}") for name, key in (
            ("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id"))}
        return {"vocab_size": self.vocab_size(), "tie_word_embeddings": not self.has_tensor("output.weight"), **ids}


# -- one HF config per architecture ----------------------------------------------------------------

def _llama_like(k: Keys, model_type: str) -> dict[str, Any]:
    head_dim = k.head_dim(free=True)
    k.rotary_fraction(head_dim, whole=True)
    window = k.count("attention.sliding_window", required=False)
    return {"model_type": model_type, "hidden_size": k.hidden, "num_hidden_layers": k.count("block_count"),
            "num_attention_heads": k.heads, "num_key_value_heads": k.count("attention.head_count_kv", False),
            "head_dim": head_dim, "intermediate_size": k.count("feed_forward_length"),
            "max_position_embeddings": k.count("context_length"), "rms_norm_eps": k.rms_norm_eps(),
            "attention_bias": k.has_tensor("blk.0.attn_output.bias") or (
                model_type != "qwen2" and k.has_tensor("blk.0.attn_q.bias")),   # Qwen2's q/k/v bias is implied
            "mlp_bias": k.has_tensor("blk.0.ffn_up.bias"),
            "sliding_window": window, "use_sliding_window": window is not None, **k.rope(), **k.common()}


def _llama(k: Keys) -> dict[str, Any]:
    # transformers reads a llama-architecture file named as a Mistral one as Mistral (a label here).
    name = (k.file.get_str("general.name") or "").lower()
    return _llama_like(k, "mistral" if "mistral" in name else "llama")


def _qwen2(k: Keys) -> dict[str, Any]:
    return _llama_like(k, "qwen2")


def _qwen3(k: Keys) -> dict[str, Any]:
    return _llama_like(k, "qwen3")


def _phi3(k: Keys) -> dict[str, Any]:
    head_dim = k.head_dim(free=False)
    return {"model_type": "phi3", "hidden_size": k.hidden, "num_hidden_layers": k.count("block_count"),
            "num_attention_heads": k.heads, "num_key_value_heads": k.count("attention.head_count_kv", False),
            "intermediate_size": k.count("feed_forward_length"), "max_position_embeddings": k.count("context_length"),
            "rms_norm_eps": k.rms_norm_eps(1e-5), "partial_rotary_factor": k.rotary_fraction(head_dim),
            "sliding_window": k.count("attention.sliding_window", required=False), **k.rope(), **k.common()}


def _gpt2(k: Keys) -> dict[str, Any]:
    k.head_dim(free=False)
    return {"model_type": "gpt2", "n_embd": k.hidden, "n_layer": k.count("block_count"), "n_head": k.heads,
            "n_inner": k.count("feed_forward_length", required=False), "n_positions": k.count("context_length"),
            "layer_norm_epsilon": k.layer_norm_eps(), **k.common()}


def _gptj(k: Keys) -> dict[str, Any]:
    head_dim = k.head_dim(free=False)
    return {**_gpt2(k), "model_type": "gptj", "rotary_dim": round(k.rotary_fraction(head_dim) * head_dim)}


def _gpt_neox(k: Keys) -> dict[str, Any]:
    head_dim = k.head_dim(free=False)
    parallel = k.file.get_bool(k.key("use_parallel_residual"))
    return {"model_type": "gpt_neox", "hidden_size": k.hidden, "num_hidden_layers": k.count("block_count"),
            "num_attention_heads": k.heads, "intermediate_size": k.count("feed_forward_length"),
            "max_position_embeddings": k.count("context_length"), "layer_norm_eps": k.layer_norm_eps(),
            "rotary_pct": k.rotary_fraction(head_dim), "use_parallel_residual": True if parallel is None else parallel,
            "attention_bias": k.has_tensor("blk.0.attn_qkv.bias"), **k.rope(), **k.common()}


def _falcon(k: Keys) -> dict[str, Any]:
    """llama.cpp's Falcon: a parallel residual, one norm (7B: attn_norm) or two (40B: attn_norm_2 too)."""
    k.rotary_fraction(k.head_dim(free=False), whole=True)
    return {"model_type": "falcon", "hidden_size": k.hidden, "num_hidden_layers": k.count("block_count"),
            "num_attention_heads": k.heads, "num_kv_heads": k.count("attention.head_count_kv", False) or 1,
            "new_decoder_architecture": True, "parallel_attn": True,
            "num_ln_in_parallel_attn": 2 if k.has_tensor("blk.0.attn_norm_2.weight") else 1,
            "ffn_hidden_size": k.count("feed_forward_length"), "max_position_embeddings": k.count("context_length"),
            "layer_norm_epsilon": k.layer_norm_eps(), "bias": k.has_tensor("blk.0.attn_qkv.bias"),
            **k.rope(), **k.common()}


def _phi2(k: Keys) -> dict[str, Any]:
    head_dim = k.head_dim(free=False)
    return {"model_type": "phi", "hidden_size": k.hidden, "num_hidden_layers": k.count("block_count"),
            "num_attention_heads": k.heads, "num_key_value_heads": k.count("attention.head_count_kv", False),
            "intermediate_size": k.count("feed_forward_length"), "max_position_embeddings": k.count("context_length"),
            "layer_norm_eps": k.layer_norm_eps(), "partial_rotary_factor": k.rotary_fraction(head_dim),
            **k.rope(), **k.common()}


def _bloom(k: Keys) -> dict[str, Any]:
    k.head_dim(free=False)
    ffn = k.count("feed_forward_length", required=False)
    if ffn is not None and ffn != 4 * k.hidden:
        raise ConfigError(f"{k.file.path}: metadata {k.key('feed_forward_length')!r}: BLOOM's is 4 * "
                          f"embedding_length = {4 * k.hidden}, got {ffn}")
    return {"model_type": "bloom", "hidden_size": k.hidden, "n_layer": k.count("block_count"), "n_head": k.heads,
            "max_position_embeddings": k.count("context_length", required=False),
            "layer_norm_epsilon": k.layer_norm_eps(), **k.common()}


@dataclass(frozen=True)
class GgufArch:
    """How to read one llama.cpp architecture."""
    # the HF config.json dict; its model_type names the runtime.models entry that maps it
    hf_config: Callable[[Keys], dict[str, Any]]
    # llama.cpp's LLaMA rotates adjacent pairs and so stores Q/K rows permuted (undone on load).
    permuted_qk: bool = False
    # canonical layer tensor -> ways to store it, where they differ from gguf_checkpoint.LAYER_TO_GGUF
    layer_to_gguf: Mapping[str, tuple[tuple[str, ...], ...]] = field(default_factory=dict)


# llama.cpp's Falcon 40B: attn_norm_2 (ln_attn) feeds the attention and attn_norm (ln_mlp) the MLP;
# with one norm, attn_norm feeds both.
FALCON_NORMS = MappingProxyType({"input_norm": (("attn_norm_2",), ("attn_norm",)), "post_norm": (("attn_norm",),)})


# general.architecture -> entry
GGUF_ARCHITECTURES = {
    "llama": GgufArch(_llama, permuted_qk=True), "qwen2": GgufArch(_qwen2), "qwen3": GgufArch(_qwen3), "phi3": GgufArch(_phi3),
    "gpt2": GgufArch(_gpt2), "gptj": GgufArch(_gptj), "gptneox": GgufArch(_gpt_neox),
    "falcon": GgufArch(_falcon, layer_to_gguf=FALCON_NORMS), "phi2": GgufArch(_phi2), "bloom": GgufArch(_bloom),
}


def gguf_architecture(file: GgufFile) -> tuple[str, GgufArch]:
    name = file.get_str("general.architecture")
    if name is None:
        raise ConfigError(f"{file.path}: metadata 'general.architecture': missing")
    if name not in GGUF_ARCHITECTURES:
        raise ConfigError(f"{file.path}: general.architecture: unsupported {name!r}; supported: "
                          f"{', '.join(GGUF_ARCHITECTURES)}")
    return name, GGUF_ARCHITECTURES[name]


def model_config_from_gguf(file: GgufFile) -> tuple[ModelConfig, GgufArch]:
    """The file's ModelConfig (ConfigError naming the key or tensor) and its architecture entry."""
    name, arch = gguf_architecture(file)
    if (file.get_int("split.count") or 1) > 1:
        raise ConfigError(f"{file.path}: metadata 'split.count': {file.get_int('split.count')} files; a model "
                          "split across GGUF files is not supported (merge them with llama.cpp's gguf-split)")
    for tensor, what in UNSUPPORTED_TENSORS.items():
        if tensor in file.tensors:
            raise ConfigError(f"{file.path}: tensor {tensor!r}: {what} are not supported")
    hf = arch.hf_config(Keys(file, name))
    hf = {key: value for key, value in hf.items() if value is not None}
    try:
        config = lookup(hf["model_type"]).config_from_hf(hf)
    except ConfigError as e:
        raise ConfigError(f"{file.path}: the {name} metadata maps to an unsupported config: {e}") from None
    if config.num_layers > len(file.tensors):   # every layer has tensors; bounds the loops over layers
        raise ConfigError(f"{file.path}: metadata '{name}.block_count': {config.num_layers} layers, more than "
                          f"the file's {len(file.tensors)} tensors")
    return config, arch
