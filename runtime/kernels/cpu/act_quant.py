"""The int8-activation mode's integer GEMVs (issue 41): activations quantized per block of 32 input
columns to symmetric int8, dot products with int8 / int4 weights in int32 (linear_act_quant.h).
Owns the torch reference of that arithmetic, the weights' repacked layout (`pack`, once at load) and
the ctypes wrapper; `act_quant_ops()` is None where the kernels cannot be built or run here.

Tiers: scalar, avx2, avxvnni, avx512vnni (isa.py); the best one at or below the cap (the `isa`
argument, else BATCH_MANAGER_CPU_ISA, else this CPU's best) that the library compiled in runs.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import cpu_native, isa as isa_tiers
from .cpu_native import INT4_CODE, INT8_CODE, quantized_code
from .isa import Isa
from .weight_memory import hold

TIERS = (Isa.SCALAR, Isa.AVX2, Isa.AVXVNNI, Isa.AVX512VNNI)   # this family's kernels (linear_act_quant.h)
BLOCK = 32          # activation columns per quantization block
UNIT = 16           # output rows per packed unit (kActUnit)


# ---- the torch reference ----------------------------------------------------------------------

def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 [rows, k], k % 32 == 0 -> (q int8 [rows, k], d float32 [rows, k/32], s int32
    [rows, k/32]): d = max|x| / 127 per block, q = round-half-even(x / d) in [-127, 127] (0 where
    d == 0), s = the block's sum of q."""
    rows, k = x.shape
    assert x.dtype == torch.float32 and k % BLOCK == 0, (x.dtype, k)
    blocks = x.reshape(rows, k // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=2) / 127
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round(blocks / safe[:, :, None]).clamp(-127, 127)
    q = torch.where(d[:, :, None] == 0, torch.zeros_like(q), q).to(torch.int8)
    return q.reshape(rows, k), d, q.to(torch.int32).sum(dim=2, dtype=torch.int32)


def unpack_int4(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """uint8 [n, k/2] in cpu_weight_only's int4 layout -> the nibbles uint8 [n, k] in column order."""
    n, half_k = packed.shape
    grouped = packed.reshape(n, half_k * 2 // group_size, group_size // 2)
    return torch.cat([grouped & 15, grouped >> 4], dim=2).reshape(n, half_k * 2)


def int8_act_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                              minimum: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """x float32 [rows, k]; int8: weight int8 [n, k], scale [n], minimum None; int4: weight uint8
    [n, k/2] (cpu_weight_only's layout), scale and minimum [n, k/gs] -> float32 [rows, n]. The
    integer block sums are exact (float64 products of integers); the float part in float32."""
    q, d, s = quantize_activations(x)
    rows, k = x.shape
    is_int8 = quantized_code(weight) == INT8_CODE
    nib = weight if is_int8 else unpack_int4(weight, k // scale.shape[1])
    n = nib.shape[0]
    isum = torch.einsum("rbj,obj->rob", q.double().reshape(rows, -1, BLOCK),
                        nib.double().reshape(n, -1, BLOCK)).float()                       # [rows, n, blocks]
    if is_int8:
        y = (isum * d[:, None, :]).sum(dim=2) * scale
    else:
        per_block = k // BLOCK // scale.shape[1]
        block_scale = scale.float().repeat_interleave(per_block, dim=1)                   # [n, blocks]
        block_min = minimum.float().repeat_interleave(per_block, dim=1)
        y = ((block_scale * isum + block_min * s[:, None, :].float()) * d[:, None, :]).sum(dim=2)
    return y if bias is None else y + bias


# ---- the packed weights -----------------------------------------------------------------------

@dataclass(frozen=True)
class PackedActWeight:
    """One linear's weights in linear_act_quant.h's layout (n_units = ceil(n / 16))."""
    packed: torch.Tensor            # uint8: int8 [n_units, k/32, 8, 16, 4]; int4 [n_units, k/32, 4, 16, 4]
    scale: torch.Tensor             # int8 float32 [n_units * 16]; int4 float16 [n_units, k/gs, 16]
    minimum: torch.Tensor | None    # int4 float16 [n_units, k/gs, 16] (the stored values); int8 None
    n: int
    k: int
    group_size: int                 # int4: 32 / 64 / 128; int8: 0
    format: int                     # the weight's native format code (INT8_CODE / INT4_CODE)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def pack(weight: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None) -> PackedActWeight:
    """int8 weight [n, k] + scale [n] (minimum None), or int4 packed uint8 [n, k/2] + scale and
    minimum [n, k/gs] (cpu_weight_only's layouts; float16, or values float16 holds exactly) -> the
    repacked tensors. ConfigError for a weight format without a native kernel."""
    n = weight.shape[0]
    units = -(-n // UNIT)
    if quantized_code(weight) == INT8_CODE:
        k = weight.shape[1]
        if weight.dtype != torch.int8 or scale.shape != (n,) or k % BLOCK:
            raise ValueError(f"int8 weight: expected int8 [n, k % 32 == 0] and scale [n], got "
                             f"{weight.dtype} {tuple(weight.shape)} and {tuple(scale.shape)}")
        biased = (_pad_rows(weight, units * UNIT).to(torch.int16) + 128).to(torch.uint8)
        packed = biased.reshape(units, UNIT, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
        return PackedActWeight(hold(packed), _pad_rows(scale.float(), units * UNIT).contiguous(), None, n, k, 0,
                               INT8_CODE)
    k = weight.shape[1] * 2
    groups = scale.shape[1]
    group_size = k // groups if groups else 0
    if (weight.dtype != torch.uint8 or group_size not in (32, 64, 128) or groups * group_size != k
            or scale.shape != (n, groups) or minimum.shape != (n, groups)):
        raise ValueError(f"int4 weight: expected uint8 [n, k/2] and scale, minimum [n, k/gs] with gs in 32/64/128, "
                         f"got {weight.dtype} {tuple(weight.shape)}, {tuple(scale.shape)}, {tuple(minimum.shape)}")
    nib = _pad_rows(unpack_int4(weight, group_size), units * UNIT).reshape(units, UNIT, k // BLOCK, 2, 4, 4)
    packed = (nib[:, :, :, 0] | (nib[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).contiguous()

    def per_unit(name: str, t: torch.Tensor) -> torch.Tensor:
        return _pad_rows(_float16(name, t), units * UNIT).reshape(units, UNIT, groups).transpose(1, 2).contiguous()
    return PackedActWeight(hold(packed), per_unit("scale", scale), per_unit("minimum", minimum), n, k, group_size,
                           INT4_CODE)


def _float16(name: str, t: torch.Tensor) -> torch.Tensor:
    """An int4 scale or minimum as float16 (the kernels read float16): ValueError where a value
    would round (float16 -> float32 is exact, so the results equal the stored format's)."""
    half = t.to(torch.float16)
    if t.dtype != torch.float16 and not torch.equal(half.to(t.dtype), t):
        raise ValueError(f"int4 {name}: expected float16 values, got {t.dtype} values float16 does not hold")
    return half


def packed_rows(w: PackedActWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (int64 [T], each < w.n) of the weight `pack` repacked, de-quantized as the stored
    format de-quantizes them (the same float32 products): float32 [T, k]. A tied table's lookup
    reads the one copy the head holds."""
    unit, lane, num_rows = ids // UNIT, ids % UNIT, ids.numel()
    lanes = w.packed[unit, :, :, lane, :]                          # [T, k/32, 8 or 4, 4]
    if w.format == INT8_CODE:
        q = (lanes.reshape(num_rows, w.k).to(torch.int16) - 128).float()
        return q * w.scale[ids][:, None]
    nib = torch.cat([(lanes & 15).reshape(num_rows, -1, 16), (lanes >> 4).reshape(num_rows, -1, 16)], dim=2)
    groups = w.k // w.group_size
    q = nib.reshape(num_rows, groups, w.group_size).float()
    scale, minimum = w.scale[unit, :, lane].float(), w.minimum[unit, :, lane].float()   # [T, groups]
    return (q * scale[..., None] + minimum[..., None]).reshape(num_rows, w.k)


# ---- the native kernels -----------------------------------------------------------------------

class ActLinearStruct(ctypes.Structure):
    """linear_act_quant.h's ActLinear."""
    _fields_ = [("format", ctypes.c_int32), ("pad", ctypes.c_int32), ("packed", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("min", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("gs", ctypes.c_int64)]


class ActQuantOps:
    """The loaded library; methods take CPU tensors and assert the layouts of the C contracts."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        self.tiers = tuple(tier for tier in TIERS if tier in isa_tiers.compiled_tiers(lib))
        self.available_isas = tuple(tier.name.lower() for tier in self.tiers)
        self.best_isa = self.available_isas[-1]

    def isa_level(self, isa: str | None = None) -> int:
        """The tier to run (an Isa value): this family's best at or below isa.cap(isa)."""
        return int(isa_tiers.best_at_or_below(isa_tiers.cap(isa), self.tiers))

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """quantize_activations in C++ (the same (q, d, s))."""
        assert x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() and x.shape[1] % BLOCK == 0
        rows, k = x.shape
        q = torch.empty(rows, k, dtype=torch.int8)
        d = torch.empty(rows, k // BLOCK, dtype=torch.float32)
        s = torch.empty(rows, k // BLOCK, dtype=torch.int32)
        self._lib.bm_aq_quantize(x.data_ptr(), rows, k, q.data_ptr(), d.data_ptr(), s.data_ptr())
        return q, d, s

    def act_linear(self, x: torch.Tensor, packed: PackedActWeight, bias: torch.Tensor | None,
                   out: torch.Tensor | None = None, isa: str | None = None) -> torch.Tensor:
        """x float32 [rows, k] -> float32 [rows, n] (ADDED into `out` when given); x is quantized
        per block of 32 columns first."""
        return self.bind(packed, bias, isa)(x, out)

    def bind(self, packed: PackedActWeight, bias: torch.Tensor | None, isa: str | None = None):
        """`fn(x, out=None)`: act_linear of this weight with the checks, the tier and the C struct
        done once (the per-call Python cost is a visible share of a small GEMV)."""
        assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.shape == (packed.n,))
        level, n, k = self.isa_level(isa), packed.n, packed.k
        w = ActLinearStruct(packed.format, 0, packed.packed.data_ptr(), packed.scale.data_ptr(),
                            None if packed.minimum is None else packed.minimum.data_ptr(),
                            None if bias is None else bias.data_ptr(), n, k, packed.group_size)
        keep, fn, w_ref = (packed, bias), self._lib.bm_aq_linear, ctypes.byref(w)   # the pointers stay valid

        def linear(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            assert keep and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == k
            x = x.contiguous()
            rows = x.shape[0]
            if out is None:
                y, accumulate = torch.empty(rows, n, dtype=torch.float32), 0
            else:
                assert out.dtype == torch.float32 and out.shape == (rows, n) and out.stride(1) == 1
                y, accumulate = out, 1
            if rows:
                fn(w_ref, x.data_ptr(), rows, y.data_ptr(), y.stride(0), accumulate, torch.get_num_threads(), level)
            return y
        return linear


def act_quant_ops() -> ActQuantOps | None:
    """The kernels (built and loaded once per process), or None where they cannot run here."""
    return cpu_native.load_ops(ActQuantOps)


def act_linear(x: torch.Tensor, packed: PackedActWeight, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, isa: str | None = None) -> torch.Tensor:
    """ActQuantOps.act_linear through the loaded kernels (RuntimeError where they cannot run here)."""
    ops = act_quant_ops()
    if ops is None:
        raise RuntimeError("the act-quant kernels cannot run here (no AVX2/FMA, no compiler, or "
                           f"{cpu_native.ENV_VAR}=0)")
    return ops.act_linear(x, packed, bias, out, isa)
