"""How many KV blocks the pool gets, from the engine and KvCacheConfig.

GPU: `free_gpu_memory_fraction` (default 0.9) of the device memory free after the weights.
CPU: the same fraction of a host budget: BATCH_MANAGER_HOST_KV_BYTES if set, else the smaller
of 4 GiB and half the available host memory. `max_tokens` caps the pool; with both set the pool
holds the minimum. Without `max_tokens`, the pool never exceeds what max_num_sequences sequences
of max_seq_len tokens can use.
"""
from __future__ import annotations

import math
import os

import torch

from runtime import Engine, ModelRunner

from ..options import KvCacheConfig

DEFAULT_FREE_MEMORY_FRACTION = 0.9
HOST_KV_BUDGET_ENV = "BATCH_MANAGER_HOST_KV_BYTES"
DEFAULT_HOST_KV_BYTES = 4 << 30


def host_budget_bytes() -> int:
    value = os.environ.get(HOST_KV_BUDGET_ENV)
    if value:
        try:
            budget = int(value)
        except ValueError:
            raise ValueError(f"{HOST_KV_BUDGET_ENV}: expected an integer number of bytes, got {value!r}") from None
        if budget <= 0:
            raise ValueError(f"{HOST_KV_BUDGET_ENV}: must be positive, got {budget}")
        return budget
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        available = 2 * DEFAULT_HOST_KV_BYTES
    return min(DEFAULT_HOST_KV_BYTES, available // 2)


def num_kv_blocks(engine: Engine, config: KvCacheConfig, max_num_sequences: int, device: torch.device,
                  tensor_parallelism: int = 1) -> int:
    """Blocks of the KV pool; under tensor parallelism a block holds one rank's KV heads."""
    tpb = engine.build_config.tokens_per_block
    bytes_per_block = ModelRunner.kv_bytes_per_block(engine, tensor_parallelism)
    fraction = config.free_gpu_memory_fraction
    if fraction is None:
        fraction = DEFAULT_FREE_MEMORY_FRACTION
    if not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
        raise ValueError(f"KvCacheConfig.free_gpu_memory_fraction: must be in (0, 1], got {fraction!r}")
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
    else:
        free_bytes = host_budget_bytes()
    from_fraction = int(fraction * free_bytes) // bytes_per_block
    if config.max_tokens is not None:
        if not isinstance(config.max_tokens, int) or config.max_tokens <= 0:
            raise ValueError(f"KvCacheConfig.max_tokens: must be a positive integer, got {config.max_tokens!r}")
        num_blocks = min(math.ceil(config.max_tokens / tpb), from_fraction)
    else:
        num_blocks = min(from_fraction, max_num_sequences * math.ceil(engine.build_config.max_seq_len / tpb))
    if num_blocks <= 0:
        raise ValueError(f"KV cache: no room for a single block of {bytes_per_block} bytes "
                         f"(fraction {fraction} of {free_bytes} bytes)")
    return num_blocks
