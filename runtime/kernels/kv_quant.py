"""Quantized KV cache storage (BuildConfig.kv_cache_dtype "int8" / "fp8"): the symmetric
quantization of one (token, KV head) row and its inverse, the definition every backend's cache
write and attention read follow (torch_attention.py uses it; cuda_src/kv_cache.cu and
paged_attention.cu mirror it bit for bit for int8).

A row x [head_dim] is stored as q = round(x / scale) (int8: round half to even, clamped to
[-127, 127]; fp8 e4m3: the cast's rounding, clamped to [-448, 448]) with one float32
scale = max|x| / QMAX (0 for an all-zero row, whose q is 0). Reading gives q * scale in float32.
"""
from __future__ import annotations

import torch

from ..config import ConfigError

KV_STORAGE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def is_quantized_kv(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def check_kv_storage(kernels, kv_cache_dtype: str, storage_dtype: torch.dtype) -> None:
    """ConfigError naming kv_cache_dtype and its value when `storage_dtype` (the KV pool's element
    dtype it chose) is not among the kernel backend's declared kv_storage_dtypes."""
    if storage_dtype not in kernels.kv_storage_dtypes:
        runs = ", ".join(sorted(str(dtype).removeprefix("torch.") for dtype in kernels.kv_storage_dtypes))
        raise ConfigError(f"kv_cache_dtype: {kv_cache_dtype!r} stores {storage_dtype}, which the {kernels.name!r} "
                          f"kernel backend does not run (its KV caches: {runs}); use 'int8' or 'auto'")


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (q [..., D] in `dtype`, scales float32 [...])."""
    qmax = QMAX[dtype]
    x = x.to(torch.float32)
    scales = x.abs().amax(dim=-1) / qmax                       # [...]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = (x / safe[..., None]).clamp_(-qmax, qmax)
    if dtype == torch.int8:
        q = q.round_()
    return q.to(dtype), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., D] (int8 / fp8), scales float32 [...] -> q * scale [..., D] in `dtype` (math in float32)."""
    return (q.to(torch.float32) * scales[..., None]).to(dtype)


def round_trip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a quantized cache returns it (in x's dtype): what attention reads after a cache write."""
    return dequantize(*quantize_rows(x, dtype), x.dtype)
