"""Weight-only int8 / int4 entry points of the native CPU layer (ops.cpp's bm_wo_*, over
linear_weight_only.h, linear_weight_only_gemm.h): int8 / int4 weights with float32 activations at
any row count (a GEMV below bm_wo::kGemmMinRows rows, a fused de-quantize-and-multiply GEMM from
there). `weight_only_ops()` is None where they cannot run (no AVX2/FMA, no compiler,
BATCH_MANAGER_CPU_NATIVE=0). Caller: weight_only_linear.py; tests hold them to its torch reference.

Tiers: scalar, avx2, avx512, amx (isa.py; amx: the int8 GEMM on AMX-BF16 tiles, its GEMV the avx512 one); the best one at or below the cap (the `isa` argument, else
BATCH_MANAGER_CPU_ISA, else this CPU's best) that the library compiled in runs, so the AVX2 and
scalar paths are tested on any CPU.
"""
from __future__ import annotations

import ctypes

import torch

from . import cpu_native, isa as isa_tiers
from .cpu_native import INT8_CODE, _ptr, quantized_code
from .isa import Isa

TIERS = (Isa.SCALAR, Isa.AVX2, Isa.AVX512, Isa.AMX)   # this family's kernels (linear_weight_only.h; AMX: the int8 GEMM)

class WeightOnlyOps:
    """The loaded library; methods take CPU tensors and assert the layouts of the C contracts."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        self.tiers = tuple(tier for tier in TIERS if tier in isa_tiers.compiled_tiers(lib))
        self.max_isa = self.tiers[-1]

    def isa_level(self, isa: str | None = None) -> int:
        """The tier to run (an Isa value): this family's best at or below isa.cap(isa)."""
        return int(isa_tiers.best_at_or_below(isa_tiers.cap(isa), self.tiers))

    @staticmethod
    def _out(x: torch.Tensor, n: int, out: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        assert x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
        if out is None:
            return torch.empty(x.shape[0], n, dtype=torch.float32), 0
        assert out.dtype == torch.float32 and out.shape == (x.shape[0], n) and out.stride(1) == 1
        return out, 1

    def int8_linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    out: torch.Tensor | None = None, isa: str | None = None) -> torch.Tensor:
        """x float32 [rows, in], weight int8 [out, in], scale float32 [out], bias float32 [out] or
        None -> [rows, out]; with `out` the product is ADDED into it."""
        n, k = weight.shape
        assert weight.dtype == torch.int8 and weight.is_contiguous() and x.shape[1] == k
        assert scale.dtype == torch.float32 and scale.is_contiguous() and scale.shape == (n,)
        assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
        y, accumulate = self._out(x, n, out)
        self._lib.bm_wo_int8_linear(x.data_ptr(), x.shape[0], x.stride(0), weight.data_ptr(), scale.data_ptr(), n, k,
                                    _ptr(bias), y.data_ptr(), y.stride(0), accumulate, torch.get_num_threads(),
                                    self.isa_level(isa))
        return y

    def int4_linear(self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                    bias: torch.Tensor | None, out: torch.Tensor | None = None, isa: str | None = None) -> torch.Tensor:
        """x float32 [rows, in], packed uint8 [out, in / 2], scale and minimum float16
        [out, in / group] -> [rows, out] (ADDED into `out` when given)."""
        n, k = packed.shape[0], packed.shape[1] * 2
        group_size = k // scale.shape[1]
        assert packed.dtype == torch.uint8 and packed.is_contiguous() and x.shape[1] == k
        assert group_size in (32, 64, 128) and scale.shape[1] * group_size == k
        assert scale.dtype == minimum.dtype == torch.float16 and scale.is_contiguous() and minimum.is_contiguous()
        assert scale.shape == minimum.shape == (n, k // group_size)
        assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
        y, accumulate = self._out(x, n, out)
        self._lib.bm_wo_int4_linear(x.data_ptr(), x.shape[0], x.stride(0), packed.data_ptr(), scale.data_ptr(),
                                    minimum.data_ptr(), n, k, group_size, _ptr(bias), y.data_ptr(), y.stride(0),
                                    accumulate, torch.get_num_threads(), self.isa_level(isa))
        return y

    def bind(self, weight: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
             bias: torch.Tensor | None, isa: str | None = None):
        """`fn(x, out=None)`: int8_linear / int4_linear of this weight with the layout checks and
        the constant arguments done once (a generation step calls ~100 linears: per-call Python
        cost is a visible share of it). ConfigError for a weight format without a native kernel."""
        is_int8 = quantized_code(weight) == INT8_CODE
        if is_int8:
            self.int8_linear(torch.zeros(1, weight.shape[1]), weight, scale, bias, isa=isa)   # checks the layout
            fn, n, k = self._lib.bm_wo_int8_linear, weight.shape[0], weight.shape[1]
            head = (weight.data_ptr(), scale.data_ptr(), n, k, _ptr(bias))
        else:
            self.int4_linear(torch.zeros(1, weight.shape[1] * 2), weight, scale, minimum, bias, isa=isa)
            fn, n, k = self._lib.bm_wo_int4_linear, weight.shape[0], weight.shape[1] * 2
            head = (weight.data_ptr(), scale.data_ptr(), minimum.data_ptr(), n, k, k // scale.shape[1], _ptr(bias))
        level = self.isa_level(isa)
        keep = (weight, scale, minimum, bias)   # the pointers above stay valid while fn lives

        def linear(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            assert keep and x.dtype == torch.float32 and x.stride(1) == 1 and x.shape[1] == k
            rows = x.shape[0]
            y = torch.empty(rows, n, dtype=torch.float32) if out is None else out
            assert y.stride(1) == 1 and y.shape == (rows, n)
            fn(x.data_ptr(), rows, x.stride(0), *head, y.data_ptr(), y.stride(0), int(out is not None),
               torch.get_num_threads(), level)
            return y
        return linear


def weight_only_ops() -> WeightOnlyOps | None:
    """The kernels (built and loaded once per process), or None where they cannot run here."""
    return cpu_native.load_ops(WeightOnlyOps)
