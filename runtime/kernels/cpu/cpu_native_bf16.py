"""bfloat16 per-op entry points of the native CPU layer (ops.cpp's `bm_*_bf16`): the few-row linear
(bf16 weights, bf16 or float32 activations), RMSNorm, silu(gate) * up and paged decode attention
over a bf16 cache, each summing in float32 (the same functions as the float32 ones and the fused
step). Same library and callers as cpu_native.py (linear.py, torch_backend.py, cpu_attention.py),
which keep torch for every other case.

The linear comes in two entry points: AVX512-BF16's dot product (where compiled in) and `_avx2`,
which widens bf16 to float32 by a 16-bit shift and runs on any AVX2 CPU; the ISA cap (isa.py: the
`isa` argument, else BATCH_MANAGER_CPU_ISA) below avx512bf16 picks the latter (tests, A/B runs).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from . import isa as isa_tiers
from .cpu_native import call_decode_attention, call_rms_norm, call_silu_mul, native_ops
from .isa import Isa


class NativeBf16Ops:
    """The bf16 entry points of the loaded library; `dot_product` False forces the shifting path."""

    def __init__(self, lib: ctypes.CDLL, dot_product: bool):
        self._linear = lib.bm_linear_bf16 if dot_product else lib.bm_linear_bf16_avx2
        self._decode_attention = lib.bm_decode_attention_bf16
        self._rms_norm, self._silu_mul = lib.bm_rms_norm_bf16, lib.bm_silu_mul_bf16
        # Whether the linear runs AVX512-BF16's dot product (else the shifting path).
        self.uses_dot_product = dot_product and bool(lib.bm_bf16_has_dot_product())

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x bf16 or float32 [rows, in] (rows contiguous), weight bf16 [out, in] contiguous, bias
        float32 [out] or None -> [rows, out] in `out_dtype` (default x's). With `out` (bf16 or
        float32 [rows, out], rows contiguous) the product is ADDED into it."""
        assert weight.dtype == torch.bfloat16 and weight.is_contiguous() and x.dtype in (torch.bfloat16, torch.float32)
        assert x.stride(1) == 1 and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
        rows, (n, k) = x.shape[0], weight.shape
        accumulate = out is not None
        if out is None:
            out = torch.empty(rows, n, dtype=out_dtype or x.dtype)
        assert out.dtype in (torch.bfloat16, torch.float32) and out.shape == (rows, n) and out.stride(1) == 1
        assert x.shape[1] == k
        self._linear(x.data_ptr(), int(x.dtype == torch.bfloat16), rows, x.stride(0), weight.data_ptr(), n, k,
                     None if bias is None else bias.data_ptr(), out.data_ptr(), int(out.dtype == torch.bfloat16),
                     out.stride(0), int(accumulate), torch.get_num_threads())
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x bf16 [rows, h] (rows contiguous), weight bf16 [h] -> bf16 x * rsqrt(mean(x^2) + eps) * weight."""
        return call_rms_norm(self._rms_norm, x, weight, eps, torch.bfloat16)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x bf16 [rows, 2n] (gate | up, rows contiguous) -> bf16 silu(gate) * up [rows, n]."""
        return call_silu_mul(self._silu_mul, x, torch.bfloat16)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         window: int | None, sink: int = 0) -> torch.Tensor:
        """interface.KernelBackend.decode_attention for bf16 q and caches (read in place): bf16 [B, H, D]."""
        return call_decode_attention(self._decode_attention, q, k_cache, v_cache, block_tables, seq_lens, scale,
                                     window, sink, torch.bfloat16)


def bf16_ops(isa: str | None = None) -> NativeBf16Ops | None:
    """The bf16 kernels; None wherever cpu_native.native_ops() is None. The dot product runs when
    the ISA cap (isa.cap(isa)) is avx512bf16 and the library compiled it in."""
    cap = isa_tiers.cap(isa)
    ops = native_ops()
    if ops is None:
        return None
    return _bound(ops._lib, cap >= Isa.AVX512BF16 and Isa.AVX512BF16 in isa_tiers.compiled_tiers(ops._lib))


@functools.lru_cache(maxsize=None)
def _bound(lib: ctypes.CDLL, dot_product: bool) -> NativeBf16Ops:
    return NativeBf16Ops(lib, dot_product)
