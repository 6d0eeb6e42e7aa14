"""Weight-only int8 / int4 weights (BuildConfig.weight_only): quantization at load and the stored
layout of an engine directory. The matmuls over them are the kernel backend's
(prepare_weight_only_linear; runtime/kernels/weight_only_linear.py on the torch backend).

Stored under the canonical weight name `W` (e.g. `layers.0.qkv.weight`, `lm_head`, a tied
`embed_tokens`):
  int8: `W` int8 [out, in], `W_scale` float32 [out]; w = q * scale (symmetric, per output channel).
  int4: `W` uint8 [out, in / 2], `W_scale` and `W_min` float16 [out, in / group_size] (0.625 bytes
        per weight in all; engine directories written with float32 ones load, converted);
        w = q * scale + min with q in 0..15 per group of group_size input columns; in group g,
        byte j holds column g*gs + j (low nibble) and g*gs + gs/2 + j (high nibble), GGUF
        Q4_0 / Q4_1's layout (Q4_1: scale d, min m; Q4_0: scale d, min -8 d).
int8 scales are float32, int4 scales and mins float16, whatever the compute dtype; norms and biases
stay in it. Under tensor
parallelism a rank holds the slices of the one quantized model (runtime.parallel.tensor_shard.selection:
an int4 group never straddles two ranks).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import BuildConfig, ModelConfig
from ..kernels.torch_dense import dequantize
from ..loading.weights import Weights, expected_shapes

_LINEAR_SUFFIXES = (".qkv.weight", ".out.weight", ".mlp_in.weight", ".mlp_out.weight")


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
            layout[name + "_scale"] = (torch.float16, (out, width // build.group_size))
            layout[name + "_min"] = (torch.float16, (out, width // build.group_size))
    return layout


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in], float32 scale [out]); round to nearest, |q| <= 127."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float -> (packed uint8 [out, in / 2], scale, min float16 [out, in / group_size]).
    The nibbles are rounded against the float16 scale and min they will be read with."""
    out, width = weight.shape
    assert width % group_size == 0, f"group_size {group_size} does not divide {width}"
    w = weight.float().view(out, width // group_size, group_size)
    half_max = torch.finfo(torch.float16).max
    low = w.amin(dim=2).clamp(-half_max, half_max).half()
    scale = ((w.amax(dim=2) - low.float()) / 15.0).clamp(max=half_max).half()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))   # also a range below float16's smallest step
    q = torch.round((w - low.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15).to(torch.uint8)
    half = group_size // 2
    packed = q[..., :half] | (q[..., half:] << 4)   # [out, groups, gs / 2]
    return packed.reshape(out, width // 2).contiguous(), scale.contiguous(), low.contiguous()


def quantize_weights(weights: Weights, cfg: ModelConfig, build: BuildConfig) -> Weights:
    """`weights` (whole, in the compute dtype) with the matmul weights quantized under `build`."""
    out = dict(weights)
    for name in quantized_names(cfg, build):
        if name not in weights:   # another pipeline stage's
            continue
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
