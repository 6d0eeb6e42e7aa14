"""LoRA adapters in TensorRT-LLM's tensor format, converted for the model's fused linears.

The format (TensorRT-LLM's LoraManager / HF converter): `config` int32 [N, 3], one row per
(module, layer): (module_id, layer_idx, adapter_size r); `weights` [N, W], row i the flattened
in-matrix A [r, Hi] then the flattened out-matrix B [Ho, r], with the PEFT scaling (alpha / r, or
alpha / sqrt(r) with rsLoRA) already folded into B; rows are zero-padded at the end to the longest.

The model fuses q/k/v into one `qkv` linear and gate/up into one `mlp_in` linear; a module adds
its B A x to a column range of one of the four linears of a layer (`LoraModule`). An adapter is
kept per linear as one concatenated A [R, Hi] and a block-placed B [Ho_linear, R] (zeros outside
each module's block), so one linear costs two matmuls per adapter whatever its modules. The
runtime's store of resident adapters and the per-step computation: runtime.adapters.lora_step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig

# TensorRT-LLM's module ids (LoraManager.LORA_MODULE_IDS, the ones a decoder-only model has).
LORA_MODULE_IDS = {"attn_qkv": 0, "attn_q": 1, "attn_k": 2, "attn_v": 3, "attn_dense": 4,
                   "mlp_h_to_4h": 5, "mlp_4h_to_h": 6, "mlp_gate": 7}
MODULE_NAMES = {v: k for k, v in LORA_MODULE_IDS.items()}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class LoraModule:
    """Where a module's B A x goes: columns [out_offset, out_offset + out_features) of `linear`."""
    name: str
    linear: str          # "qkv" | "out" | "mlp_in" | "mlp_out" (the layer's fused linears)
    in_features: int     # Hi
    out_features: int    # Ho
    out_offset: int


def lora_modules(cfg: ModelConfig) -> dict[int, LoraModule]:
    """module id -> LoraModule for this model. Gated MLPs follow TensorRT-LLM's mapping: mlp_h_to_4h
    is HF's gate_proj (the first half of mlp_in), mlp_gate is up_proj (the second half),
    mlp_4h_to_h is down_proj; a plain MLP (GPT-2's c_fc / c_proj) has no mlp_gate."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    modules = [LoraModule("attn_qkv", "qkv", h, q + 2 * kv, 0), LoraModule("attn_q", "qkv", h, q, 0),
               LoraModule("attn_k", "qkv", h, kv, q), LoraModule("attn_v", "qkv", h, kv, q + kv),
               LoraModule("attn_dense", "out", q, h, 0), LoraModule("mlp_h_to_4h", "mlp_in", h, i, 0),
               LoraModule("mlp_4h_to_h", "mlp_out", i, h, 0)]
    if cfg.mlp_type == "gated":
        modules.append(LoraModule("mlp_gate", "mlp_in", h, i, i))
    return {LORA_MODULE_IDS[m.name]: m for m in modules}


class LoraAdapter:
    """One adapter's factors per linear: `factors[f"layers.{l}.{linear}"] = (A [R, Hi], B [Ho, R])`
    (`Transformer` names its linears so). Immutable once built; `to` returns a copy."""

    def __init__(self, factors: dict[str, tuple[torch.Tensor, torch.Tensor]], num_rows: int, num_bytes: int,
                 ranks: tuple[int, ...]):
        self.factors = factors
        self.num_rows = num_rows      # (module, layer) rows of its config
        self.num_bytes = num_bytes    # bytes of its A and B values in the format's dtype
        self.ranks = ranks            # adapter size of each row

    def to(self, device: torch.device, dtype: torch.dtype) -> "LoraAdapter":
        factors = {k: (a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())
                   for k, (a, b) in self.factors.items()}
        return LoraAdapter(factors, self.num_rows, self.num_bytes, self.ranks)


def _squeeze_batch(t: torch.Tensor, dims: int) -> torch.Tensor:
    """[1, ...] (a request tensor with its batch dimension) -> [...]."""
    return t[0] if t.dim() == dims + 1 and t.shape[0] == 1 else t


def adapter_from_tensors(weights, config, cfg: ModelConfig, max_adapter_size: int,
                         names: tuple[str, str] = ("lora_weights", "lora_config")) -> LoraAdapter:
    """weights [N, W] (or [1, N, W]) float, config [N, 3] (or [1, N, 3]) int -> LoraAdapter (CPU,
    float32). ValueError naming the field (`names`: how the user calls weights and config) and the
    value for a module or layer the model does not have, a size of 0 or above max_adapter_size, a
    row shorter than its module needs, a repeated (module, layer), a non-float dtype, a tensor on
    the meta device."""
    w_name, c_name = names
    if not isinstance(weights, torch.Tensor) or not isinstance(config, torch.Tensor):
        raise ValueError(f"{w_name} / {c_name}: expected torch tensors, got {type(weights).__name__} and "
                         f"{type(config).__name__}")
    for name, t in ((w_name, weights), (c_name, config)):
        if t.device.type == "meta":
            raise ValueError(f"{name}: a tensor on the meta device (no values), shape {list(t.shape)}")
    if weights.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{w_name}: expected float32, float16 or bfloat16, got {weights.dtype}")
    if config.dtype.is_floating_point or config.dtype.is_complex or config.dtype == torch.bool:
        raise ValueError(f"{c_name}: expected an int32 tensor, got {config.dtype}")
    weights, config = _squeeze_batch(weights, 2), _squeeze_batch(config, 2)
    if config.dim() != 2 or config.shape[1] != 3 or config.shape[0] == 0:
        raise ValueError(f"{c_name}: expected shape [N, 3] with N >= 1, got {list(config.shape)}")
    if weights.dim() != 2 or weights.shape[0] != config.shape[0]:
        raise ValueError(f"{w_name}: expected shape [{config.shape[0]}, W] (one row per {c_name} row), "
                         f"got {list(weights.shape)}")
    weights = weights.detach().to("cpu")
    if not bool(torch.isfinite(weights).all()):
        raise ValueError(f"{w_name}: must be finite (NaN or inf found)")
    modules, width = lora_modules(cfg), weights.shape[1]
    seen: set[tuple[int, int]] = set()
    per_linear: dict[str, list[tuple[LoraModule, torch.Tensor, torch.Tensor]]] = {}
    num_bytes, ranks = 0, []
    for i, (module_id, layer, rank) in enumerate(config.tolist()):
        module = modules.get(module_id)
        if module is None:
            known = MODULE_NAMES.get(module_id, "unknown")
            raise ValueError(f"{c_name}: row {i} names module {module_id} ({known}), which this "
                             f"{cfg.architecture} model does not have; supported: "
                             f"{ {m.name: k for k, m in sorted(modules.items())} }")
        if not 0 <= layer < cfg.num_layers:
            raise ValueError(f"{c_name}: row {i} names layer {layer}; the model has layers [0, {cfg.num_layers})")
        if not 1 <= rank <= max_adapter_size:
            raise ValueError(f"{c_name}: row {i} has adapter size {rank}, outside [1, max_adapter_size="
                             f"{max_adapter_size}]")
        if (module_id, layer) in seen:
            raise ValueError(f"{c_name}: row {i} repeats module {module_id} ({module.name}) of layer {layer}")
        seen.add((module_id, layer))
        hi, ho = module.in_features, module.out_features
        need = rank * (hi + ho)
        if width < need:
            raise ValueError(f"{w_name}: row {i} has {width} values; {module.name} of rank {rank} needs "
                             f"{rank} * ({hi} + {ho}) = {need}")
        row = weights[i].float()
        a, b = row[:rank * hi].view(rank, hi), row[rank * hi:need].view(ho, rank)
        per_linear.setdefault(f"layers.{layer}.{module.linear}", []).append((module, a, b))
        num_bytes += need * weights.element_size()
        ranks.append(rank)
    factors = {}
    for prefix, parts in per_linear.items():
        parts.sort(key=lambda p: p[0].out_offset)
        a_cat = torch.cat([a for _, a, _ in parts])                     # [R, Hi]
        linear_out = _linear_out_features(cfg, parts[0][0].linear)
        b_cat = torch.zeros(linear_out, a_cat.shape[0])                 # [Ho_linear, R]
        r0 = 0
        for module, a, b in parts:
            b_cat[module.out_offset:module.out_offset + module.out_features, r0:r0 + a.shape[0]] = b
            r0 += a.shape[0]
        factors[prefix] = (a_cat, b_cat)
    return LoraAdapter(factors, config.shape[0], num_bytes, tuple(ranks))


def _linear_out_features(cfg: ModelConfig, linear: str) -> int:
    i = cfg.intermediate_size
    return {"qkv": cfg.q_size + 2 * cfg.kv_size, "out": cfg.hidden_size,
            "mlp_in": 2 * i if cfg.mlp_type == "gated" else i, "mlp_out": cfg.hidden_size}[linear]

