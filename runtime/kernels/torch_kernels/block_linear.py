"""Matmuls over weights kept in llama.cpp's block formats, the torch backend's prepare_block_linear /
linear / linear_add (interface.KernelBackend): `BlockLinear`, one prepared linear per canonical
weight, made of row segments each in its own format (runtime.quantization.block_weights).

Each segment computes its columns of the output. On a CPU where the native block kernels run
(runtime.kernels.cpu.blocks: integer dot products against 8-bit-quantized activations) every input
goes to them, whatever its row count; where they do not run, tiles of TILE_OUTPUTS output rows are
de-quantized (the formats' torch de-quantization) and multiplied with torch's GEMM, as
QuantizedLinear._tiled does.

Why the native kernels at every row count: they read each weight tile once per group of 4 input
rows from cache, where the tiles path de-quantizes every weight again per call. One thread of CPU
time on an AMD EPYC (AVX2), GFLOP/s native / tiles: q4_0 8192x2048 at 16, 64, 256 rows 93 / 7,
93 / 16, 91 / 47; q8_0 68 / 6, 76 / 16, 68 / 33; q4_k 67 / 7, 61 / 19, 57 / 40; q6_k 71 / 9,
79 / 28, 62 / 43; SmolLM2's 1536x576 q4_0 67 / 4, 81 / 14, 74 / 29. Only q5_k (no 8-row
interleaved kernel) fell behind, at 256 rows (52 / 58): not worth a second path.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ...quantization.gguf_blocks import BlockFormat

# Output rows de-quantized at a time on the GEMM path (a float32 tile of 256 x 2048 is 2 MiB).
TILE_OUTPUTS = 256


def block_ops():
    """The native block kernels' binding where it is built and runs here, else None. NOTE: lazy
    and guarded: the binding (runtime.kernels.cpu.blocks) is its own module and may be absent."""
    try:
        from ..cpu.blocks import block_ops as native_block_ops
    except ModuleNotFoundError as e:
        if e.name != f"{__package__.rsplit('.', 1)[0]}.cpu.blocks":
            raise
        return None
    return native_block_ops()


class BlockLinear:
    """`x @ W^T + bias` for W held as row segments [(format, uint8 [rows_i, row_bytes_i]), ...];
    `weight` (PreparedLinear's) is the first segment's tensor, `segments` all of them."""

    def __init__(self, segments: Sequence[tuple[BlockFormat, torch.Tensor]], bias: torch.Tensor | None):
        assert segments, "a block weight has at least one segment"
        self.segments: list[tuple[BlockFormat, torch.Tensor, int, int]] = []   # (format, blocks, first, last column)
        start = 0
        widths = set()
        for fmt, blocks in segments:
            self.segments.append((fmt, blocks.contiguous(), start, start + blocks.shape[0]))
            widths.add(fmt.columns(blocks.shape[1]))
            start += blocks.shape[0]
        assert len(widths) == 1, f"segments of different input widths {sorted(widths)}"
        self.in_features, = widths
        self.num_outputs = start
        self.weight = self.segments[0][1]
        self.bias = bias
        self.bias_f32 = None if bias is None else bias.float().contiguous()
        self.ops = block_ops() if self.weight.device.type == "cpu" else None
        # per segment: the native linear bound once (its checks and constant arguments), or None
        self.kernels = ([self.ops.bind(blocks, fmt.name, self.in_features, self._segment_bias(first, last))
                         for fmt, blocks, first, last in self.segments] if self.ops is not None else None)
        if self.kernels is not None:
            # One copy: a bound kernel may hold its segment repacked (cpu/blocks.py's x8 layout);
            # that tensor replaces the file's blocks, read back through the kernel's dequantize.
            self.segments = [(fmt, kernel.blocks, first, last)
                             for kernel, (fmt, _, first, last) in zip(self.kernels, self.segments)]
            self.weight = self.segments[0][1]

    def segment_tensors(self) -> list[torch.Tensor]:
        """The tensor each segment is held as, in order (the model's weights refer to these)."""
        return [blocks for _, blocks, _, _ in self.segments]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64 [T]) of the de-quantized weight, float32 [T, in] (a tied table's lookup):
        per segment one gather of the rows it holds (one segment with a native kernel: its own lookup,
        which checks the ids)."""
        if len(self.segments) == 1 and self.kernels is not None:
            return self.kernels[0].rows(ids)
        outside = (ids < 0) | (ids >= self.num_outputs)
        if bool(outside.any()):
            raise IndexError(f"ids: row {int(ids[outside][0])} is outside the {self.num_outputs} rows")
        out = torch.empty(ids.shape[0], self.in_features, dtype=torch.float32)
        for segment, (fmt, blocks, first, last) in enumerate(self.segments):
            held = (ids >= first) & (ids < last)
            if not bool(held.any()):
                continue
            local = ids[held] - first
            if self.kernels is not None:
                out[held] = self.kernels[segment].rows(local)
            else:
                out[held] = fmt.dequantize(blocks[local]).float()
        return out

    def _segment_bias(self, first: int, last: int) -> torch.Tensor | None:
        return None if self.bias_f32 is None else self.bias_f32[first:last]

    def _native(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [rows, out] by the native kernels, each segment into its columns (strided rows);
        into `out`, accumulated, where given."""
        xf = x.float()
        xf = xf if xf.stride(1) == 1 else xf.contiguous()
        accumulate = out is not None
        y = out if accumulate else torch.empty(x.shape[0], self.num_outputs, dtype=torch.float32)
        for kernel, (_, _, first, last) in zip(self.kernels, self.segments):
            kernel(xf, y[:, first:last], accumulate)
        return y

    def _dequantized_tile(self, segment: int, start: int, stop: int) -> torch.Tensor:
        """float32 rows [start, stop) of segment `segment`."""
        if self.kernels is not None:
            return self.kernels[segment].dequantize(start, stop)
        fmt, blocks, _, _ = self.segments[segment]
        return fmt.dequantize(blocks[start:stop])

    def dequantized(self) -> torch.Tensor:
        """float32 [out, in]: the whole weight (tests, references)."""
        return torch.cat([self._dequantized_tile(segment, 0, last - first)
                          for segment, (_, _, first, last) in enumerate(self.segments)])

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, in] -> [rows, out] as a transposed view of [out, rows] (consumers take strided inputs)."""
        x_t = x.t()
        y_t = torch.empty(self.num_outputs, x.shape[0], dtype=x.dtype, device=x.device)
        for segment, (_, _, first, last) in enumerate(self.segments):
            for start in range(0, last - first, TILE_OUTPUTS):
                stop = min(start + TILE_OUTPUTS, last - first)
                tile = self._dequantized_tile(segment, start, stop).to(x.dtype)
                torch.mm(tile, x_t, out=y_t[first + start:first + stop])
        if self.bias is not None:
            y_t += self.bias.to(x.dtype)[:, None]
        return y_t.t()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out] in x's dtype."""
        if self.ops is not None:
            y = self._native(x)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        return self._tiled(x)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x), into `residual` (float32, rows contiguous) where the native kernels
        run, else a new tensor."""
        if (self.ops is not None and residual.dtype == torch.float32
                and residual.stride(1) == 1):
            return self._native(x, out=residual)
        return residual + self(x)
