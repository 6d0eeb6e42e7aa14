"""The K-format quantizers: the bytes equal a line-by-line transliteration of ggml's reference
quantizer (scalar float32 loops) on fixed blocks, the `gguf` package de-quantizes them close to the
input in llama.cpp's quality order, and edge rows (zeros, constants, outliers, non-finite) behave."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from runtime.quantization.k_quants import BLOCK_BYTES, K_TYPES, quantize

F = np.float32


def nearest(v) -> int:
    return int(np.rint(F(v)))


def make_qkx2(x, w, nmax, rmin, rdelta, nstep):
    n = len(x)
    lo, hi, sum_w, sum_x = x[0], x[0], w[0], F(w[0] * x[0])
    for i in range(1, n):
        lo, hi = min(lo, x[i]), max(hi, x[i])
        sum_w = F(sum_w + w[i])
        sum_x = F(sum_x + F(w[i] * x[i]))
    lo = min(lo, F(0))
    if hi == lo:
        return F(0), F(-lo), [0] * n
    iscale = F(F(nmax) / F(hi - lo))
    scale = F(F(1) / iscale)
    levels = [max(0, min(nmax, nearest(iscale * F(x[i] - lo)))) for i in range(n)]
    best = F(0)
    for i in range(n):
        diff = F(F(scale * levels[i]) + lo - x[i])
        best = F(best + F(w[i] * F(diff * diff)))
    for step in range(nstep + 1):
        iscale = F(F(F(rmin) + F(F(rdelta) * step) + nmax) / F(hi - lo))
        aux = [max(0, min(nmax, nearest(iscale * F(x[i] - lo)))) for i in range(n)]
        sl = sl2 = sxl = F(0)
        for i in range(n):
            sl = F(sl + F(w[i] * aux[i]))
            sl2 = F(sl2 + F(F(w[i] * aux[i]) * aux[i]))
            sxl = F(sxl + F(F(w[i] * aux[i]) * x[i]))
        det = F(F(sum_w * sl2) - F(sl * sl))
        if det > 0:
            this_scale = F(F(F(sum_w * sxl) - F(sum_x * sl)) / det)
            this_min = F(F(F(sl2 * sum_x) - F(sl * sxl)) / det)
            if this_min > 0:
                this_min, this_scale = F(0), F(sxl / sl2)
            error = F(0)
            for i in range(n):
                diff = F(F(this_scale * aux[i]) + this_min - x[i])
                error = F(error + F(w[i] * F(diff * diff)))
            if error < best:
                levels, best, scale, lo = aux, error, this_scale, this_min
    return scale, F(-lo), levels


def asymmetric_block(x, nmax, rmin, nstep):
    scales, mins = [], []
    for j in range(8):
        sub = x[32 * j:32 * j + 32]
        av = F(np.sqrt(F(sum(F(v * v) for v in sub)) / F(32)))
        s, m, _ = make_qkx2(sub, [F(av + abs(v)) for v in sub], nmax, rmin, 0.1, nstep)
        scales.append(s)
        mins.append(m)
    max_scale, max_min = max(max(scales), F(0)), max(max(mins), F(0))
    inv_s = F(63) / max_scale if max_scale > 0 else F(0)
    inv_m = F(63) / max_min if max_min > 0 else F(0)
    ls = [min(63, nearest(F(inv_s * s))) for s in scales]
    lm = [min(63, nearest(F(inv_m * m))) for m in mins]
    packed = [0] * 12
    for j in range(8):
        if j < 4:
            packed[j], packed[j + 4] = ls[j], lm[j]
        else:
            packed[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4)
            packed[j - 4] |= (ls[j] >> 4) << 6
            packed[j] |= (lm[j] >> 4) << 6
    d, dmin = np.float16(max_scale / F(63)), np.float16(max_min / F(63))
    levels = [0] * 256
    for j in range(8):
        sd, sm = F(F(d) * ls[j]), F(F(dmin) * lm[j])
        if sd:
            for i in range(32):
                levels[32 * j + i] = max(0, min(nmax, nearest(F(x[32 * j + i] + sm) / sd)))
    return d.tobytes() + dmin.tobytes() + bytes(packed), levels


def reference_q4_k_block(x) -> bytes:
    head, levels = asymmetric_block(x, 15, -1.0, 20)
    return head + bytes(levels[j + i] | (levels[j + i + 32] << 4) for j in range(0, 256, 64) for i in range(32))


def reference_q5_k_block(x) -> bytes:
    head, levels = asymmetric_block(x, 31, -0.5, 15)
    qh, ql = [0] * 32, []
    for c, n in enumerate(range(0, 256, 64)):
        for i in range(32):
            low, high = levels[n + i], levels[n + i + 32]
            if low > 15:
                low -= 16
                qh[i] |= 1 << (2 * c)
            if high > 15:
                high -= 16
                qh[i] |= 2 << (2 * c)
            ql.append(low | (high << 4))
    return head + bytes(qh) + bytes(ql)


def make_qx(x, nmax):
    amax, signed_max = F(0), F(0)
    for v in x:
        if abs(v) > amax:
            amax, signed_max = abs(v), v
    if amax < F(1e-15):
        return F(0)
    w = [F(v * v) for v in x]

    def fit(iscale):
        slx = sl2 = F(0)
        for i, v in enumerate(x):
            q = max(-nmax, min(nmax - 1, nearest(F(iscale * v))))
            slx = F(slx + F(F(w[i] * v) * q))
            sl2 = F(sl2 + F(F(w[i] * q) * q))
        return slx, sl2

    slx, sl2 = fit(F(F(-nmax) / signed_max))
    scale = F(slx / sl2) if sl2 else F(0)
    best = F(scale * slx)
    for step in [s for s in range(-9, 10) if s]:
        lx, l2 = fit(F(-F(F(nmax) + F(F(0.1) * step)) / signed_max))
        if l2 > 0 and F(lx * lx) > F(best * l2):
            scale = F(lx / l2)
            best = F(scale * lx)
    return scale


def reference_q6_k_block(x) -> bytes:
    scales = [make_qx(x[16 * j:16 * j + 16], 32) for j in range(16)]
    max_scale = max(scales, key=abs)
    if abs(max_scale) < F(1e-15):
        return bytes(210)
    iscale = F(F(-128) / max_scale)
    d = np.float16(F(1) / iscale)
    sub = [min(127, nearest(F(iscale * s))) for s in scales]
    levels = [32] * 256
    for j in range(16):
        sd = F(F(d) * sub[j])
        if sd:
            for i in range(16):
                levels[16 * j + i] = max(-32, min(31, nearest(x[16 * j + i] / sd))) + 32
    ql, qh = [0] * 128, [0] * 64
    for half in range(2):
        base = [levels[128 * half + 32 * k:128 * half + 32 * k + 32] for k in range(4)]
        for i in range(32):
            ql[64 * half + i] = (base[0][i] & 0xF) | ((base[2][i] & 0xF) << 4)
            ql[64 * half + 32 + i] = (base[1][i] & 0xF) | ((base[3][i] & 0xF) << 4)
            qh[32 * half + i] = (base[0][i] >> 4) | ((base[1][i] >> 4) << 2) | ((base[2][i] >> 4) << 4) \
                | ((base[3][i] >> 4) << 6)
    return bytes(ql) + bytes(qh) + np.array(sub, dtype=np.int8).tobytes() + d.tobytes()


def rows(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (0.02 * rng.standard_normal((4, 256))).astype(F)
    x[1] += F(0.05)                       # all-positive sub-blocks: the min clamps to 0
    x[2, 17] = F(0.9)                     # an outlier
    x[3, :64] = F(0)                      # empty sub-blocks beside full ones
    return x


@pytest.mark.parametrize("type_name, reference", [("Q4_K", reference_q4_k_block), ("Q5_K", reference_q5_k_block),
                                                        ("Q6_K", reference_q6_k_block)])
def test_bytes_equal_ggml_reference_transliteration(type_name, reference):
    for seed in range(2):
        x = rows(seed)
        ours = quantize(x, type_name)
        for r in range(x.shape[0]):
            assert ours[r].tobytes() == reference(list(x[r])), (type_name, seed, r)


@pytest.mark.parametrize("type_name", K_TYPES)
def test_dequantized_close_and_sized(type_name):
    x = (0.02 * np.random.default_rng(1).standard_normal((17, 512))).astype(F)
    q = quantize(x, type_name)
    assert q.dtype == np.uint8 and q.shape == (17, 2 * BLOCK_BYTES[type_name])
    y = gguf.quants.dequantize(q, gguf.GGMLQuantizationType[type_name])
    bound = {"Q4_K": 0.09, "Q5_K": 0.045, "Q6_K": 0.023}[type_name]
    assert np.sqrt(((y - x) ** 2).mean() / (x ** 2).mean()) < bound


def test_quality_order_matches_llama_cpp():
    x = (0.02 * np.random.default_rng(2).standard_normal((32, 1024))).astype(F)

    def error(type_name):
        y = gguf.quants.dequantize(quantize(x, type_name), gguf.GGMLQuantizationType[type_name])
        return float(((y - x) ** 2).mean())
    assert error("Q6_K") < error("Q5_K") < error("Q4_K") < error("Q4_0")


@pytest.mark.parametrize("type_name", K_TYPES)
def test_edge_rows(type_name):
    kind = gguf.GGMLQuantizationType[type_name]
    assert not gguf.quants.dequantize(quantize(np.zeros((2, 256), F), type_name), kind).any()
    constant = np.full((1, 256), -0.5, F)
    np.testing.assert_allclose(gguf.quants.dequantize(quantize(constant, type_name), kind), constant, atol=1e-3)
    with pytest.raises(ValueError, match="not a multiple of 256"):
        quantize(np.zeros((1, 576), F), type_name)
    bad = np.zeros((1, 256), F)
    bad[0, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        quantize(bad, type_name)


def test_other_formats_go_to_the_gguf_package():
    x = np.random.default_rng(3).standard_normal((2, 64)).astype(F)
    assert quantize(x, "Q8_0").tobytes() == gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).tobytes()
