"""A weight-only build's canonical weights (`W`: `layers.0.qkv.weight`, `lm_head`, a tied
`embed_tokens`; norms and biases stay in the compute dtype): which are stored quantized, their
layout, quantization at load, and the row operations the model runs on them, each asking the
weight's format (registry.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import BuildConfig, ModelConfig
from ..loading.weights import StoredLayout, Weights, expected_shapes
from .registry import lookup_build, lookup_stored

_LINEAR_SUFFIXES = (".qkv.weight", ".out.weight", ".mlp_in.weight", ".mlp_out.weight")


def quantized_names(cfg: ModelConfig, build: BuildConfig) -> list[str]:
    """The canonical weights stored quantized under `build` (none without weight_only)."""
    if build.weight_only is None:
        return []
    names = [name for name in expected_shapes(cfg) if name.endswith(_LINEAR_SUFFIXES)]
    if "lm_head" not in build.weight_only_skip:
        names.append("embed_tokens" if cfg.tie_word_embeddings else "lm_head")
    return names


def stored_layout(cfg: ModelConfig, build: BuildConfig) -> StoredLayout:
    """name -> (dtype, shape) of every quantized tensor (weights and their parts) an engine stores."""
    weight_format, shapes, layout = lookup_build(build.weight_only), expected_shapes(cfg), {}
    for name in quantized_names(cfg, build):
        out, width = shapes[name]
        for suffix, dtype_shape in weight_format.stored_layout(out, width, build.group_size).items():
            layout[name + suffix] = dtype_shape
    return layout


def quantize_weights(weights: Weights, cfg: ModelConfig, build: BuildConfig) -> Weights:
    """`weights` (whole, in the compute dtype) with the matmul weights quantized under `build`."""
    weight_format, out = lookup_build(build.weight_only), dict(weights)
    for name in quantized_names(cfg, build):
        if name in weights:   # else another pipeline stage's
            stored = weight_format.quantize(weights[name], build.group_size)
            out.update(zip((name, *(name + suffix for suffix in weight_format.suffixes)), stored))
    return out


def is_quantized(weights: Weights, name: str) -> bool:
    return lookup_stored(weights, name) is not None


def stored_parts(weights: Weights, name: str) -> tuple[torch.Tensor, ...]:
    """(W, *parts) of the quantized weight `name`, in its format's order."""
    return (weights[name], *(weights[name + suffix] for suffix in lookup_stored(weights, name).suffixes))


def padded_rows(weights: Weights, name: str, num_rows: int) -> Weights:
    """`name` and its parts (when quantized) with `num_rows` zero rows appended: rows that compute
    0 (a rank's lm_head padded to the vocabulary chunk)."""
    weight_format = lookup_stored(weights, name)
    parts = [name] + ([] if weight_format is None else [name + suffix for suffix in weight_format.suffixes])
    return {part: F.pad(weights[part], (0, 0) * (weights[part].dim() - 1) + (0, num_rows)) for part in parts}

