"""Weight-only matmuls, the torch backend's prepare_weight_only_linear / linear / linear_add
(interface.KernelBackend): `QuantizedLinear`, held to torch_dense.weight_only_linear (the formats'
layouts and de-quantization: runtime.quantization, looked up by the weight's stored dtype).
"""
from __future__ import annotations

import torch

from ..cpu import act_quant as aq
from ..cpu.cpu_weight_only import weight_only_ops
from ..cpu.weight_memory import hold
from ...quantization import lookup_dtype
from .torch_dense import weight_only_linear

# NOTE: torch's aten._weight_int8pack_mm (bf16 activations) is not used: measured slower than the
# native kernel with bf16 activations too (1 thread, AVX-512, ms native / aten: 1536x576 1 row
# 0.038 / 0.052, 8 rows 0.171 / 0.198; 49152x576 1 row 1.02 / 1.67, 8 rows 4.37 / 6.23).
# Output channels de-quantized at a time on the torch path (no native kernels on this CPU).
TILE_OUTPUTS = 256


class QuantizedLinear:
    """`x @ W^T + bias` for a quantized W on W's device: on a CPU with the native kernels, at every
    row count their GEMV (few rows) or fused de-quantize-and-multiply GEMM (linear_weight_only_gemm.h:
    a bounded per-thread float32 buffer, no de-quantized copy of the weight); torch's GEMM on
    de-quantized tiles on a CPU without them; the torch reference off CPU.

    act_quant "int8": x is quantized per block of 32 columns first and the products are integer
    (act_quant.py), at every row count: the native kernels over the weight repacked once here
    (`packed`, which then replaces the stored weight: `weight` and `parts` are its tensors) on a
    CPU that runs them, act_quant's torch reference over the stored weight elsewhere."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
                 bias: torch.Tensor | None, act_quant: str | None = None):
        self.weight, self.scale, self.minimum = weight, scale, minimum
        self.format = lookup_dtype(weight.dtype)
        self.parts = tuple(part for part in (scale, minimum) if part is not None)   # the format's, in its order
        self.bias = bias
        self.bias_f32 = None if bias is None else bias.float().contiguous()
        self.act_quant = act_quant
        self.num_outputs = self.weight.shape[0]
        self.packed, self.act_kernel = None, None
        if act_quant is not None:
            act_ops = aq.act_quant_ops() if weight.device.type == "cpu" else None
            if act_ops is not None:
                self.packed = aq.pack(weight, scale, minimum)
                self.act_kernel = act_ops.bind(self.packed, self.bias_f32)
        if self.act_kernel is not None:
            # One copy: the repacked weight replaces the stored one (every row count runs on it;
            # `rows` reads a tied table's lookups from it).
            self.weight, self.scale, self.minimum = self.packed.packed, self.packed.scale, self.packed.minimum
            self.parts = tuple(part for part in (self.scale, self.minimum) if part is not None)
            self.ops = self.kernel = None
            return
        self.ops = weight_only_ops() if weight.device.type == "cpu" else None
        if self.ops is not None:   # in huge pages (weight_memory.py), replacing the stored tensor
            self.weight = hold(self.weight)
        self.kernel = (None if self.ops is None
                       else self.ops.bind(self.weight, self.scale, self.minimum, self.bias_f32))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64 [T]) of the de-quantized weight: float32 [T, in] (a tied table's lookup
        reads the head's one copy: the stored rows, or the repacked ones)."""
        if self.packed is not None:
            return aq.packed_rows(self.packed, ids)
        return self.format.dequantize(*(t[ids] for t in (self.weight, *self.parts))).float()

    def _native(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        xf = x.float() if x.dtype != torch.float32 else x
        return self.kernel(xf if xf.stride(1) == 1 else xf.contiguous(), out)

    def _dequantized_tile(self, start: int, stop: int) -> torch.Tensor:
        return self.format.dequantize(*(t[start:stop] for t in (self.weight, *self.parts)))

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, in] -> [rows, out] as a transposed view of [out, rows] (consumers take strided inputs)."""
        x_t = x.t()
        y_t = torch.empty(self.num_outputs, x.shape[0], dtype=x.dtype, device=x.device)
        for start in range(0, self.num_outputs, TILE_OUTPUTS):
            stop = min(start + TILE_OUTPUTS, self.num_outputs)
            torch.mm(self._dequantized_tile(start, stop).to(x.dtype), x_t, out=y_t[start:stop])
        if self.bias is not None:
            y_t += self.bias.to(x.dtype)[:, None]
        return y_t.t()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out] in x's dtype."""
        if self.act_quant is not None:
            if self.act_kernel is not None:
                return self.act_kernel(x.float()).to(x.dtype)
            return aq.int8_act_linear_reference(x.float(), self.weight, self.scale, self.minimum,
                                                self.bias_f32).to(x.dtype)
        if self.ops is not None:
            y = self._native(x)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        if self.ops is None and x.device.type != "cpu":
            return weight_only_linear(x, self.weight, self.scale, self.minimum, self.bias)
        return self._tiled(x)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x), into `residual` (float32, rows contiguous) where the native kernel runs."""
        if self.act_kernel is not None and residual.dtype == torch.float32 and residual.stride(1) == 1:
            return self.act_kernel(x.float(), residual)
        if self.act_quant is not None:
            return residual + self(x)
        if self.ops is not None and residual.dtype == torch.float32 and residual.stride(1) == 1:
            return self._native(x, out=residual)
        return residual + self(x)
