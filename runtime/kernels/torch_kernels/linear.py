"""Matmul weights prepared once for their device, the torch backend's prepare_linear / linear /
linear_add (interface.KernelBackend): `Linear(weight, bias)(x) = x @ weight^T + bias`.

On CUDA this is F.linear. On CPU the kernel choice matters at the row counts of serving (tens of
rows per generation step), where BLAS sgemm is far from its large-matrix peak. Measured on the
default model's shapes (2 AVX2 cores, fp32, GFLOP/s at 34 / 64 rows; machine peak ~187):

  lm_head 512 -> 32000:  x @ W^T stored [in, out] 69 / 99,  W @ x^T 80 / 119,  oneDNN 115 / 137
  mlp_in  512 -> 3072:   x @ W^T stored [in, out] 99 / 104, W @ x^T 113 / 156, oneDNN 125 / 143

so CPU float32 weights are reordered once for oneDNN (`torch.ops.mkldnn._reorder_linear_weight`,
the path torch.compile's CPU backend takes for frozen linears) when this torch build has it and
it agrees with F.linear on a probe; otherwise they stay [out, in] and are applied as W @ x^T
(BLAS with a transposed operand, no copy), whose [out, rows] result is returned as a transposed
view: consumers take strided inputs.

NOTE: oneDNN's primitive cache and ideep's per-shape cache keep ~0.5-4 MiB per distinct (rows,
weight) shape, and serving sees every row count: RSS grew without end (samples.memory_soak, 12
rounds of 40 random requests: 1811 -> 2154 MiB, +72 over the last 6 rounds). So the oneDNN path
pads rows to 43 buckets and runs inputs above MAX_KERNEL_ROWS in chunks (`kernel_rows`): 1778 ->
1889 MiB, -13 over the last 6 rounds. Cost per generation step at 1/8/34/64 rows, one A/B run
(1 thread, interleaved, median): 0.99/1.02/1.10/0.99x, 1.05x for a 300-token context step.
Rejected: powers of two up to 64 (1.46x at 34 rows); w_xt throughout (0.85/1.39/1.29/1.04x);
oneDNN cache capacities of 4 (env vars that must precede the first oneDNN call; measured in a
second process against w_xt as the common yardstick: 1.61/1.24/1.15/1.00x).

Generation steps of a few sequences are a matrix-vector product bound by reading the weights:
there, wherever cpu_native.py can run (float32; BATCH_MANAGER_CPU_NATIVE=0 turns it off), inputs
of at most NATIVE_MAX_ROWS rows go to the native kernel, which multiplies by the [out, in] weight
as stored; larger ones to the impl above.

NOTE: one copy of each weight. Where the native kernel runs, the [out, in] weight it reads is the
engine's own tensor (`Linear.plain`: the engine directory's mapped file pages, copied once into huge
pages by kernels/cpu/weight_memory.py where the kernel has them, the copy replacing the mapped
tensor) and oneDNN multiplies that same tensor above NATIVE_MAX_ROWS; oneDNN's reordered weight replaces it only where no native
kernel runs. Measured on SmolLM2-135M float32 (AMD EPYC, AVX2, 1 thread, in one process,
interleaved, best of 3, on a machine busy with other work: ratios only), ms per 1-row step / 32-row
step / 512-token context step: plain + reordered (the two copies before) 223 / 1384 / 13831;
plain, oneDNN on it 193 / 958 / 12549; plain, w_xt above 16 rows 203 / 1149 / 17169; reordered
alone (no native kernel, so no fused step) 428 / 1474 / 11974. The reordered copy alone makes a
one-stream step 2.2x slower (context steps within noise); the plain weight alone costs nothing
measurable, and a serving process holds 1.0x the weight bytes instead of 2.04x
(samples.microbench.resident_memory). Measured
(samples.microbench.linear, every weight of the default model per pass, 2 threads, best of 15,
ms native / oneDNN): 1 row 6.6 / 7.9, 4 rows 7.8 / 9.3, 8 rows 9.5 / 10.9, 12 rows 12.0 / 12.7,
16 rows 13.8 / 14.8, 64 rows 40.5 / 38.9: the kernel is a dot product per (row, output) tile,
bound by the weight stream up to a few rows and by its FMA issue rate beyond; oneDNN's blocked
GEMM wins at 64.

bf16 weights (an engine in bfloat16): up to NATIVE_MAX_ROWS_BF16 rows the native bf16 kernel
(cpu_native_bf16.py: half the bytes of float32, summed in float32), beyond it oneDNN's bf16 GEMM
(AMX or AVX512-BF16 kernels, as the CPU has them; `w_xt` where this torch build has none), on the
same [out, in] tensor (one copy, as for float32; on an AMX CPU oneDNN then lays the weight out per
call: not measured, no AMX machine here).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..cpu.cpu_native import native_ops
from ..cpu.cpu_native_bf16 import bf16_ops
from ..cpu.weight_memory import hold

CPU_IMPLS = ("onednn", "w_xt")
# Rows up to which the native kernel runs (oneDNN's blocked GEMM wins at 64: samples.microbench.linear).
NATIVE_MAX_ROWS = 16
# bf16 weights: rows up to which the native bf16 kernel runs, oneDNN's bf16 GEMM beyond. NOTE: every
# weight of SmolLM2-135M per pass, 1 thread, AVX512-BF16 without AMX, ms native / oneDNN bf16:
# 1 row 19.7 / 25.3, 4 rows 26.1 / 44.4, 8 rows 40.4 / 52.6, 16 rows 68.6 / 57.2; with AMX oneDNN
# wins from about 8 rows (3-3.7x fp32 there).
NATIVE_MAX_ROWS_BF16 = 8
# Rows of one oneDNN call: longer inputs run in chunks of this many rows (the MLP chunks its
# rows by the same count), so the number of distinct kernel shapes does not grow with
# max_num_tokens.
MAX_KERNEL_ROWS = 1024


def bucket_rows(rows: int) -> int:
    """The padded row count for 1 <= rows <= MAX_KERNEL_ROWS: a power of two up to 8, a multiple
    of 8 up to 64, then eight buckets per octave (at most 12.5 % padding): 43 buckets in all."""
    if rows < 1 or rows > MAX_KERNEL_ROWS:
        raise ValueError(f"rows: expected 1..{MAX_KERNEL_ROWS}, got {rows}")
    if rows <= 8:
        return 1 << (rows - 1).bit_length()
    step = 8 if rows <= 64 else 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


def kernel_rows(rows: int) -> list[tuple[int, int]]:
    """(rows taken, rows the kernel sees) of each oneDNN call for an input of `rows` rows."""
    calls = [(MAX_KERNEL_ROWS, MAX_KERNEL_ROWS)] * (rows // MAX_KERNEL_ROWS)
    if rows % MAX_KERNEL_ROWS:
        calls.append((rows % MAX_KERNEL_ROWS, bucket_rows(rows % MAX_KERNEL_ROWS)))
    return calls


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.lru_cache(maxsize=None)
def onednn_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear exists in this build and matches F.linear (probed once)."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        weight, bias = torch.randn(24, 40, generator=gen).to(dtype), torch.randn(24, generator=gen).to(dtype)
        x = torch.randn(5, 40, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        tol = 1e-5 if dtype == torch.float32 else 2e-2   # bf16: its own rounding of the sums
        return bool(torch.allclose(y.float(), F.linear(x, weight, bias).float(), rtol=tol, atol=tol))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def default_cpu_impl(dtype: torch.dtype) -> str:
    return "onednn" if onednn_available(dtype) else "w_xt"


class Linear:
    """One weight [out, in] (and optional bias [out]) ready for `device`; `impl` forces a CPU kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, device: torch.device,
                 impl: str | None = None):
        self.bias = bias
        if device.type != "cpu":
            self.impl = "linear"
        else:
            self.impl = impl or default_cpu_impl(weight.dtype)
            if self.impl not in CPU_IMPLS:
                raise ValueError(f"impl: expected one of {CPU_IMPLS}, got {self.impl!r}")
            if self.impl == "onednn" and not onednn_available(weight.dtype):
                raise ValueError(f"impl: oneDNN linear is not available for {weight.dtype} in this torch build")
        # rows <= NATIVE_MAX_ROWS: the native kernel on [out, in] (where it runs); more: impl.
        self.native = native_ops() if device.type == "cpu" and weight.dtype == torch.float32 else None
        # bf16 weights: rows <= NATIVE_MAX_ROWS_BF16 take the native bf16 kernel (bias in float32).
        self.native_bf16 = bf16_ops() if device.type == "cpu" and weight.dtype == torch.bfloat16 else None
        self.bias_f32 = bias.float().contiguous() if self.native_bf16 is not None and bias is not None else None
        # One copy of the weight (NOTE: at the top of this module): the [out, in] matrix where a
        # native kernel reads it, oneDNN then multiplying that same tensor above its rows; oneDNN's
        # reordered weight (replacing the original) only where no native kernel runs.
        # (in huge pages, weight_memory.py: the copy replaces the engine's mapped tensor)
        self.plain = hold(weight) if self.native is not None or self.native_bf16 is not None else None
        if self.plain is not None:
            self.weight = self.plain
        elif self.impl == "onednn":   # nothing else may read it as an [out, in] matrix
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out] (on CPU's w_xt path a transposed view of [out, rows])."""
        if self.native is not None and x.shape[0] <= NATIVE_MAX_ROWS:
            return self.native.linear(x if x.stride(1) == 1 else x.contiguous(), self.plain, self.bias)
        if self._takes_native_bf16(x):
            return self.native_bf16.linear(x if x.stride(1) == 1 else x.contiguous(), self.plain, self.bias_f32)
        if self.impl == "onednn":
            return self._onednn(x)
        if self.impl == "linear":
            return F.linear(x, self.weight, self.bias)
        y = torch.mm(self.weight, x.t())
        if self.bias is not None:
            y += self.bias[:, None]
        return y.t()

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x), written into `residual` where the native kernel can (one pass, no
        temporary), else a new tensor. residual [rows, out]; returns the sum."""
        if (self.native is not None and x.shape[0] <= NATIVE_MAX_ROWS and residual.dtype == torch.float32
                and residual.stride(1) == 1):
            return self.native.linear(x if x.stride(1) == 1 else x.contiguous(), self.plain, self.bias, out=residual)
        if (self._takes_native_bf16(x) and residual.dtype in (torch.bfloat16, torch.float32)
                and residual.stride(1) == 1):
            return self.native_bf16.linear(x if x.stride(1) == 1 else x.contiguous(), self.plain, self.bias_f32,
                                           out=residual)
        return residual + self(x)

    def _takes_native_bf16(self, x: torch.Tensor) -> bool:
        return (self.native_bf16 is not None and x.shape[0] <= NATIVE_MAX_ROWS_BF16
                and x.dtype in (torch.bfloat16, torch.float32))

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out] through calls of bucketed row counts (zero rows padded)."""
        outputs, start = [], 0
        for taken, padded in kernel_rows(x.shape[0]):
            chunk = x[start:start + taken]
            if padded > taken:
                chunk = F.pad(chunk, (0, 0, 0, padded - taken))
            y = _onednn_linear(chunk, self.weight, self.bias)
            outputs.append(y[:taken] if padded > taken else y)
            start += taken
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
