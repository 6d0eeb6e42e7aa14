"""What an architecture entry is, and the readers of HF `config.json` fields the entries share.

An entry maps a checkpoint's config onto ModelConfig and its tensor names onto the canonical ones
(runtime.loading.weights); the shared model code sees only the resulting variant fields.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..config import ConfigError, ModelConfig, RopeConfig
from ..loading.weights import WeightReader


@dataclass(frozen=True)
class Architecture:
    name: str                        # ModelConfig.architecture and the HF `model_type` it reads
    hf_class_names: tuple[str, ...]  # HF `architectures` entries it reads, e.g. "LlamaForCausalLM"
    # ModelConfig field -> value that every config of this architecture has. config_from_hf sets
    # them; an engine.json written before a variant field existed takes it from here.
    variant: Mapping[str, Any]
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]  # raises ConfigError naming the field
    read_weights: WeightReader       # HF tensor names -> canonical names (shapes checked after)


def positive_int(hf: dict[str, Any], key: str, *alternatives: str) -> int:
    """The first of `key`, `alternatives` that is set, or ConfigError naming it."""
    found = next((k for k in (key, *alternatives) if hf.get(k) is not None), None)
    if found is None:
        raise ConfigError(f"config.json: missing field {key!r}")
    value = hf[found]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config.json: {found} must be a positive integer, got {value!r}")
    return value


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def token_ids(hf: dict[str, Any]) -> dict[str, int | None]:
    """The bos / eos / pad ids of ModelConfig (the first of a list)."""
    return {name: _first_id(hf.get(name)) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}


def _rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    # transformers < 5 writes rope_theta + rope_scaling; >= 5 writes rope_parameters.
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and len(params) and \
            all(isinstance(v, dict) for v in params.values()):
        raise ConfigError("rope_parameters: per-layer-type rope parameters are not supported")
    return dict(params) if isinstance(params, dict) else dict(hf.get("rope_scaling") or {})


def positive_number(value: Any, key: str) -> float:
    """`value` as a float, or ConfigError naming `key` unless it is a finite number > 0."""
    try:
        number = None if isinstance(value, bool) else float(value)
    except OverflowError:   # an int too large for a float
        number = math.inf
    except (TypeError, ValueError):
        number = None
    if number is None or not math.isfinite(number) or number <= 0:
        raise ConfigError(f"config.json: {key} must be a finite number > 0, got {value!r}"[:300])
    return number


def rotary_fraction_from_hf(hf: dict[str, Any], *legacy_keys: str, default: float = 1.0) -> float:
    """The share of head_dim that rotates: rope_parameters' partial_rotary_factor (transformers >= 5),
    else the top-level `partial_rotary_factor` or one of `legacy_keys` (e.g. GPT-NeoX's rotary_pct),
    else the architecture's `default`."""
    keys = ("partial_rotary_factor", *legacy_keys)
    value = _rope_parameters(hf).get("partial_rotary_factor")
    name = "rope_parameters.partial_rotary_factor"
    if value is None:
        name = next((k for k in keys if hf.get(k) is not None), keys[0])
        value = hf.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
        raise ConfigError(f"config.json: {name} must be in (0, 1], got {value!r}")
    return float(value)


def rope_from_hf(hf: dict[str, Any], *legacy_theta_keys: str) -> RopeConfig:
    """Theta and scaling of the rotary embedding; `legacy_theta_keys` name older spellings of
    rope_theta (e.g. GPT-NeoX's rotary_emb_base). The rotated share is rotary_fraction_from_hf's.
    A theta or factor that is not a finite number > 0 (0, NaN, inf) is a ConfigError naming the key."""
    scaling = _rope_parameters(hf)
    section = "rope_parameters" if isinstance(hf.get("rope_parameters"), dict) else "rope_scaling"
    theta_key = next((k for k in ("rope_theta", *legacy_theta_keys) if hf.get(k) is not None), None)
    theta = hf[theta_key] if theta_key is not None else 10000.0
    if "rope_theta" in scaling:
        theta_key, theta = f"{section}.rope_theta", scaling["rope_theta"]
    theta = positive_number(theta, theta_key or "rope_theta")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "freq_factors":   # not a transformers type: what runtime.loading.gguf_archs maps rope_freqs to
        return RopeConfig(theta=theta, scaling_type="freq_factors", freq_factors=tuple(map(float, scaling["factors"])))
    factor = positive_number(scaling.get("factor", 1.0), f"{section}.factor")
    if kind == "linear":
        return RopeConfig(theta=theta, scaling_type="linear", factor=factor)
    if kind == "llama3":
        return RopeConfig(theta=theta, scaling_type="llama3", factor=factor,
                          low_freq_factor=positive_number(scaling.get("low_freq_factor", 1.0),
                                                          f"{section}.low_freq_factor"),
                          high_freq_factor=positive_number(scaling.get("high_freq_factor", 4.0),
                                                           f"{section}.high_freq_factor"),
                          original_max_position_embeddings=int(positive_number(
                              scaling.get("original_max_position_embeddings", 8192),
                              f"{section}.original_max_position_embeddings")))
    raise ConfigError(f"rope_scaling: unsupported type {kind!r}; supported: default, linear, llama3")
