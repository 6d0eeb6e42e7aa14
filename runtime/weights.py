"""Weights: read safetensors checkpoints (HF layouts or our engine layout) into canonical tensors.

Canonical names (what the model uses; engine directories store exactly these):
  embed_tokens [V, H]; position_embeddings [P, H] (learned positions only);
  embed_norm.{weight,bias} [H] (embedding_norm only);
  layers.{i}.input_norm.{weight,bias}; layers.{i}.qkv.{weight,bias} [q + 2 kv, H] (fused: all query
  heads, then all key heads, then all value heads); layers.{i}.out.{weight,bias} [H, q];
  layers.{i}.post_norm.{weight,bias} (absent with a parallel residual sharing one norm);
  layers.{i}.mlp_in.{weight,bias} [I or 2 I (gate then up), H]; layers.{i}.mlp_out.{weight,bias} [H, I];
  final_norm.{weight,bias}; lm_head [V, H] (absent when tied to embed_tokens); lm_head.bias [V]
  (lm_head_bias only, tied or not).
Weights come from safetensors only: pickle files are never opened. Each architecture's reader
(runtime.models) maps its HF names onto these.
"""
from __future__ import annotations

import glob
import os
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from .config import ModelConfig, read_json

Weights = dict[str, torch.Tensor]
# Reads a checkpoint's tensors under the canonical names; one per architecture (runtime.models).
WeightReader = Callable[["TensorSource", ModelConfig], Weights]


class WeightError(ValueError):
    """A missing, misshaped or unreadable weight; the message names the tensor."""


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qkv = cfg.q_size + 2 * cfg.kv_size
    has_norm_bias = cfg.norm_type == "layernorm"
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens": (v, h), "final_norm.weight": (h,)}
    if has_norm_bias:
        shapes["final_norm.bias"] = (h,)
    if cfg.position_embedding == "learned":
        shapes["position_embeddings"] = (cfg.max_position_embeddings, h)
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (v, h)
    if cfg.lm_head_bias:
        shapes["lm_head.bias"] = (v,)
    if cfg.embedding_norm:
        shapes["embed_norm.weight"] = (h,)
        if has_norm_bias:
            shapes["embed_norm.bias"] = (h,)
    mlp_in = 2 * i if cfg.mlp_type == "gated" else i
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}."
        norms = ("input_norm", "post_norm") if cfg.has_post_norm else ("input_norm",)
        for norm in norms:
            shapes[p + norm + ".weight"] = (h,)
            if has_norm_bias:
                shapes[p + norm + ".bias"] = (h,)
        shapes[p + "qkv.weight"] = (qkv, h)
        shapes[p + "out.weight"] = (h, cfg.q_size)
        shapes[p + "mlp_in.weight"] = (mlp_in, h)
        shapes[p + "mlp_out.weight"] = (h, i)
        if cfg.qkv_bias:
            shapes[p + "qkv.bias"] = (qkv,)
        if cfg.out_bias:
            shapes[p + "out.bias"] = (h,)
        if cfg.mlp_bias:
            shapes[p + "mlp_in.bias"] = (mlp_in,)
            shapes[p + "mlp_out.bias"] = (h,)
    return shapes


class TensorSource:
    """Lazy access to the tensors of one or more safetensors files, by name."""

    def __init__(self, directory: str):
        self.directory = directory
        self.name_to_file: dict[str, str] = {}
        index_path = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index_path):
            weight_map = read_json(index_path, "model.safetensors.index.json").get("weight_map")
            if not isinstance(weight_map, dict):
                raise WeightError(f"{index_path}: missing 'weight_map'")
            for name, file in weight_map.items():
                path = os.path.join(directory, os.path.basename(str(file)))
                self.name_to_file[name] = path
        else:
            files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
            if not files:
                pickles = [f for f in os.listdir(directory) if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
                hint = (f" (found {', '.join(sorted(pickles))}: pickle checkpoints are never loaded; "
                        "convert them to safetensors)") if pickles else ""
                raise WeightError(f"{directory}: no *.safetensors weights{hint}")
            for path in files:
                for name in self._open(path).keys():
                    self.name_to_file[name] = path
        self._handles: dict[str, object] = {}

    def _open(self, path: str):
        try:
            return safe_open(path, framework="pt")
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise WeightError(f"{path}: not a readable safetensors file: {e}") from None

    def names(self) -> set[str]:
        return set(self.name_to_file)

    def get(self, name: str) -> torch.Tensor:
        path = self.name_to_file.get(name)
        if path is None:
            raise WeightError(f"missing tensor {name!r} in {self.directory}")
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = self._open(path)
        try:
            return handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise WeightError(f"tensor {name!r} in {path}: cannot read: {e}") from None


def per_head_qkv(tensor: torch.Tensor, num_heads: int, head_dim: int, name: str, directory: str) -> torch.Tensor:
    """A fused QKV weight [num_heads * 3 * head_dim, ...] (or bias) laid out per head as [q_h, k_h, v_h]
    (GPT-NeoX, BLOOM, Falcon without multi-query) -> the canonical [all q, all k, all v] rows."""
    if tensor.shape[0] != 3 * num_heads * head_dim:
        raise WeightError(f"{directory}: tensor {name!r} has shape {list(tensor.shape)}, expected "
                          f"{3 * num_heads * head_dim} rows from the config")
    rest = tensor.shape[1:]
    return tensor.reshape(num_heads, 3, head_dim, *rest).transpose(0, 1).reshape(3 * num_heads * head_dim, *rest)


def fused(src: TensorSource, name_to_shape: dict[str, tuple[int, ...]]) -> torch.Tensor:
    """Concatenate HF tensors along dim 0 (fused q/k/v, gate/up), naming any misshaped part."""
    parts = []
    for name, shape in name_to_shape.items():
        tensor = src.get(name)
        if tuple(tensor.shape) != shape:
            raise WeightError(f"{src.directory}: tensor {name!r} has shape {list(tensor.shape)}, "
                              f"expected {list(shape)} from the config")
        parts.append(tensor)
    return torch.cat(parts)


def _checked(weights: Weights, cfg: ModelConfig, dtype: torch.dtype, where: str) -> Weights:
    """Check every canonical tensor's presence and shape, convert to `dtype`."""
    shapes = expected_shapes(cfg)
    out: Weights = {}
    for name, shape in shapes.items():
        tensor = weights.get(name)
        if tensor is None:
            raise WeightError(f"{where}: missing tensor {name!r}")
        if tuple(tensor.shape) != shape:
            raise WeightError(f"{where}: tensor {name!r} has shape {list(tensor.shape)}, "
                              f"expected {list(shape)} from the config")
        if not tensor.is_floating_point():
            raise WeightError(f"{where}: tensor {name!r} has dtype {tensor.dtype}, expected floating point")
        out[name] = tensor.to(dtype).contiguous()
    return out


def load_hf_weights(directory: str, cfg: ModelConfig, dtype: torch.dtype, read: WeightReader) -> Weights:
    raw = read(TensorSource(directory), cfg)
    return _checked(raw, cfg, dtype, directory)


def load_engine_weights(path: str, cfg: ModelConfig, dtype: torch.dtype) -> Weights:
    src = TensorSource(os.path.dirname(path))
    return _checked({name: src.get(name) for name in expected_shapes(cfg) if name in src.names()},
                    cfg, dtype, path)
