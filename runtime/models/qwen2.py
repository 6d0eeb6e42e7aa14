"""Qwen2: the LLaMA mapping and weight table with q/k/v biases always on and the sliding window
only where `use_sliding_window` says so (and on every layer)."""
from __future__ import annotations

from typing import Any

from ..config import ConfigError, ModelConfig
from . import llama
from .base import Architecture, positive_int


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    if window is not None:
        max_window_layers = hf.get("max_window_layers", hf.get("num_hidden_layers"))
        if max_window_layers is not None and int(max_window_layers) < positive_int(hf, "num_hidden_layers"):
            raise ConfigError("config.json: Qwen2 sliding window on a subset of layers "
                              f"(max_window_layers={max_window_layers}) is not supported")
    return llama.config_from_hf(hf, "qwen2", qkv_bias=True,
                                sliding_window=int(window) if window is not None else None)


QWEN2 = Architecture(name="qwen2", hf_class_names=("Qwen2ForCausalLM",), variant=llama.VARIANT,
                     config_from_hf=config_from_hf, read_weights=llama.read_weights)
