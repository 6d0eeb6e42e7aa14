"""The architecture registry: name / HF `model_type` / HF `architectures` -> `Architecture`.

Holds the built-in entries (GPT-2, LLaMA, Mistral, Qwen2, GPT-J, GPT-NeoX, BLOOM, Falcon, Phi, Phi-3)
and any registered later; engine loading and `ModelConfig.from_dict` look entries up here, so adding
an architecture is one new module.
"""
from __future__ import annotations

from typing import Any

from ..config import ConfigError, ModelConfig
from .base import Architecture
from .bloom import BLOOM
from .falcon import FALCON
from .gpt2 import GPT2
from .gpt_neox import GPT_NEOX
from .gptj import GPTJ
from .llama import LLAMA, MISTRAL, QWEN2, QWEN3
from .phi import PHI, PHI3

_NAME_TO_ARCHITECTURE: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    """Add an entry; its name and HF class names must be new."""
    for other in _NAME_TO_ARCHITECTURE.values():
        if other.name == arch.name:
            raise ValueError(f"name: architecture {arch.name!r} is already registered")
        shared = set(other.hf_class_names) & set(arch.hf_class_names)
        if shared:
            raise ValueError(f"hf_class_names: {sorted(shared)} already read by {other.name!r}")
    _NAME_TO_ARCHITECTURE[arch.name] = arch
    return arch


def unregister(name: str) -> None:
    if _NAME_TO_ARCHITECTURE.pop(name, None) is None:
        raise ValueError(f"name: architecture {name!r} is not registered")


def supported_architectures() -> tuple[str, ...]:
    return tuple(_NAME_TO_ARCHITECTURE)


def lookup(name: Any) -> Architecture:
    """The entry for ModelConfig.architecture `name`, or ConfigError naming it."""
    arch = _NAME_TO_ARCHITECTURE.get(name) if isinstance(name, str) else None
    if arch is None:
        raise ConfigError(f"architecture: unsupported {name!r}; supported: {', '.join(_NAME_TO_ARCHITECTURE)}")
    return arch


def lookup_hf(hf: dict[str, Any]) -> Architecture:
    """The entry for a config.json: by `model_type`, else by a class name in `architectures`."""
    model_type, class_names = hf.get("model_type"), hf.get("architectures")
    if isinstance(model_type, str) and model_type in _NAME_TO_ARCHITECTURE:
        return _NAME_TO_ARCHITECTURE[model_type]
    for arch in _NAME_TO_ARCHITECTURE.values():
        if isinstance(class_names, list) and set(arch.hf_class_names) & set(map(str, class_names)):
            return arch
    raise ConfigError(f"config.json: unsupported architecture (model_type={model_type!r}, "
                      f"architectures={class_names!r}); supported: {', '.join(_NAME_TO_ARCHITECTURE)}")


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Map a transformers `config.json` onto ModelConfig, or raise ConfigError naming the field."""
    return lookup_hf(hf).config_from_hf(hf)


def model_config_from_dict(d: dict[str, Any]) -> ModelConfig:
    """engine.json's "model" object -> ModelConfig; a variant field that the file predates takes
    the value its architecture's entry fixes (ConfigError naming an unknown architecture)."""
    if not isinstance(d, dict):
        raise ConfigError(f"model config: expected an object, got {type(d).__name__}")
    return ModelConfig.from_dict({**lookup(d.get("architecture")).variant, **d})


for _arch in (GPT2, LLAMA, MISTRAL, QWEN2, QWEN3, GPTJ, GPT_NEOX, BLOOM, FALCON, PHI, PHI3):
    register(_arch)
