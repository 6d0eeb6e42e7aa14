"""Hugging Face PEFT LoRA adapter directories -> TensorRT-LLM's LoRA tensors (runtime.adapters.lora's format).

A directory holds `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, optional
rank_pattern / alpha_pattern: their keys are module names or dotted module-path suffixes, matched
literally, never run as regexes) and `adapter_model.safetensors` (safetensors only: pickled
`adapter_model.bin` files are refused). Each `...layers.{l}.{parent}.{module}.lora_A/B.weight`
pair becomes one row: A [r, Hi] flattened, then B [Ho, r] * scaling flattened, where scaling is
alpha / r (alpha / sqrt(r) with use_rslora), as TensorRT-LLM's converter folds it.
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Callable

import torch

from .lora import LORA_MODULE_IDS

# HF module name -> TensorRT-LLM module name (the LLaMA family; GPT-2's Conv1D modules below).
HF_TO_TRTLLM = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_dense",
                "gate_proj": "mlp_h_to_4h", "up_proj": "mlp_gate", "down_proj": "mlp_4h_to_h",
                "c_attn": "attn_qkv", "c_fc": "mlp_h_to_4h"}
# GPT-2 names two modules c_proj; the parent tells them apart.
_GPT2_C_PROJ = {"attn": "attn_dense", "mlp": "mlp_4h_to_h"}
_KEY = re.compile(r"\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
MAX_CONFIG_BYTES = 1 << 20
# A plain alpha_pattern / rank_pattern key: a module name or a dotted module-path suffix.
_PLAIN_KEY = re.compile(r"[\w-]+(?:\.[\w-]+)*")


def _module_id(parent: str, module: str, key: str) -> int:
    name = _GPT2_C_PROJ.get(parent) if module == "c_proj" else HF_TO_TRTLLM.get(module)
    if name is None:
        raise ValueError(f"adapter_model.safetensors: tensor {key!r} targets module {module!r}; supported: "
                         f"{sorted(HF_TO_TRTLLM)} and c_proj")
    return LORA_MODULE_IDS[name]


def _read_config(directory: str) -> dict:
    path = os.path.join(directory, "adapter_config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{directory}: adapter_config.json not found")
    if os.path.getsize(path) > MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    with open(path, encoding="utf-8") as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter_config.json: peft_type {config.get('peft_type')!r}; only LORA is supported")
    for flag in ("use_dora",):
        if config.get(flag):
            raise ValueError(f"adapter_config.json: {flag}=true is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"adapter_config.json: bias={config['bias']!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise ValueError(f"adapter_config.json: modules_to_save={config['modules_to_save']!r} is not supported")
    return config


def _patterns(config: dict, field: str, is_value: Callable[[object], bool], expected: str) -> dict:
    """alpha_pattern / rank_pattern: module name (or dotted module-path suffix) -> value. PEFT runs
    the keys as regular expressions; here a key is matched literally, as a suffix at a `.`
    boundary, which is what PEFT makes of a plain key. A key with regex syntax is refused."""
    patterns = config.get(field)
    if patterns is None:
        return {}
    if not isinstance(patterns, dict):
        raise ValueError(f"adapter_config.json: {field} must be an object (module name -> value), got {patterns!r}")
    for key, value in patterns.items():
        if not _PLAIN_KEY.fullmatch(key):
            raise ValueError(f"adapter_config.json: {field} key {key!r} is not a module name or dotted module "
                             "path (regular expressions are not supported)")
        if not is_value(value):
            raise ValueError(f"adapter_config.json: {field}[{key!r}] must be {expected}, got {value!r}")
    return patterns


def _pattern_value(patterns: dict, module_path: str):
    """The value of the first key that ends `module_path` at a `.` boundary, or None."""
    for key, value in patterns.items():
        if module_path == key or module_path.endswith("." + key):
            return value
    return None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_rank(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _alpha(config: dict, alphas: dict, key: str, rank: int) -> float:
    """alpha_pattern entries whose name ends the tensor's module path win over lora_alpha."""
    alpha = _pattern_value(alphas, key.split(".lora_")[0])
    if alpha is not None:
        return float(alpha)
    alpha = config.get("lora_alpha", rank)
    if not _is_number(alpha):
        raise ValueError(f"adapter_config.json: lora_alpha must be a finite number, got {alpha!r}")
    return float(alpha)


def _load_tensors(path: str) -> dict[str, torch.Tensor]:
    """The file's tensors; ValueError naming the file for a malformed one (a header claiming
    more bytes than the file holds, say)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except SafetensorError as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None


def _factors(key: str, a: torch.Tensor, b: torch.Tensor) -> int:
    """A [r, in] and B [out, r] float tensors with r >= 1 -> r; ValueError naming the key otherwise."""
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
        raise ValueError(f"adapter_model.safetensors: {key!r}: A {list(a.shape)} and B {list(b.shape)} are "
                         "not [r, in] and [out, r]")
    if not (a.dtype.is_floating_point and b.dtype.is_floating_point):
        raise ValueError(f"adapter_model.safetensors: {key!r}: expected float tensors, got {a.dtype} and {b.dtype}")
    if a.shape[0] == 0:
        raise ValueError(f"adapter_model.safetensors: {key!r}: rank 0 (A {list(a.shape)}); a LoRA rank is >= 1")
    return a.shape[0]


def load_peft_adapter(directory: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weights float32 [N, max_row], config int32 [N, 3]); rows ordered by (layer, module id).
    ValueError naming the file and the key for what cannot be converted."""
    directory = os.fspath(directory)
    config = _read_config(directory)
    alphas = _patterns(config, "alpha_pattern", _is_number, "a finite number")
    _patterns(config, "rank_pattern", _is_rank, "a positive integer")   # the ranks come from the tensors
    path = os.path.join(directory, "adapter_model.safetensors")
    if not os.path.isfile(path):
        hint = " (adapter_model.bin is refused: safetensors only)" if os.path.isfile(
            os.path.join(directory, "adapter_model.bin")) else ""
        raise ValueError(f"{directory}: adapter_model.safetensors not found{hint}")
    pairs = _pairs(_load_tensors(path))
    if not pairs:
        raise ValueError(f"{path}: no LoRA tensors")
    rows, config_rows = [], []
    for (layer, module_id), halves in sorted(pairs.items()):
        if set(halves) != {"A", "B"}:
            raise ValueError(f"adapter_model.safetensors: layer {layer} module {module_id} lacks lora_"
                             f"{'B' if 'A' in halves else 'A'}")
        (key, a), (_, b) = halves["A"], halves["B"]
        rank = _factors(key, a, b)
        alpha = _alpha(config, alphas, key, rank)
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        rows.append(torch.cat([a.float().flatten(), (b.float() * scaling).flatten()]))
        config_rows.append((module_id, layer, rank))
    width = max(r.numel() for r in rows)
    weights = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        weights[i, :row.numel()] = row
    return weights, torch.tensor(config_rows, dtype=torch.int32)


def _pairs(tensors: dict[str, torch.Tensor]) -> dict[tuple[int, int], dict[str, tuple[str, torch.Tensor]]]:
    """(layer, module id) -> {"A": (key, tensor), "B": (key, tensor)}."""
    pairs: dict[tuple[int, int], dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise ValueError(f"adapter_model.safetensors: unsupported tensor {key!r} (expected "
                             "...layers.<l>.<parent>.<module>.lora_A/B.weight)")
        layer, parent, module, half = match.groups()
        pairs.setdefault((int(layer), _module_id(parent, module, key)), {})[half] = (key, tensor)
    return pairs
