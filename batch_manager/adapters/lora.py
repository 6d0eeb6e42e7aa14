"""LoRA on the manager's side: the PEFT cache's configuration and sizing, the conversion of a
request's LoRA tensors into an `AdapterRef` for the cache, and the PEFT directory loader."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from runtime.adapters.lora import adapter_from_tensors, lora_modules
from runtime.adapters.peft_adapter import load_peft_adapter
from runtime.config import ModelConfig

from .peft_cache import AdapterRef, PeftCache

__all__ = ["PeftCacheManagerConfig", "load_peft_adapter", "make_peft_cache", "adapter_ref", "MAX_TASK_ID"]

DEFAULT_HOST_CACHE_BYTES = 1 << 30
# Task ids travel to the runtime as int64 (-1: none), so they stay below 2**63.
MAX_TASK_ID = (1 << 63) - 1


@dataclass
class PeftCacheManagerConfig:
    """Bounds of the PEFT cache (TensorRT-LLM's PeftCacheManagerConfig).

    host_cache_size: bytes of adapter weights kept for later id-only requests (default 1 GiB);
    num_host_module_layer, when non-zero, bounds the host cache in (module, layer) rows instead.
    Device rows: a row holds one (module, layer) of rank up to optimal_adapter_size (a module of
    rank r takes ceil(r / optimal_adapter_size) rows); num_device_module_layer, when non-zero, is
    the number of rows, else device_cache_percent of the memory the KV pool is sized from (free
    GPU memory; on CPU the host KV budget, batch_manager.scheduling.kv_sizing) divided by the bytes of the
    model's largest row. max_adapter_size: larger ranks are refused."""
    host_cache_size: int | None = None
    num_host_module_layer: int = 0
    num_device_module_layer: int = 0
    device_cache_percent: float | None = None   # None = 0.05
    max_adapter_size: int = 64
    optimal_adapter_size: int = 8
    num_put_workers: int = 1        # accepted for source compatibility
    num_ensure_workers: int = 1     # accepted for source compatibility
    num_copy_streams: int = 1       # accepted for source compatibility


def _check(config: PeftCacheManagerConfig) -> None:
    for name in ("num_host_module_layer", "num_device_module_layer"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"PeftCacheManagerConfig.{name}: must be an integer >= 0, got {value!r}")
    for name in ("max_adapter_size", "optimal_adapter_size"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"PeftCacheManagerConfig.{name}: must be a positive integer, got {value!r}")
    size = config.host_cache_size
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= 0):
        raise ValueError(f"PeftCacheManagerConfig.host_cache_size: must be a positive integer or None, got {size!r}")
    percent = config.device_cache_percent
    if percent is not None and not (isinstance(percent, (int, float)) and 0 < percent <= 1):
        raise ValueError(f"PeftCacheManagerConfig.device_cache_percent: must be in (0, 1], got {percent!r}")


def row_bytes(config: PeftCacheManagerConfig, cfg: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of one device row: rank optimal_adapter_size of the model's widest module."""
    widest = max(m.in_features + m.out_features for m in lora_modules(cfg).values())
    return config.optimal_adapter_size * widest * dtype_bytes


def make_peft_cache(config: PeftCacheManagerConfig | None, cfg: ModelConfig, dtype_bytes: int,
                    memory_budget_bytes: int) -> PeftCache:
    """The cache for `config` (defaults when None); memory_budget_bytes: what the KV pool's
    fraction applies to (free GPU memory, or the host KV budget on CPU)."""
    config = config if config is not None else PeftCacheManagerConfig()
    if not isinstance(config, PeftCacheManagerConfig):
        raise ValueError(f"peft_cache_manager_config: expected a PeftCacheManagerConfig, got {type(config).__name__}")
    _check(config)
    host = config.num_host_module_layer or (config.host_cache_size or DEFAULT_HOST_CACHE_BYTES)
    device = config.num_device_module_layer
    if not device:
        percent = 0.05 if config.device_cache_percent is None else config.device_cache_percent
        device = max(1, int(percent * memory_budget_bytes) // row_bytes(config, cfg, dtype_bytes))
    return PeftCache(host, device)


def adapter_ref(task_id, weights, config, cfg: ModelConfig, peft: PeftCacheManagerConfig | None,
                names: tuple[str, str, str] = ("lora_task_id", "lora_weights", "lora_config")) -> AdapterRef | None:
    """A request's LoRA fields -> AdapterRef (payload None: id only), or None without a task id.
    ValueError naming the field and the value (weights without an id, one of weights / config
    without the other, a bad id, and what runtime.adapters.lora.adapter_from_tensors refuses)."""
    id_name, w_name, c_name = names
    if task_id is None:
        if weights is not None or config is not None:
            raise ValueError(f"{w_name} / {c_name}: given without {id_name}")
        return None
    if isinstance(task_id, bool) or not isinstance(task_id, int) or not 0 <= task_id <= MAX_TASK_ID:
        raise ValueError(f"{id_name}: expected an integer in [0, 2**63), got {task_id!r}")
    if (weights is None) != (config is None):
        missing = c_name if config is None else w_name
        raise ValueError(f"{missing}: missing; {w_name} and {c_name} come together")
    if weights is None:
        return AdapterRef(task_id)
    peft = peft or PeftCacheManagerConfig()
    adapter = adapter_from_tensors(weights, config, cfg, peft.max_adapter_size, (w_name, c_name))
    device_rows = sum(math.ceil(r / peft.optimal_adapter_size) for r in adapter.ranks)
    host_cost = adapter.num_rows if peft.num_host_module_layer else adapter.num_bytes
    return AdapterRef(task_id, adapter, host_cost, device_rows)


def tensor_int(name: str, value) -> int | None:
    """A one-element integer tensor (lora_task_id: uint64 or int64 [1]) as an int."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.dtype.is_floating_point \
            or value.dtype.is_complex or value.dtype == torch.bool or value.device.type == "meta":
        raise ValueError(f"{name}: expected one integer value (uint64 [1]), got "
                         f"{getattr(value, 'dtype', type(value).__name__)} {list(getattr(value, 'shape', []))}"
                         f"{' on the meta device' if getattr(value, 'is_meta', False) else ''}")
    return int(value.item())
