"""Weights: read safetensors checkpoints (HF layouts or our engine layout) into canonical tensors.

Canonical names (what the model uses; engine directories store exactly these):
  embed_tokens [V, H]; position_embeddings [P, H] (learned positions only);
  layers.{i}.input_norm.{weight,bias}; layers.{i}.qkv.{weight,bias} [q + 2 kv, H] (fused);
  layers.{i}.out.{weight,bias} [H, q]; layers.{i}.post_norm.{weight,bias};
  layers.{i}.mlp_in.{weight,bias} [I or 2 I (gate then up), H]; layers.{i}.mlp_out.{weight,bias} [H, I];
  final_norm.{weight,bias}; lm_head [V, H] (absent when tied to embed_tokens).
Weights come from safetensors only: pickle files are never opened.
"""
from __future__ import annotations

import glob
import os
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from .config import ConfigError, ModelConfig, read_json

Weights = dict[str, torch.Tensor]


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
    mlp_in = 2 * i if cfg.mlp_type == "gated" else i
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}."
        shapes[p + "input_norm.weight"] = (h,)
        shapes[p + "post_norm.weight"] = (h,)
        if has_norm_bias:
            shapes[p + "input_norm.bias"] = (h,)
            shapes[p + "post_norm.bias"] = (h,)
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


class _TensorSource:
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


def _hf_gpt2(src: _TensorSource, cfg: ModelConfig) -> Weights:
    prefix = "transformer." if "transformer.wte.weight" in src.names() else ""

    def get(name: str) -> torch.Tensor:
        return src.get(prefix + name)

    def conv1d(name: str) -> torch.Tensor:  # GPT-2's Conv1D stores [in, out]
        tensor = get(name)
        if tensor.dim() != 2:
            raise WeightError(f"{src.directory}: tensor {prefix + name!r} has shape {list(tensor.shape)}, "
                              "expected a 2-D [in, out] Conv1D weight")
        return tensor.t().contiguous()

    w: Weights = {"embed_tokens": get("wte.weight"), "position_embeddings": get("wpe.weight"),
                  "final_norm.weight": get("ln_f.weight"), "final_norm.bias": get("ln_f.bias")}
    for layer in range(cfg.num_layers):
        p, q = f"h.{layer}.", f"layers.{layer}."
        w[q + "input_norm.weight"], w[q + "input_norm.bias"] = get(p + "ln_1.weight"), get(p + "ln_1.bias")
        w[q + "post_norm.weight"], w[q + "post_norm.bias"] = get(p + "ln_2.weight"), get(p + "ln_2.bias")
        w[q + "qkv.weight"], w[q + "qkv.bias"] = conv1d(p + "attn.c_attn.weight"), get(p + "attn.c_attn.bias")
        w[q + "out.weight"], w[q + "out.bias"] = conv1d(p + "attn.c_proj.weight"), get(p + "attn.c_proj.bias")
        w[q + "mlp_in.weight"], w[q + "mlp_in.bias"] = conv1d(p + "mlp.c_fc.weight"), get(p + "mlp.c_fc.bias")
        w[q + "mlp_out.weight"], w[q + "mlp_out.bias"] = conv1d(p + "mlp.c_proj.weight"), get(p + "mlp.c_proj.bias")
    if not cfg.tie_word_embeddings:
        w["lm_head"] = src.get("lm_head.weight")
    return w


def _cat(src: _TensorSource, name_to_shape: dict[str, tuple[int, ...]]) -> torch.Tensor:
    """Concatenate HF tensors along dim 0 (fused q/k/v, gate/up), naming any misshaped part."""
    parts = []
    for name, shape in name_to_shape.items():
        tensor = src.get(name)
        if tuple(tensor.shape) != shape:
            raise WeightError(f"{src.directory}: tensor {name!r} has shape {list(tensor.shape)}, "
                              f"expected {list(shape)} from the config")
        parts.append(tensor)
    return torch.cat(parts)


def _hf_llama(src: _TensorSource, cfg: ModelConfig) -> Weights:
    """LLaMA, Mistral and Qwen2 share one naming scheme."""
    get = src.get
    h, i = cfg.hidden_size, cfg.intermediate_size
    qkv_rows = {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size}
    w: Weights = {"embed_tokens": get("model.embed_tokens.weight"), "final_norm.weight": get("model.norm.weight")}
    for layer in range(cfg.num_layers):
        p, q = f"model.layers.{layer}.", f"layers.{layer}."
        w[q + "input_norm.weight"] = get(p + "input_layernorm.weight")
        w[q + "post_norm.weight"] = get(p + "post_attention_layernorm.weight")
        attn = p + "self_attn."
        w[q + "qkv.weight"] = _cat(src, {attn + f"{x}_proj.weight": (n, h) for x, n in qkv_rows.items()})
        if cfg.qkv_bias:
            w[q + "qkv.bias"] = _cat(src, {attn + f"{x}_proj.bias": (n,) for x, n in qkv_rows.items()})
        w[q + "out.weight"] = get(attn + "o_proj.weight")
        if cfg.out_bias:
            w[q + "out.bias"] = get(attn + "o_proj.bias")
        w[q + "mlp_in.weight"] = _cat(src, {p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h)})
        w[q + "mlp_out.weight"] = get(p + "mlp.down_proj.weight")
        if cfg.mlp_bias:
            w[q + "mlp_in.bias"] = _cat(src, {p + "mlp.gate_proj.bias": (i,), p + "mlp.up_proj.bias": (i,)})
            w[q + "mlp_out.bias"] = get(p + "mlp.down_proj.bias")
    if not cfg.tie_word_embeddings:
        w["lm_head"] = get("lm_head.weight")
    return w


HF_WEIGHT_READERS: dict[str, Callable[[_TensorSource, ModelConfig], Weights]] = {
    "gpt2": _hf_gpt2, "llama": _hf_llama, "mistral": _hf_llama, "qwen2": _hf_llama}


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


def load_hf_weights(directory: str, cfg: ModelConfig, dtype: torch.dtype) -> Weights:
    raw = HF_WEIGHT_READERS[cfg.architecture](_TensorSource(directory), cfg)
    return _checked(raw, cfg, dtype, directory)


def load_engine_weights(path: str, cfg: ModelConfig, dtype: torch.dtype) -> Weights:
    src = _TensorSource(os.path.dirname(path))
    return _checked({name: src.get(name) for name in expected_shapes(cfg) if name in src.names()},
                    cfg, dtype, path)
