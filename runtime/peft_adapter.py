"""Hugging Face PEFT LoRA adapter directories -> TensorRT-LLM's LoRA tensors (runtime.lora's format).

A directory holds `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, optional
rank_pattern / alpha_pattern) and `adapter_model.safetensors` (safetensors only: pickled
`adapter_model.bin` files are refused). Each `...layers.{l}.{parent}.{module}.lora_A/B.weight`
pair becomes one row: A [r, Hi] flattened, then B [Ho, r] * scaling flattened, where scaling is
alpha / r (alpha / sqrt(r) with use_rslora), as TensorRT-LLM's converter folds it.
"""
from __future__ import annotations

import json
import math
import os
import re

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


def _alpha(config: dict, key: str, rank: int) -> float:
    """alpha_pattern entries whose name ends the tensor's module path win over lora_alpha."""
    module_path = key.split(".lora_")[0]
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.search(rf"(^|\.){pattern}$", module_path):
            return float(alpha)
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"adapter_config.json: lora_alpha must be a number, got {alpha!r}")
    return float(alpha)


def load_peft_adapter(directory: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weights float32 [N, max_row], config int32 [N, 3]); rows ordered by (layer, module id).
    ValueError naming the file and the key for what cannot be converted."""
    from safetensors.torch import load_file

    directory = os.fspath(directory)
    config = _read_config(directory)
    path = os.path.join(directory, "adapter_model.safetensors")
    if not os.path.isfile(path):
        hint = " (adapter_model.bin is refused: safetensors only)" if os.path.isfile(
            os.path.join(directory, "adapter_model.bin")) else ""
        raise ValueError(f"{directory}: adapter_model.safetensors not found{hint}")
    tensors = load_file(path)
    pairs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise ValueError(f"adapter_model.safetensors: unsupported tensor {key!r} (expected "
                             "...layers.<l>.<parent>.<module>.lora_A/B.weight)")
        layer, parent, module, half = match.groups()
        pairs.setdefault((int(layer), _module_id(parent, module, key)), {})[half] = (key, tensor)
    if not pairs:
        raise ValueError(f"{path}: no LoRA tensors")
    rows, config_rows = [], []
    for (layer, module_id), halves in sorted(pairs.items()):
        if set(halves) != {"A", "B"}:
            raise ValueError(f"adapter_model.safetensors: layer {layer} module {module_id} lacks lora_"
                             f"{'B' if 'A' in halves else 'A'}")
        (key, a), (_, b) = halves["A"], halves["B"]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise ValueError(f"adapter_model.safetensors: {key!r}: A {list(a.shape)} and B {list(b.shape)} are "
                             "not [r, in] and [out, r]")
        alpha = _alpha(config, key, rank)
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        rows.append(torch.cat([a.float().flatten(), (b.float() * scaling).flatten()]))
        config_rows.append((module_id, layer, rank))
    width = max(r.numel() for r in rows)
    weights = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        weights[i, :row.numel()] = row
    return weights, torch.tensor(config_rows, dtype=torch.int32)
