"""Model and build configurations: what a checkpoint's `config.json` says, normalised.

`ModelConfig` describes the network (one decoder-only transformer parameterised by its variant
fields); `BuildConfig` records the build-time limits an engine directory carries. Both are frozen
and plain JSON-serialisable. The architecture registry (`runtime.models`) maps HF configs onto them.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .precision import ACT_QUANT_BLOCK, BUILD_DTYPES, WEIGHT_FORMATS, check_precision_fields

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")   # what runs; a build may also say "auto"
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                  "bf16": "bfloat16"}


# Block variants the model implements: ModelConfig field -> accepted values. An architecture that
# needs another value adds it here and its branch in model.py / rope.py (rotary_fraction, a
# number, is checked in ModelConfig.validated).
VARIANT_VALUES: dict[str, tuple[Any, ...]] = {
    "position_embedding": ("learned", "rope", "alibi"),
    "rotary_style": (None, "neox", "interleaved"),
    "norm_type": ("layernorm", "rmsnorm"),
    "mlp_type": ("gelu", "gated"),
    "residual": ("sequential", "parallel", "parallel_shared_norm"),
    "embedding_norm": (False, True),
    "lm_head_bias": (False, True),
    "qk_norm": (False, True),
}


def normalize_dtype(name: str, allow_auto: bool = False) -> str:
    name = str(name).replace("torch.", "")
    name = _DTYPE_ALIASES.get(name, name)
    supported = BUILD_DTYPES if allow_auto else SUPPORTED_DTYPES
    if name not in supported:
        raise ConfigError(f"dtype: unsupported value {name!r}; supported: {', '.join(supported)}")
    return name


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    scaling_type: str = "default"  # default | linear | llama3 | freq_factors
    factor: float = 1.0
    low_freq_factor: float = 1.0        # llama3
    high_freq_factor: float = 4.0       # llama3
    original_max_position_embeddings: int = 8192  # llama3
    # freq_factors: one divisor per rotated pair [rotary_dim / 2] (llama.cpp's `rope_freqs` tensor:
    # how a GGUF file carries LLaMA 3's scaling, already evaluated per frequency)
    freq_factors: tuple[float, ...] | None = None

    def validated(self) -> "RopeConfig":
        """ConfigError naming the field unless every number is finite and > 0 (a theta or factor of
        0 or NaN would make every position's rotation NaN, and every logit with it)."""
        for name in ("theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ConfigError(f"rope.{name}: must be a finite number > 0, got {value!r}")
        if (self.freq_factors is not None) != (self.scaling_type == "freq_factors"):
            raise ConfigError(f"rope.freq_factors: must be set exactly with scaling_type 'freq_factors', got "
                              f"{self.freq_factors is not None} with {self.scaling_type!r}")
        for value in self.freq_factors or ():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ConfigError(f"rope.freq_factors: every factor must be a finite number > 0, got {value!r}")
        return self


@dataclass(frozen=True)
class ModelConfig:
    architecture: str               # a registry name (runtime.models); a label only: nothing branches on it
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_type: str                  # "layernorm" | "rmsnorm"
    norm_eps: float
    mlp_type: str                   # "gelu" (fc -> act -> proj) | "gated" (silu(gate) * up -> down)
    activation: str                 # "gelu_new" | "gelu" | "silu" | "relu" ...
    position_embedding: str         # "learned" | "rope" | "alibi" (a per-head linear bias on the
                                    # attention scores: + slope_h * (key_pos - query_pos))
    rope: RopeConfig | None         # set exactly with rotary positions, as are the two fields below
    rotary_style: str | None        # pairs of the rotated dims r = rotary_dim: "neox" (i, i + r/2)
                                    # (rotate halves), "interleaved" (2i, 2i + 1)
    rotary_fraction: float | None   # share of head_dim that rotates: the first rotary_dim dims of
                                    # each head; the rest passes through
    residual: str                   # "sequential": x += attn(norm1(x)); x += mlp(norm2(x))
                                    # "parallel": x += attn(norm1(x)) + mlp(norm2(x))
                                    # "parallel_shared_norm": h = norm1(x); x += attn(h) + mlp(h)
    qkv_bias: bool
    out_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    sliding_window: int | None      # attend to keys with q_pos - window < k_pos <= q_pos
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    embedding_norm: bool = False    # a LayerNorm right after the token embedding
    qk_norm: bool = False           # an RMSNorm over each query and key head ([head_dim] weights
                                    # q_norm / k_norm), before the rotation (Qwen3)
    lm_head_bias: bool = False      # the output projection has a bias [V] (also when tied)
    # What runs, set by the engine loader from the BuildConfig on the loading machine: the compute
    # dtype (never "auto") and runtime.precision.QuantMode's bits (weight-only mode, int8 activations,
    # KV cache dtype): a record for users and tools; the model reads the BuildConfig's fields.
    dtype: str = "float32"
    quant_mode: int = 0

    @property
    def rotary_dim(self) -> int | None:
        """Rotated dims of each head: int(head_dim * rotary_fraction), as transformers computes it
        (rounded first so that a fraction stored as rotary_dim / head_dim gives rotary_dim back)."""
        if self.rotary_fraction is None:
            return None
        return int(round(self.head_dim * self.rotary_fraction, 6))

    @property
    def has_post_norm(self) -> bool:
        """Whether each layer has a second norm (post_norm) before its MLP."""
        return self.residual != "parallel_shared_norm"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count of the weights as stored (a tied lm_head counted once)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        mlp = (3 if self.mlp_type == "gated" else 2) * h * i
        params = self.num_layers * (attn + mlp) + self.vocab_size * h
        if not self.tie_word_embeddings:
            params += self.vocab_size * h
        if self.position_embedding == "learned":
            params += self.max_position_embeddings * h
        return params

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "ModelConfig":
        """A ModelConfig's `to_dict()` -> ModelConfig. engine.json files written before a variant
        field existed: runtime.models.model_config_from_dict fills it from the architecture."""
        d = dict(d)
        rope = d.get("rope")
        if rope is not None and rope.get("freq_factors") is not None:
            rope = {**rope, "freq_factors": tuple(rope["freq_factors"])}
        d["rope"] = RopeConfig(**rope) if rope is not None else None
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        unknown = set(d) - fields
        if unknown:
            raise ConfigError(f"model config: unknown fields {sorted(unknown)}")
        return ModelConfig(**d).validated()

    def validated(self) -> "ModelConfig":
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        for name, supported in VARIANT_VALUES.items():
            if getattr(self, name) not in supported:
                raise ConfigError(f"{name}: unsupported {getattr(self, name)!r}; "
                                  f"supported: {', '.join(map(repr, supported))}")
        is_rotary = self.position_embedding == "rope"
        for name in ("rope", "rotary_style", "rotary_fraction"):
            if (getattr(self, name) is not None) != is_rotary:
                raise ConfigError(f"{name}: must be set exactly when position_embedding is 'rope', "
                                  f"got {getattr(self, name)!r} with {self.position_embedding!r}")
        if is_rotary:
            fraction = self.rotary_fraction
            if not (isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 < fraction <= 1) \
                    or self.rotary_dim < 2 or self.rotary_dim % 2:
                raise ConfigError(f"rotary_fraction: must be in (0, 1] and rotate an even number (>= 2) of the "
                                  f"{self.head_dim} head dims, got {fraction!r}")
        if is_rotary:
            self.rope.validated()
            factors = self.rope.freq_factors
            if factors is not None and len(factors) != self.rotary_dim // 2:
                raise ConfigError(f"rope.freq_factors: {len(factors)} factors for {self.rotary_dim // 2} rotated "
                                  "pairs")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_key_value_heads: {self.num_kv_heads} does not divide "
                              f"num_attention_heads {self.num_heads}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window: must be positive, got {self.sliding_window}")
        if not (isinstance(self.norm_eps, (int, float)) and 0 < self.norm_eps < 1):
            raise ConfigError(f"norm_eps: must be in (0, 1), got {self.norm_eps!r}")
        return self


@dataclass(frozen=True)
class BuildConfig:
    """Build-time limits and precision recorded in an engine directory (TensorRT-LLM's build flags;
    the precision fields: API.md "Numerical precision", runtime.precision)."""
    max_batch_size: int = 64
    max_input_len: int = 1024
    max_seq_len: int = 2048
    max_num_tokens: int = 8192
    dtype: str = "float32"                  # auto | float32 | float16 | bfloat16 ("auto" resolved at load)
    tokens_per_block: int = 64
    gather_context_logits: bool = False
    gather_generation_logits: bool = False
    max_beam_width: int = 4
    weight_only: str | None = None          # None | a runtime.quantization entry: "int8", "int4"
    group_size: int = 32                    # group-wise formats (int4): input columns per scale
    weight_only_skip: tuple[str, ...] = ()  # ("lm_head",): the output layer (and a tied embedding) stay in dtype
    kv_cache_dtype: str = "auto"            # auto (the compute dtype) | int8 | fp8
    kv_cache_scale: str | None = None       # "block_head" | "token_head": recorded by the loader that chose it
    act_quant: str | None = None            # None | "int8": the weight-only matmuls' activations quantized per
                                            # block of 32 columns (integer dot products; needs weight_only)
    weight_format: str = "auto"             # a GGUF file's blocks: auto | keep | dequantize (runtime.precision)

    def validated(self, model: ModelConfig | None = None) -> "BuildConfig":
        for name in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens",
                     "tokens_per_block", "max_beam_width"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        normalize_dtype(self.dtype, allow_auto=True)
        from .quantization.registry import lookup_build, supported_formats   # NOTE: lazy: keeps this module torch-free
        check_precision_fields(self.weight_only, supported_formats(), self.group_size, self.weight_only_skip,
                               self.kv_cache_dtype, self.kv_cache_scale, ConfigError, self.act_quant)
        self._check_weight_format()
        if self.max_input_len > self.max_seq_len:
            raise ConfigError(f"max_input_len: {self.max_input_len} exceeds max_seq_len {self.max_seq_len}")
        if model is not None and self.max_seq_len > model.max_position_embeddings \
                and model.position_embedding == "learned":
            raise ConfigError(f"max_seq_len: {self.max_seq_len} exceeds the model's "
                              f"{model.max_position_embeddings} learned positions")
        if model is not None and self.weight_only is not None:
            lookup_build(self.weight_only).check_model(model, self.group_size)
        if model is not None and self.act_quant is not None:
            self._check_act_quant_widths(model)
        return self

    def _check_weight_format(self) -> None:
        if self.weight_format not in WEIGHT_FORMATS:
            raise ConfigError(f"weight_format: unsupported value {self.weight_format!r}; supported: "
                              f"{', '.join(map(repr, WEIGHT_FORMATS))}")
        if self.weight_format == "keep" and self.weight_only is not None:
            raise ConfigError(f"weight_format: 'keep' runs a GGUF file's blocks as they are; weight_only "
                              f"{self.weight_only!r} re-quantizes de-quantized weights: choose one")

    def _check_act_quant_widths(self, model: ModelConfig) -> None:
        """ConfigError naming act_quant and the model's field unless every input width of the weight-only
        matmuls divides into blocks of ACT_QUANT_BLOCK columns (the kernels take no partial block)."""
        for name, width in (("hidden_size", model.hidden_size), ("intermediate_size", model.intermediate_size),
                            ("query width (num_heads * head_dim)", model.q_size)):
            if width % ACT_QUANT_BLOCK:
                raise ConfigError(f"act_quant: {self.act_quant!r} quantizes activations per block of "
                                  f"{ACT_QUANT_BLOCK} columns; the model's {name} {width} is not a multiple of "
                                  f"{ACT_QUANT_BLOCK}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["weight_only_skip"] = list(self.weight_only_skip)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "BuildConfig":
        fields = {f.name for f in dataclasses.fields(BuildConfig)}
        unknown = set(d) - fields
        if unknown:
            raise ConfigError(f"build config: unknown fields {sorted(unknown)}")
        d = dict(d)
        if "dtype" in d:
            d["dtype"] = normalize_dtype(d["dtype"], allow_auto=True)
        if isinstance(d.get("weight_only_skip"), list):
            d["weight_only_skip"] = tuple(d["weight_only_skip"])
        return BuildConfig(**d).validated()


def default_build_config(model: ModelConfig, **overrides) -> BuildConfig:
    """Limits used when an HF checkpoint directory is served directly (no build step).

    max_seq_len = min(max_position_embeddings, 2048); max_input_len = max_seq_len - 1 (any
    prompt that leaves room for one new token); dtype float32 unless overridden (CPU matmuls
    are fastest in fp32; GPU users build an fp16/bf16 engine); the other fields as BuildConfig.
    """
    max_seq_len = overrides.pop("max_seq_len", min(model.max_position_embeddings, 2048))
    fields = dict(max_seq_len=max_seq_len, max_input_len=max(1, max_seq_len - 1), dtype="float32")
    fields.update(overrides)
    if "dtype" in fields:
        fields["dtype"] = normalize_dtype(fields["dtype"], allow_auto=True)
    if isinstance(fields.get("weight_only_skip"), list):
        fields["weight_only_skip"] = tuple(fields["weight_only_skip"])
    return BuildConfig(**fields).validated(model)


MAX_CONFIG_BYTES = 16 << 20   # config files are KiBs; the bound keeps a hostile one (/dev/zero) out of memory


def _read_bounded(name: str, what: str) -> bytes:
    """The bytes of a regular file of at most MAX_CONFIG_BYTES. O_NONBLOCK: opening a FIFO (no
    writer) returns at once and fstat refuses it, where a plain open would wait forever."""
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError(f"{what}: file not found: {name}") from None
    except OSError as e:
        raise ConfigError(f"{what}: cannot read {name}: {e}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):   # a directory, FIFO, device (/dev/zero), socket
            raise ConfigError(f"{what}: cannot read {name}: not a regular file")
        if info.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{what}: {name} is {info.st_size} bytes, over the {MAX_CONFIG_BYTES >> 20} MiB limit")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_CONFIG_BYTES + 1)   # + 1: a file that grew since fstat is still caught
    except OSError as e:
        raise ConfigError(f"{what}: cannot read {name}: {e}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{what}: {name} is over the {MAX_CONFIG_BYTES >> 20} MiB limit")
    return data


def read_json(path: str | os.PathLike, what: str) -> dict[str, Any]:
    """The JSON object in a config file, or ConfigError naming `what` and the file for anything else."""
    name = os.fspath(path)
    data = _read_bounded(name, what)
    try:
        value = json.loads(data)
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError, an integer over Python's digit limit
        raise ConfigError(f"{what}: cannot parse {name}: {str(e)[:200]}") from None
    except RecursionError:
        raise ConfigError(f"{what}: cannot parse {name}: nested too deeply") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{what}: {name} must hold a JSON object")
    return value
