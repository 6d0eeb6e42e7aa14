"""llama.cpp's quantized block formats on the native CPU layer (blocks.cpp's bm_blk_* over the
format table, format_table.h): the linear y = x @ W^T with integer dot products against 8-bit input
blocks (q8x32 for the 32-element formats, q8k for the K formats), the row de-quantization (bit for
bit gguf.quants.dequantize) and the input quantization alone. `block_ops()` is None where the native
library cannot run (as weight_only_ops()); torch_kernels/block_reference.py is the reference.

Weights are ggml's block bytes as a GGUF file stores them: uint8 [n, row_bytes], row_bytes =
k / block_elems * block_bytes. Tiers: scalar and avx2 (isa.py); the best one at or below the cap
(the `isa` argument, else BATCH_MANAGER_CPU_ISA, else this CPU's best) runs. A bound linear
(`BlockOps.bind`) of a format in X8_HALF_FIELDS (all seven) on a tier with kernels over the 8-row
interleaved layout (avx2) holds its weight repacked into it (`repack_x8`, same bytes) instead of
ggml's: its `.blocks`.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import gguf
import torch

from . import cpu_native, isa as isa_tiers
from .cpu_native import _ptr
from .isa import Isa
from .weight_memory import hold
from ...quantization.native_codes import INPUT_TYPES, weight_code

# ggml's names, lowercase; each a row of the native format table
BLOCK_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q5_k", "q6_k")
K_BLOCK = 256   # a K format's super-block, and the q8k input block
SUM_GROUP = {"q8x32": 32, "q8k": 16}   # input type -> elements per integer sum
LAYOUT_X8 = 1 << 8   # bm_blk_linear's format flag: the weight is in the 8-row interleaved layout
# format -> byte offsets of the float16 fields in its block (d; q4_1: d, m; q4_k / q5_k: d, dmin; q6_k:
# its trailing d): the x8 layout's head per block, field by field
X8_HALF_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2),
                  "q6_k": (208,)}
HIGH_BITS_BYTES = {"q5_0": 4}   # format -> bytes of fifth bits after its float16 fields (qh), spread for x8


def _check_format(fmt: str) -> str:
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"fmt: unknown block format {fmt!r}; known: {', '.join(BLOCK_FORMATS)}")
    return fmt


def block_geometry(fmt: str) -> tuple[int, int]:
    """(elements, bytes) of one block of `fmt` (gguf.GGML_QUANT_SIZES)."""
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[_check_format(fmt).upper()]]


def input_type(fmt: str) -> str:
    """The input type `fmt`'s dot kernel takes (formats.h's InputType): q8k for the K formats."""
    return "q8k" if block_geometry(fmt)[0] == K_BLOCK else "q8x32"


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one weight row of k elements; ValueError naming k when it is not a multiple of the block."""
    elems, size = block_geometry(fmt)
    if k <= 0 or k % elems:
        raise ValueError(f"k: {k} is not a positive multiple of {fmt}'s block of {elems}")
    return k // elems * size


@dataclass(frozen=True)
class QuantizedInput:
    """Input rows in a dot kernel's input type (quants_blocks.h's contract)."""
    input_type: str       # "q8x32" or "q8k"
    q: torch.Tensor       # int8 [rows, k]
    d: torch.Tensor       # float32 [rows, k / 32] (q8x32) or [rows, k / 256] (q8k)
    sums: torch.Tensor    # int32 [rows, k / 32] (q8x32) or int16 [rows, k / 16] (q8k): sums of q


def check_blocks(blocks: torch.Tensor, fmt: str, k: int) -> int:
    """The row count n of a weight `blocks` of `fmt` with k columns; ValueError naming the argument."""
    size = row_bytes(fmt, k)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != size:
        raise ValueError(f"blocks: {blocks.dtype} {tuple(blocks.shape)} is not uint8 [n, {size}] ({fmt}, k={k})")
    if not blocks.is_contiguous() or blocks.device.type != "cpu" or blocks.data_ptr() % 2:
        raise ValueError(f"blocks: must be a contiguous CPU tensor at an even address (ggml's blocks hold "
                         f"float16 fields; {fmt}, k={k})")
    return blocks.shape[0]


def _spread_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """q5_0's qh uint8 [..., 4] (bit e of the little-endian word: element e's fifth bit) -> uint8
    [..., 4] whose byte b holds element 4t + b's in bit t (the x8 kernel's order)."""
    word = sum(qh[..., i].to(torch.int32) << (8 * i) for i in range(4))
    bits = ((word[..., None] >> torch.arange(32, dtype=torch.int32)) & 1).view(*qh.shape[:-1], 8, 4)   # [..., t, b]
    return (bits << torch.arange(8, dtype=torch.int32)[:, None]).sum(-2).to(torch.uint8)


def _gather_high_bits(spread: torch.Tensor) -> torch.Tensor:
    """The inverse of _spread_high_bits."""
    bits = (spread[..., None, :].to(torch.int32) >> torch.arange(8, dtype=torch.int32)[:, None]) & 1   # [..., t, b]
    word = (bits.flatten(-2) << torch.arange(32, dtype=torch.int32)).sum(-1, dtype=torch.int64)
    return ((word[..., None] >> torch.arange(0, 32, 8)) & 255).to(torch.uint8)


def _x8_byte_order(fmt: str) -> tuple[list[int], list[int], list[int]]:
    """A block's byte indices in the x8 layout's order: its float16 fields, q5_0's fifth bits, the rest."""
    size = block_geometry(fmt)[1]
    halves = [offset + b for offset in X8_HALF_FIELDS[fmt] for b in (0, 1)]
    high = list(range(max(halves) + 1, max(halves) + 1 + HIGH_BITS_BYTES.get(fmt, 0)))
    return halves, high, [b for b in range(size) if b not in halves and b not in high]


def repack_x8(blocks: torch.Tensor, fmt: str, k: int) -> torch.Tensor:
    """ggml's rows uint8 [n, row_bytes] -> the 8-row interleaved layout (linear_blocks_avx2*.h), same
    shape: rows 8g .. 8g + 7 become one group holding per block the 8 rows' float16 fields (field
    by field), q5_0's fifth bits (4 bytes a row, _spread_high_bits), then the rest of their bytes in
    block order (codes; q4_k: scales, codes; q5_k: scales, fifth bits, codes; q6_k: ql, qh, scales) 4
    at a time (chunk c: the 8 rows' bytes 4c .. 4c + 3 of the rest); the rows after the last whole
    group stay as they are."""
    n, (halves, high, rest) = check_blocks(blocks, fmt, k), _x8_byte_order(fmt)
    groups, (elems, size) = n // 8, block_geometry(fmt)
    nb = k // elems
    g = blocks[:groups * 8].view(groups, 8, nb, size).permute(0, 2, 1, 3)   # [G, nb, 8, size]
    heads = g[..., halves].reshape(groups, nb, 8, len(halves) // 2, 2).transpose(2, 3)
    spread = _spread_high_bits(g[..., high]) if high else g[..., :0]
    codes = g[..., rest].reshape(groups, nb, 8, len(rest) // 4, 4).transpose(2, 3)
    parts = [part.reshape(groups, nb, -1) for part in (heads, spread, codes)]
    return torch.cat([torch.cat(parts, dim=2).reshape(groups * 8, -1), blocks[groups * 8:]])


def unpack_x8(packed: torch.Tensor, fmt: str, k: int) -> torch.Tensor:
    """The inverse of repack_x8: ggml's rows uint8 [n, row_bytes]."""
    n, (halves, high, rest) = check_blocks(packed, fmt, k), _x8_byte_order(fmt)
    groups, (elems, size) = n // 8, block_geometry(fmt)
    nb, fields = k // elems, len(halves) // 2
    g = packed[:groups * 8].reshape(groups, nb, 8 * size)
    heads = g[..., :16 * fields].reshape(groups, nb, fields, 8, 2).transpose(2, 3).reshape(groups, nb, 8, -1)
    spread = g[..., 16 * fields:8 * (2 * fields + len(high))].reshape(groups, nb, 8, len(high))
    codes = g[..., 8 * (2 * fields + len(high)):].reshape(groups, nb, len(rest) // 4, 8, 4).transpose(2, 3)
    ordered = torch.cat([heads, _gather_high_bits(spread) if high else spread, codes.reshape(groups, nb, 8, -1)], 3)
    rows = ordered[..., torch.argsort(torch.tensor(halves + high + rest))]   # back to ggml's byte order
    return torch.cat([rows.transpose(1, 2).reshape(groups * 8, -1), packed[groups * 8:]])


@functools.lru_cache(maxsize=None)
def x8_row_gather(fmt: str, k: int) -> torch.Tensor | None:
    """int32 [8, row_bytes]: where byte b of row r of an x8 group sits among the group's 8 *
    row_bytes bytes (unpack_x8 as one gather); None for q5_0, whose fifth bits move bit by bit.
    One per (format, k), made on a table's first lookup (a model's other linears never look up rows)."""
    if fmt in HIGH_BITS_BYTES:
        return None
    size = row_bytes(fmt, k)
    position = torch.arange(8 * size).view(8, size)
    digits = [unpack_x8(((position >> shift) & 255).to(torch.uint8), fmt, k).long() << shift for shift in (0, 8, 16)]
    return (digits[0] + digits[1] + digits[2]).to(torch.int32)


def _check_rows(x: torch.Tensor, k: int) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or x.device.type != "cpu":
        raise ValueError(f"x: {x.dtype} {tuple(x.shape)} (strides {x.stride()}) is not float32 [rows, {k}] "
                         "with contiguous rows on the CPU")


class BlockOps:
    """The loaded library; methods check their arguments (ValueError naming the argument) and call
    the C entry points."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        compiled = isa_tiers.compiled_tiers(lib)
        self._tiers: dict[str, tuple[Isa, ...]] = {}
        self._x8_tiers: dict[str, tuple[Isa, ...]] = {}   # tiers with a kernel over the x8 layout
        for fmt in BLOCK_FORMATS:
            info = (ctypes.c_int32 * 5)()
            assert lib.bm_blk_format_info(weight_code(fmt), info) == 0, fmt
            elems, size, input_code, _, mask = info
            assert (elems, size) == block_geometry(fmt) and INPUT_TYPES[input_code] == input_type(fmt), fmt
            # a tier with a kernel over either layout (the other layout runs its next lower one there)
            self._tiers[fmt] = tuple(tier for tier in compiled if mask & (1 << tier | 1 << (tier + 8)))
            self._x8_tiers[fmt] = tuple(tier for tier in self._tiers[fmt] if mask & (1 << (tier + 8)))
            assert not self._x8_tiers[fmt] or fmt in X8_HALF_FIELDS, fmt

    def tiers(self, fmt: str) -> tuple[Isa, ...]:
        """The tiers of `fmt`'s linear kernels (over ggml's layout or the x8 one; a layout without a
        kernel of its own at a tier runs its next lower one) that the library compiled in and this
        CPU runs."""
        return self._tiers[_check_format(fmt)]

    def isa_level(self, fmt: str, isa: int | str | None = None) -> Isa:
        """The tier to run: `fmt`'s best at or below the cap (`isa`: an Isa value or name; else
        BATCH_MANAGER_CPU_ISA; else this CPU's best). ConfigError naming `isa` for a tier the CPU lacks."""
        if isa is not None and not isinstance(isa, str):
            isa = Isa(int(isa)).name.lower() if int(isa) in set(Isa) else str(isa)
        return isa_tiers.best_at_or_below(isa_tiers.cap(isa), self.tiers(fmt))

    def quantize_activations(self, x: torch.Tensor, fmt: str) -> QuantizedInput:
        """x float32 [rows, k] -> the blocks `fmt`'s dot kernel takes (what linear makes of x)."""
        kind, k = input_type(fmt), x.shape[-1]
        row_bytes(fmt, k)
        _check_rows(x, k)
        rows, in_block = x.shape[0], K_BLOCK if kind == "q8k" else 32
        q = torch.empty(rows, k, dtype=torch.int8)
        d = torch.empty(rows, k // in_block, dtype=torch.float32)
        sums = torch.empty(rows, k // SUM_GROUP[kind], dtype=torch.int16 if kind == "q8k" else torch.int32)
        status = self._lib.bm_blk_quantize(INPUT_TYPES.index(kind), x.data_ptr(), rows, x.stride(0), k, q.data_ptr(),
                                           d.data_ptr(), sums.data_ptr())
        assert status == 0, kind
        return QuantizedInput(kind, q, d, sums)

    def linear(self, x: torch.Tensor, blocks: torch.Tensor, fmt: str, k: int, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, accumulate: bool = False, isa: int | str | None = None) -> torch.Tensor:
        """y = x @ W^T (+ bias), W = `blocks` of `fmt` uint8 [n, row_bytes]; with `accumulate` the
        product is ADDED into `out` (the residual add). x float32 [rows, k] (contiguous rows) ->
        float32 [rows, n] (`out` when given: its rows contiguous)."""
        n = check_blocks(blocks, fmt, k)
        _check_rows(x, k)
        rows = x.shape[0]
        if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,) or not bias.is_contiguous()):
            raise ValueError(f"bias: {bias.dtype} {tuple(bias.shape)} is not float32 [{n}] contiguous")
        if out is None:
            if accumulate:
                raise ValueError("accumulate: needs `out` to add into")
            out = torch.empty(rows, n, dtype=torch.float32)
        elif out.dtype != torch.float32 or tuple(out.shape) != (rows, n) or out.stride(1) != 1:
            raise ValueError(f"out: {out.dtype} {tuple(out.shape)} is not float32 [{rows}, {n}] with contiguous rows")
        if rows == 0 or n == 0:
            return out
        level = self.isa_level(fmt, isa)
        status = self._lib.bm_blk_linear(weight_code(fmt), x.data_ptr(), rows, x.stride(0), blocks.data_ptr(), n, k,
                                         _ptr(bias), out.data_ptr(), out.stride(0), int(accumulate),
                                         torch.get_num_threads(), int(level))
        assert status == 0, fmt
        return out

    def bind(self, blocks: torch.Tensor, fmt: str, k: int, bias: torch.Tensor | None = None,
             isa: int | str | None = None) -> BoundLinear:
        """A BoundLinear `fn(x, out=None, accumulate=False)`: linear() of this weight with its checks
        and constant arguments done once (a generation step calls ~100 linears; linear()'s checks
        cost ~30 us a call). On a tier with kernels over the 8-row interleaved layout (every format
        on avx2) it holds the weight repacked (a copy of the same bytes, `fn.blocks`: drop your own
        reference to `blocks` to keep one copy); else `fn.blocks` is `blocks`."""
        check_blocks(blocks, fmt, k)
        self.linear(torch.zeros(1, k), blocks, fmt, k, bias, isa=isa)   # checks bias and isa
        level = self.isa_level(fmt, isa)
        if level in self._x8_tiers[fmt] and blocks.shape[0] >= 8:
            return BoundLinear(self, hold(repack_x8(blocks, fmt, k)), fmt, k, bias, level, "x8")
        return BoundLinear(self, blocks, fmt, k, bias, level, "ggml")

    def dequantize(self, blocks: torch.Tensor, fmt: str, k: int, start: int, stop: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 rows [start, stop) of W = `blocks` of `fmt`, bit for bit gguf.quants.dequantize,
        into `out` float32 [stop - start, k] (contiguous) when given."""
        n = check_blocks(blocks, fmt, k)
        if not 0 <= start <= stop <= n:
            raise ValueError(f"start, stop: [{start}, {stop}) is not a row range of the {n} rows")
        if out is None:
            out = torch.empty(stop - start, k, dtype=torch.float32)
        elif out.dtype != torch.float32 or tuple(out.shape) != (stop - start, k) or not out.is_contiguous():
            raise ValueError(f"out: {out.dtype} {tuple(out.shape)} is not float32 [{stop - start}, {k}] contiguous")
        status = self._lib.bm_blk_dequant(weight_code(fmt), blocks.data_ptr(), start, stop, k, out.data_ptr(),
                                          torch.get_num_threads())
        assert status == 0, fmt
        return out


class BoundLinear:
    """One weight's linear with its arguments checked once (BlockOps.bind). `blocks` uint8 [n,
    row_bytes]: the bytes it reads, in `layout` ("ggml", or "x8": repack_x8's); `fmt`, `k`, `n`."""

    def __init__(self, ops: BlockOps, blocks: torch.Tensor, fmt: str, k: int, bias: torch.Tensor | None,
                 level: Isa, layout: str):
        self.blocks, self.fmt, self.k, self.n, self.layout = blocks, fmt, k, blocks.shape[0], layout
        self._ops, self._bias = ops, bias   # both kept alive: the call passes raw pointers
        code = weight_code(fmt) | (LAYOUT_X8 if layout == "x8" else 0)
        fn, w_ptr, bias_ptr, n = ops._lib.bm_blk_linear, blocks.data_ptr(), _ptr(bias), self.n
        self._call = lambda x, rows, y, accumulate: fn(code, x.data_ptr(), rows, x.stride(0), w_ptr, n, k, bias_ptr,
                                                       y.data_ptr(), y.stride(0), accumulate,
                                                       torch.get_num_threads(), int(level))

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
        """y = x @ W^T (+ bias) (ADDED into `out` with `accumulate`). x float32 [rows, k] with
        contiguous rows on the CPU; `out` float32 [rows, n], its rows contiguous."""
        assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == self.k and x.stride(1) == 1
        rows = x.shape[0]
        y = torch.empty(rows, self.n, dtype=torch.float32) if out is None else out
        assert y.shape == (rows, self.n) and y.stride(1) == 1 and (out is not None or not accumulate)
        if rows:
            status = self._call(x, rows, y, int(accumulate))
            assert status == 0, self.fmt
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), k]: rows `ids` (int64 [T], each in [0, n), checked by the caller) of
        the weight, bit for bit dequantize's, whatever the layout: one native call (bm_blk_rows)
        gathering each row's bytes (x8: by x8_row_gather's map) and de-quantizing them (a generation
        step's embedding lookup; q5_0 over x8 unpacks the groups holding them)."""
        ids = ids.to(torch.int64).contiguous()
        grouped = self.n // 8 * 8 if self.layout == "x8" else 0
        gather = x8_row_gather(self.fmt, self.k) if grouped else None
        if grouped and gather is None:   # q5_0: its fifth bits are moved bit by bit
            if bool(((ids < 0) | (ids >= self.n)).any()):
                self._raise_outside(ids)
            return self._rows_by_unpack(ids, grouped)
        out = torch.empty(ids.shape[0], self.k, dtype=torch.float32)
        status = self._ops._lib.bm_blk_rows(weight_code(self.fmt), self.blocks.data_ptr(), self.n, self.k,
                                            _ptr(gather), ids.data_ptr(), ids.shape[0], out.data_ptr())
        if status == -2:
            self._raise_outside(ids)
        assert status == 0, (self.fmt, status)
        return out

    def _raise_outside(self, ids: torch.Tensor) -> None:
        outside = ids[(ids < 0) | (ids >= self.n)]
        raise IndexError(f"ids: row {int(outside[0])} is outside the {self.n} rows")

    def _rows_by_unpack(self, ids: torch.Tensor, grouped: int) -> torch.Tensor:
        out = torch.empty(ids.shape[0], self.k, dtype=torch.float32)
        in_group = ids < grouped
        if bool(in_group.any()):
            wanted = ids[in_group]
            groups, which = torch.unique(wanted // 8, return_inverse=True)
            row_bytes = self.blocks.shape[1]
            packed = self.blocks[:grouped].view(grouped // 8, 8 * row_bytes)[groups].view(-1, row_bytes)
            plain = unpack_x8(packed, self.fmt, self.k).view(groups.shape[0], 8, row_bytes)
            picked = plain[which, wanted % 8].contiguous()
            out[in_group] = self._ops.dequantize(picked, self.fmt, self.k, 0, picked.shape[0])
        if not bool(in_group.all()):
            picked = self.blocks[ids[~in_group]].contiguous()
            out[~in_group] = self._ops.dequantize(picked, self.fmt, self.k, 0, picked.shape[0])
        return out

    def dequantize(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 rows [start, stop) of the weight (BlockOps.dequantize, whatever the layout)."""
        if self.layout == "ggml" or not 0 <= start <= stop <= self.n:
            return self._ops.dequantize(self.blocks, self.fmt, self.k, start, stop, out)
        first, last = start // 8 * 8, min(self.n, -(-stop // 8) * 8)
        rows = unpack_x8(self.blocks[first:last], self.fmt, self.k) if last - first >= 8 else self.blocks[first:last]
        return self._ops.dequantize(rows, self.fmt, self.k, start - first, stop - first, out)


def block_ops() -> BlockOps | None:
    """The kernels (built and loaded once per process), or None where they cannot run here."""
    return cpu_native.load_ops(BlockOps)
