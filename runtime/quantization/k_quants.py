"""Quantizers of llama.cpp's K formats (Q4_K, Q5_K, Q6_K: super-blocks of 256 values) in numpy, so
that float checkpoints can be written as the GGUF files people download; the `gguf` package
de-quantizes these formats but does not quantize them (it does Q8_0 / Q4_x / Q5_x, which
`quantize` hands to it).

The arithmetic follows ggml's reference quantizers (`quantize_row_q{4,5,6}_K_ref` with
`make_qkx2_quants` / `make_qx_quants`), vectorized over blocks, in float32 with ties rounded to
even as ggml's `nearest_int` does; the stored bytes are ggml's block layouts:

    Q4_K  144 B: d f16, dmin f16, scales[12] (8 x 6-bit scale, 8 x 6-bit min), qs[128] (4-bit)
    Q5_K  176 B: d f16, dmin f16, scales[12], qh[32] (5th bits), qs[128]
    Q6_K  210 B: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8), d f16

    value = d * scale_j * q - dmin * min_j   (Q4_K, Q5_K; 8 sub-blocks of 32)
    value = d * scale_j * (q - 32)           (Q6_K; 16 sub-blocks of 16)
"""
from __future__ import annotations

import numpy as np

QK_K = 256
GROUP_MAX_EPS = np.float32(1e-15)
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def quantize(values: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [..., n] (n a multiple of the format's block) -> its stored bytes, uint8 [..., n /
    block * block bytes], for every format the `gguf` package de-quantizes and this module or
    the package quantizes."""
    import gguf
    values = np.ascontiguousarray(values, dtype=np.float32)
    if not np.isfinite(values).all():
        raise ValueError(f"{type_name}: the values to quantize hold NaN or infinity")
    if type_name not in K_TYPES:
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType[type_name])
    if values.shape[-1] % QK_K:
        raise ValueError(f"{type_name}: a row of {values.shape[-1]} values is not a multiple of {QK_K}")
    blocks = values.reshape(-1, QK_K)
    packed = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}[type_name](blocks)
    return packed.reshape(*values.shape[:-1], values.shape[-1] // QK_K * BLOCK_BYTES[type_name])


def _nearest(x: np.ndarray) -> np.ndarray:
    return np.rint(x).astype(np.int32)


def _fp16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float16)


# -- Q4_K / Q5_K: asymmetric sub-blocks of 32 --------------------------------------------------------

def _make_qkx2(x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_qkx2_quants over groups [..., n]: (scale [...], -min [...]) minimising the
    weighted squared error of scale * L + min, min <= 0, trying nstep + 1 grids. As in ggml, a
    better fit's min becomes the offset the later grids are laid from."""
    f32 = np.float32
    lo = np.minimum(x.min(-1), f32(0))
    hi = x.max(-1)
    sum_w = weights.sum(-1, dtype=f32)
    sum_x = (weights * x).sum(-1, dtype=f32)
    flat = hi == lo

    def grid(iscale_numerator: np.ndarray | np.float32, offset: np.ndarray) -> np.ndarray:
        span = hi - offset
        usable = span > 0
        iscale = np.where(usable, iscale_numerator / np.where(usable, span, f32(1)), f32(0))
        return np.clip(_nearest(iscale[..., None] * (x - offset[..., None])), 0, nmax).astype(f32), iscale

    levels, iscale = grid(f32(nmax), lo)
    scale = np.where(iscale > 0, f32(1) / np.where(iscale > 0, iscale, f32(1)), f32(0))
    best = (weights * (scale[..., None] * levels + lo[..., None] - x) ** 2).sum(-1, dtype=f32)
    offset = lo.copy()
    for step in range(nstep + 1):
        trial, _ = grid(f32(rmin) + f32(rdelta) * f32(step) + f32(nmax), offset)
        sum_l = (weights * trial).sum(-1, dtype=f32)
        sum_l2 = (weights * trial * trial).sum(-1, dtype=f32)
        sum_xl = (weights * trial * x).sum(-1, dtype=f32)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = np.where(ok, det, f32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = this_min > 0
        this_scale = np.where(positive, sum_xl / np.where(sum_l2 > 0, sum_l2, f32(1)), this_scale)
        this_min = np.where(positive, f32(0), this_min)
        error = (weights * (this_scale[..., None] * trial + this_min[..., None] - x) ** 2).sum(-1, dtype=f32)
        better = ok & ~flat & (error < best)
        best = np.where(better, error, best)
        scale = np.where(better, this_scale, scale)
        offset = np.where(better, this_min, offset)
    scale = np.where(flat, f32(0), scale)
    return scale.astype(f32), (-offset).astype(f32)


def _pack_scales_mins(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block [nb, 8] -> ggml's 12-byte layout [nb, 12]."""
    out = np.zeros((ls.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return out


def _asymmetric(blocks: np.ndarray, nmax: int, rmin: float, nstep: int):
    """(d f16 [nb], dmin f16 [nb], packed scales [nb, 12], levels [nb, 256] in 0..nmax)."""
    f32 = np.float32
    nb = blocks.shape[0]
    x = blocks.reshape(nb, 8, 32)
    av_x = np.sqrt((x * x).sum(-1, dtype=f32) / f32(32))
    weights = av_x[..., None] + np.abs(x)
    scales, mins = _make_qkx2(x, weights, nmax, rmin, 0.1, nstep)
    max_scale, max_min = scales.max(-1), mins.max(-1)
    inv_scale = np.where(max_scale > 0, f32(63) / np.where(max_scale > 0, max_scale, f32(1)), f32(0))
    inv_min = np.where(max_min > 0, f32(63) / np.where(max_min > 0, max_min, f32(1)), f32(0))
    ls = np.minimum(_nearest(inv_scale[:, None] * scales), 63).astype(np.uint8)
    lm = np.minimum(_nearest(inv_min[:, None] * mins), 63).astype(np.uint8)
    d, dmin = _fp16(max_scale / f32(63)), _fp16(max_min / f32(63))
    sub_d = d.astype(f32)[:, None] * ls.astype(f32)
    sub_m = dmin.astype(f32)[:, None] * lm.astype(f32)
    has_scale = sub_d != 0
    safe = np.where(has_scale, sub_d, f32(1))
    levels = np.clip(_nearest((x + sub_m[..., None]) / safe[..., None]), 0, nmax)
    levels = np.where(has_scale[..., None], levels, 0).astype(np.uint8).reshape(nb, QK_K)
    return d, dmin, _pack_scales_mins(ls, lm), levels


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, levels = _asymmetric(blocks, 15, -1.0, 20)
    halves = levels.reshape(-1, 4, 2, 32)                 # per 64 values: low nibbles, then high
    qs = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, levels = _asymmetric(blocks, 31, -0.5, 15)
    halves = levels.reshape(-1, 4, 2, 32)
    low = halves & 0xF
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = (levels.reshape(-1, 8, 32) >> 4).astype(np.uint8)     # sub-block j's 5th bit -> bit j of qh
    qh = np.zeros((levels.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qh, qs],
                          axis=1)


# -- Q6_K: symmetric sub-blocks of 16 -----------------------------------------------------------------

def _make_qx(x: np.ndarray, nmax: int) -> np.ndarray:
    """ggml's make_qx_quants with rmse_type 1 (weights x^2) over groups [..., n]: the scale."""
    f32 = np.float32
    index = np.abs(x).argmax(-1)
    signed_max = np.take_along_axis(x, index[..., None], -1)[..., 0]
    tiny = np.abs(signed_max) < GROUP_MAX_EPS
    safe_max = np.where(tiny, f32(1), signed_max)
    weights = x * x

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        levels = np.clip(_nearest(iscale[..., None] * x), -nmax, nmax - 1).astype(f32)
        return (weights * x * levels).sum(-1, dtype=f32), (weights * levels * levels).sum(-1, dtype=f32)

    sum_lx, sum_l2 = fit(f32(-nmax) / safe_max)
    scale = np.where(sum_l2 > 0, sum_lx / np.where(sum_l2 > 0, sum_l2, f32(1)), f32(0))
    best = scale * sum_lx
    for step in [s for s in range(-9, 10) if s]:
        lx, l2 = fit(-(f32(nmax) + f32(0.1) * f32(step)) / safe_max)
        better = (l2 > 0) & (lx * lx > best * l2)
        this_scale = lx / np.where(l2 > 0, l2, f32(1))
        scale = np.where(better, this_scale, scale)
        best = np.where(better, this_scale * lx, best)
    return np.where(tiny, f32(0), scale).astype(f32)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    f32 = np.float32
    nb = blocks.shape[0]
    x = blocks.reshape(nb, 16, 16)
    scales = _make_qx(x, 32)
    index = np.abs(scales).argmax(-1)
    max_scale = np.take_along_axis(scales, index[:, None], -1)[:, 0]
    empty = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = np.where(empty, f32(0), f32(-128) / np.where(empty, f32(1), max_scale))
    d = _fp16(np.where(empty, f32(0), f32(1) / np.where(empty, f32(1), iscale)))
    sub_scales = np.minimum(_nearest(iscale[:, None] * scales), 127).astype(np.int8)
    sub_d = d.astype(f32)[:, None] * sub_scales.astype(f32)
    has_scale = sub_d != 0
    levels = np.clip(_nearest(x / np.where(has_scale, sub_d, f32(1))[..., None]), -32, 31) + 32
    levels = np.where(has_scale[..., None], levels, 32).astype(np.uint8).reshape(nb, 2, 4, 32)  # [half, quarter, l]
    ql = np.concatenate([levels[:, :, 0] & 0xF | ((levels[:, :, 2] & 0xF) << 4),
                         levels[:, :, 1] & 0xF | ((levels[:, :, 3] & 0xF) << 4)], axis=2).reshape(nb, 128)
    qh = (levels[:, :, 0] >> 4 | ((levels[:, :, 1] >> 4) << 2) | ((levels[:, :, 2] >> 4) << 4)
          | ((levels[:, :, 3] >> 4) << 6)).reshape(nb, 64)
    sub_scales = np.where(empty[:, None], 0, sub_scales).astype(np.int8)
    return np.concatenate([ql, qh, sub_scales.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)
