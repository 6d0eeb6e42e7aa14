"""Weight-only int8 / int4 weights (BuildConfig.weight_only): quantization at load, the stored
layout of an engine directory, the torch reference, and `QuantizedLinear`, which runtime.models.transformer
uses in place of runtime.models.linear.Linear for a quantized weight.

Stored under the canonical weight name `W` (e.g. `layers.0.qkv.weight`, `lm_head`, a tied
`embed_tokens`):
  int8: `W` int8 [out, in], `W_scale` float32 [out]; w = q * scale (symmetric, per output channel).
  int4: `W` uint8 [out, in / 2], `W_scale` and `W_min` float32 [out, in / group_size];
        w = q * scale + min with q in 0..15 per group of group_size input columns; in group g,
        byte j holds column g*gs + j (low nibble) and g*gs + gs/2 + j (high nibble), GGUF
        Q4_0 / Q4_1's layout (Q4_1: scale d, min m; Q4_0: scale d, min -8 d).
Scales and mins are float32 whatever the compute dtype; norms and biases stay in it. Under tensor
parallelism a rank holds the slices of the one quantized model (runtime.parallel.tensor_shard.selection:
an int4 group never straddles two ranks).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import BuildConfig, ModelConfig
from ..kernels.cpu_weight_only import weight_only_ops
from ..loading.weights import Weights, expected_shapes

_LINEAR_SUFFIXES = (".qkv.weight", ".out.weight", ".mlp_in.weight", ".mlp_out.weight")
# Rows up to which the native kernel runs; above, torch's GEMM on de-quantized tiles. Measured on
# SmolLM2's shapes (1 thread, AVX-512, ms native / tiled): int8 3072x576 at 24 rows 0.81 / 0.91,
# at 32 1.07 / 0.89; int4 g32 at 16 rows 1.18 / 1.25, at 24 1.79 / 1.57 (lm_head alike).
NATIVE_MAX_ROWS = {"int8": 24, "int4": 16}
# NOTE: torch's aten._weight_int8pack_mm (bf16 activations) is not used: measured slower than the
# native kernel with bf16 activations too (1 thread, AVX-512, ms native / aten: 1536x576 1 row
# 0.038 / 0.052, 8 rows 0.171 / 0.198; 49152x576 1 row 1.02 / 1.67, 8 rows 4.37 / 6.23).
# Output channels de-quantized at a time on the many-row path (a float32 tile of 256 x 1536 is 1.5 MiB).
TILE_OUTPUTS = 256


def quantized_names(cfg: ModelConfig, build: BuildConfig) -> list[str]:
    """The canonical weights stored quantized under `build` (none without weight_only)."""
    if build.weight_only is None:
        return []
    names = [name for name in expected_shapes(cfg) if name.endswith(_LINEAR_SUFFIXES)]
    if "lm_head" not in build.weight_only_skip:
        names.append("embed_tokens" if cfg.tie_word_embeddings else "lm_head")
    return names


def stored_layout(cfg: ModelConfig, build: BuildConfig) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape) of every quantized tensor (weights, scales, mins) an engine stores."""
    shapes, layout = expected_shapes(cfg), {}
    for name in quantized_names(cfg, build):
        out, width = shapes[name]
        if build.weight_only == "int8":
            layout[name] = (torch.int8, (out, width))
            layout[name + "_scale"] = (torch.float32, (out,))
        else:
            layout[name] = (torch.uint8, (out, width // 2))
            layout[name + "_scale"] = (torch.float32, (out, width // build.group_size))
            layout[name + "_min"] = (torch.float32, (out, width // build.group_size))
    return layout


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in], float32 scale [out]); round to nearest, |q| <= 127."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float -> (packed uint8 [out, in / 2], scale, min float32 [out, in / group_size])."""
    out, width = weight.shape
    assert width % group_size == 0, f"group_size {group_size} does not divide {width}"
    w = weight.float().view(out, width // group_size, group_size)
    low, high = w.amin(dim=2), w.amax(dim=2)
    scale = (high - low) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((w - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    half = group_size // 2
    packed = q[..., :half] | (q[..., half:] << 4)   # [out, groups, gs / 2]
    return packed.reshape(out, width // 2).contiguous(), scale.contiguous(), low.contiguous()


def dequantize(weight: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight [out, in] of a quantized one (also of a row subset: any leading rows)."""
    if weight.dtype == torch.int8:
        return weight.float() * scale[:, None]
    out, groups = scale.shape
    packed = weight.view(out, groups, -1)
    q = torch.cat([packed & 15, packed >> 4], dim=2).float()   # [out, groups, gs]
    return (q * scale[..., None] + minimum[..., None]).reshape(out, -1)


def reference_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """The torch reference every kernel is tested against: de-quantize, then F.linear in float32."""
    y = F.linear(x.float(), dequantize(weight, scale, minimum), None if bias is None else bias.float())
    return y.to(x.dtype)


def quantize_weights(weights: Weights, cfg: ModelConfig, build: BuildConfig) -> Weights:
    """`weights` (whole, in the compute dtype) with the matmul weights quantized under `build`."""
    out = dict(weights)
    for name in quantized_names(cfg, build):
        if build.weight_only == "int8":
            out[name], out[name + "_scale"] = quantize_int8(weights[name])
        else:
            out[name], out[name + "_scale"], out[name + "_min"] = quantize_int4(weights[name], build.group_size)
    return out


def padded_rows(weights: Weights, name: str, num_rows: int) -> Weights:
    """`name` and its scales and mins (when quantized) with `num_rows` zero rows appended: rows that
    compute 0 (a rank's lm_head padded to the vocabulary chunk)."""
    parts = [part for part in (name, name + "_scale", name + "_min") if part in weights]
    return {part: F.pad(weights[part], (0, 0) * (weights[part].dim() - 1) + (0, num_rows)) for part in parts}


def is_quantized(weights: Weights, name: str) -> bool:
    return name + "_scale" in weights


def lookup_rows(weights: Weights, name: str, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of the (quantized) table `name`, de-quantized to `dtype`: [len(ids), in]."""
    minimum = weights.get(name + "_min")
    return dequantize(weights[name][ids], weights[name + "_scale"][ids],
                      None if minimum is None else minimum[ids]).to(dtype)


class QuantizedLinear:
    """`x @ W^T + bias` for a quantized W: the native kernel up to NATIVE_MAX_ROWS rows on CPU,
    torch's GEMM on de-quantized tiles above (and the torch reference off CPU)."""

    def __init__(self, weights: Weights, name: str, bias: torch.Tensor | None, device: torch.device):
        self.weight, self.scale = weights[name], weights[name + "_scale"]
        self.minimum = weights.get(name + "_min")
        self.bias = bias
        self.bias_f32 = None if bias is None else bias.float().contiguous()
        self.ops = weight_only_ops() if device.type == "cpu" else None
        self.num_outputs = self.weight.shape[0]
        self.kernel = (None if self.ops is None
                       else self.ops.bind(self.weight, self.scale, self.minimum, self.bias_f32))
        self.max_native_rows = NATIVE_MAX_ROWS["int8" if self.minimum is None else "int4"]

    def _native(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        xf = x.float() if x.dtype != torch.float32 else x
        return self.kernel(xf if xf.stride(1) == 1 else xf.contiguous(), out)

    def _dequantized_tile(self, start: int, stop: int) -> torch.Tensor:
        if self.ops is None:
            minimum = None if self.minimum is None else self.minimum[start:stop]
            return dequantize(self.weight[start:stop], self.scale[start:stop], minimum)
        tile = torch.empty(stop - start, self.weight.shape[1] * (1 if self.minimum is None else 2))
        if self.minimum is None:
            return self.ops.dequant_int8(self.weight, self.scale, start, stop, tile)
        return self.ops.dequant_int4(self.weight, self.scale, self.minimum, start, stop, tile)

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
        if self.ops is not None and x.shape[0] <= self.max_native_rows:
            y = self._native(x)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        if self.ops is None and x.device.type != "cpu":
            return reference_linear(x, self.weight, self.scale, self.minimum, self.bias)
        return self._tiled(x)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x), into `residual` (float32, rows contiguous) where the native kernel runs."""
        if (self.ops is not None and x.shape[0] <= self.max_native_rows and residual.dtype == torch.float32
                and residual.stride(1) == 1):
            return self._native(x, out=residual)
        return residual + self(x)
