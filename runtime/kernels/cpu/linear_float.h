// Linear family, float weights: the few-row GEMV range drivers of float32 and bf16 weights
// [n, k] (the checkpoint's own layout). Callers split the outputs over threads; ops.cpp's
// bm_linear / bm_linear_bf16 and the fused step run these same ranges.
//   float32: y[r, o] (+)= sum_k x[r, k] * w[o, k] (+ bias[o]), float32 FMA 8 wide.
//   bf16: w bf16 [n, k]; x float32 or bf16; y float32 or bf16 (rounded to nearest even once); sums
//       in float32. kDp: AVX512-BF16's dot product (x bf16) where compiled for it, else bf16 widened
//       by a 16-bit shift.
#pragma once

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>

#include "vec.h"

namespace bm_float {

using bm::bf16_to_f32;
using bm::f32_to_bf16;
using bm::hsum8;
using bm::load1_f32;
using bm::load8_f32;
using bm::row_prefetch_bytes;

// R rows x O outputs of bm_linear: R * O accumulators over k, each x vector loaded once for O
// FMAs, each weight vector once for R. The next tile's weight rows are prefetched one cache line
// per 16 floats: a tile streams O short runs of the weight, too short for the hardware prefetcher.
template <int R, int O>
inline void linear_tile(const float* x, int64_t ldx, const float* w, int64_t k, const float* bias, float* y,
                        int64_t ldy, int accumulate, bool prefetch) {
  __m256 acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = _mm256_setzero_ps();
  int64_t kk = 0;
  for (; kk + 8 <= k; kk += 8) {
    __m256 wv[O];
    for (int o = 0; o < O; ++o) wv[o] = _mm256_loadu_ps(w + o * k + kk);
    if (prefetch && (kk & 15) == 0)
      for (int o = 0; o < O; ++o) _mm_prefetch((const char*)(w + (O + o) * k + kk), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      __m256 xv = _mm256_loadu_ps(x + r * ldx + kk);
      asm("" : "+x"(xv));  // NOTE: keeps xv in a register; folded into each FMA it is loaded O times
      for (int o = 0; o < O; ++o) acc[r][o] = _mm256_fmadd_ps(xv, wv[o], acc[r][o]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) {
      float s = hsum8(acc[r][o]);
      for (int64_t t = kk; t < k; ++t) s += x[r * ldx + t] * w[o * k + t];
      if (bias) s += bias[o];
      float* dst = y + r * ldy + o;
      *dst = accumulate ? *dst + s : s;
    }
}

// Outputs [n0, n1) for every row: per tile of O outputs, all rows (tiles of 4, then the rest), so
// the tile's weight rows come from memory once and stay in L1 for the later row tiles while the
// prefetches of the next tile are in flight. O: 4 outputs for 2 rows, 3 from 3 rows
// (12 accumulators; measured 1.07-1.10x over 2 at 8 rows, and over row tiles outermost).
template <int O>
void linear_outputs(const float* x, int64_t rows, int64_t ldx, const float* w, int64_t o, int64_t k,
                    const float* bias, float* y, int64_t ldy, int accumulate, bool prefetch) {
  const float* wo = w + o * k;
  const float* bo = bias ? bias + o : nullptr;
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4)
    linear_tile<4, O>(x + r * ldx, ldx, wo, k, bo, y + r * ldy + o, ldy, accumulate, prefetch && r == 0);
  const float* xr = x + r * ldx;
  float* yr = y + r * ldy + o;
  switch (rows - r) {
    case 3: linear_tile<3, O>(xr, ldx, wo, k, bo, yr, ldy, accumulate, prefetch && r == 0); break;
    case 2: linear_tile<2, O>(xr, ldx, wo, k, bo, yr, ldy, accumulate, prefetch && r == 0); break;
    case 1: linear_tile<1, O>(xr, ldx, wo, k, bo, yr, ldy, accumulate, prefetch && r == 0); break;
    default: break;
  }
}

template <int O>
void linear_range(const float* x, int64_t rows, int64_t ldx, const float* w, int64_t n0, int64_t n1, int64_t k,
                  const float* bias, float* y, int64_t ldy, int accumulate) {
  int64_t o = n0;
  for (; o + O <= n1; o += O) linear_outputs<O>(x, rows, ldx, w, o, k, bias, y, ldy, accumulate, o + 2 * O <= n1);
  for (; o < n1; ++o) linear_outputs<1>(x, rows, ldx, w, o, k, bias, y, ldy, accumulate, false);
}

// One row: outputs [n0, n1) one weight row after another, so a thread reads its range of the
// weight as one sequential stream (the hardware prefetcher's case); 4 accumulators of 8 lanes, x in
// L1. SmolLM2's weights per token (538 MB), 2 threads, AMD EPYC Zen 4, a standalone loop over
// every matrix: 1.21-1.23x the 8-output tile's rate (its 8 interleaved streams and software
// prefetch) on 4 KiB pages, 1.27-1.35x on huge pages, as fast as a plain sum over the same buffers;
// at 4 rows the tiles (weights read once for all rows) are as fast as this order. On Intel a software
// prefetch 2 KiB ahead runs beside the hardware's (bm::row_prefetch_bytes: 1.2-1.3x there).
template <bool kPrefetch>
inline void linear_row_stream(const float* x, const float* w, int64_t n0, int64_t n1, int64_t k, const float* bias,
                              float* y, int accumulate, int64_t ahead) {
  for (int64_t o = n0; o < n1; ++o) {
    const float* wo = w + o * k;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t kk = 0;
    for (; kk + 32 <= k; kk += 32) {
      if (kPrefetch) {   // this step's two lines' worth, `ahead` bytes on (bm::row_prefetch_bytes)
        _mm_prefetch((const char*)(wo + kk) + ahead, _MM_HINT_T0);
        _mm_prefetch((const char*)(wo + kk + 16) + ahead, _MM_HINT_T0);
      }
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wo + kk), _mm256_loadu_ps(x + kk), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(wo + kk + 8), _mm256_loadu_ps(x + kk + 8), a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(wo + kk + 16), _mm256_loadu_ps(x + kk + 16), a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(wo + kk + 24), _mm256_loadu_ps(x + kk + 24), a3);
    }
    for (; kk + 8 <= k; kk += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wo + kk), _mm256_loadu_ps(x + kk), a0);
    float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; kk < k; ++kk) s += x[kk] * wo[kk];
    if (bias) s += bias[o];
    y[o] = accumulate ? y[o] + s : s;
  }
}
inline void linear_row_sequential(const float* x, const float* w, int64_t n0, int64_t n1, int64_t k,
                                  const float* bias, float* y, int accumulate) {
  if (const int64_t ahead = row_prefetch_bytes()) linear_row_stream<true>(x, w, n0, n1, k, bias, y, accumulate, ahead);
  else linear_row_stream<false>(x, w, n0, n1, k, bias, y, accumulate, 0);
}

// Outputs [n0, n1) of every row: one row sequentially, more rows in tiles whose width is chosen by
// the row count (more outputs per tile for fewer rows: independent FMA chains).
inline void linear_rows_range(const float* x, int64_t rows, int64_t ldx, const float* w, int64_t n0, int64_t n1,
                              int64_t k, const float* bias, float* y, int64_t ldy, int accumulate) {
  switch (rows) {
    case 1: linear_row_sequential(x, w, n0, n1, k, bias, y, accumulate); break;
    case 2: linear_range<4>(x, rows, ldx, w, n0, n1, k, bias, y, ldy, accumulate); break;
    default: linear_range<3>(x, rows, ldx, w, n0, n1, k, bias, y, ldy, accumulate); break;  // 3 rows and more
  }
}

constexpr int64_t kOutputsPerUnit = 48;  // a multiple of every tile's O; the unit of thread work

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kHasDpbf16 = true;
inline __m512bh load32_bf16(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load32_bf16(const uint16_t* p, __mmask32 m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }

// R x O dot products of length k with AVX512-BF16: 32 bf16 pairs per instruction into 16 float lanes.
template <int R, int O>
inline void dot_tile_dp(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k, float s[R][O], bool prefetch) {
  __m512 acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = _mm512_setzero_ps();
  int64_t kk = 0;
  for (; kk + 32 <= k; kk += 32) {
    __m512bh wv[O];
    for (int o = 0; o < O; ++o) wv[o] = load32_bf16(w + o * k + kk);
    if (prefetch)
      for (int o = 0; o < O; ++o) _mm_prefetch((const char*)(w + (O + o) * k + kk), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      __m512bh xv = load32_bf16(x + r * ldx + kk);
      for (int o = 0; o < O; ++o) acc[r][o] = _mm512_dpbf16_ps(acc[r][o], xv, wv[o]);
    }
  }
  if (kk < k) {
    const __mmask32 m = _cvtu32_mask32((1u << (k - kk)) - 1u);
    __m512bh wv[O];
    for (int o = 0; o < O; ++o) wv[o] = load32_bf16(w + o * k + kk, m);
    for (int r = 0; r < R; ++r) {
      __m512bh xv = load32_bf16(x + r * ldx + kk, m);
      for (int o = 0; o < O; ++o) acc[r][o] = _mm512_dpbf16_ps(acc[r][o], xv, wv[o]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) s[r][o] = _mm512_reduce_add_ps(acc[r][o]);
}
#else
constexpr bool kHasDpbf16 = false;
#endif

// R x O dot products of length k, bf16 weights widened by a 16-bit shift, 8-wide FMA (AVX2).
template <typename X, int R, int O>
inline void dot_tile_avx2(const X* x, int64_t ldx, const uint16_t* w, int64_t k, float s[R][O], bool prefetch) {
  __m256 acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = _mm256_setzero_ps();
  int64_t kk = 0;
  for (; kk + 8 <= k; kk += 8) {
    __m256 wv[O];
    for (int o = 0; o < O; ++o) wv[o] = load8_f32(w + o * k + kk);
    if (prefetch && (kk & 31) == 0)
      for (int o = 0; o < O; ++o) _mm_prefetch((const char*)(w + (O + o) * k + kk), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      __m256 xv = load8_f32(x + r * ldx + kk);
      for (int o = 0; o < O; ++o) acc[r][o] = _mm256_fmadd_ps(xv, wv[o], acc[r][o]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) {
      float t = hsum8(acc[r][o]);
      for (int64_t j = kk; j < k; ++j) t += load1_f32(x + r * ldx + j) * bf16_to_f32(w[o * k + j]);
      s[r][o] = t;
    }
}

struct Bf16LinearArgs {
  const void* x;
  bool x_bf16;
  int64_t rows, ldx;
  const uint16_t* w;
  int64_t n, k;
  const float* bias;
  void* y;
  bool y_bf16;
  int64_t ldy;
  int accumulate;
};

// y[r, o] = s + bias[o], into y's type (added to what it holds with accumulate).
inline void store_bf16_linear_output(const Bf16LinearArgs& a, int64_t r, int64_t o, float s) {
  const float v = s + (a.bias ? a.bias[o] : 0.f);
  const int64_t at = r * a.ldy + o;
  if (a.y_bf16) {
    uint16_t* dst = static_cast<uint16_t*>(a.y) + at;
    *dst = f32_to_bf16(a.accumulate ? bf16_to_f32(*dst) + v : v);
  } else {
    float* dst = static_cast<float*>(a.y) + at;
    *dst = a.accumulate ? *dst + v : v;
  }
}

template <bool kDp, int R, int O>
inline void linear_bf16_tile(const Bf16LinearArgs& a, int64_t r0, int64_t o0, bool prefetch) {
  float s[R][O];
  const uint16_t* w = a.w + o0 * a.k;
  if constexpr (kDp && kHasDpbf16) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    dot_tile_dp<R, O>(static_cast<const uint16_t*>(a.x) + r0 * a.ldx, a.ldx, w, a.k, s, prefetch);
#endif
  } else if (a.x_bf16) {
    dot_tile_avx2<uint16_t, R, O>(static_cast<const uint16_t*>(a.x) + r0 * a.ldx, a.ldx, w, a.k, s, prefetch);
  } else {
    dot_tile_avx2<float, R, O>(static_cast<const float*>(a.x) + r0 * a.ldx, a.ldx, w, a.k, s, prefetch);
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) store_bf16_linear_output(a, r0 + r, o0 + o, s[r][o]);
}

constexpr int64_t kBf16SequentialMaxColumns = 2048;

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// One row, x bf16, up to kBf16SequentialMaxColumns: each weight row read after the last (one
// sequential stream per thread, as linear_row_sequential), 4 accumulators of 8 lanes, 16 bf16 pairs
// per instruction. Measured on an AMD EPYC Zen 4, 1 thread, weights cold, GB/s of bf16 weight
// (x aligned), against the 8-output tile: 1536 x 576 14.6 -> 26.5, 576 x 1536 22.1 -> 28.5,
// 2048 x 2048 24.6 -> 28.4, 8192 x 2048 20.8 -> 21.2; 4096 x 4096 23.8 -> 24.3 but 21.5 -> 19.8
// with x 16 bytes off, 2048 x 8192 22.0 -> 17.1 (there the tile's x loads, once per 8 outputs, win).
template <bool kPrefetch>
inline void linear_bf16_row_stream(const Bf16LinearArgs& a, int64_t n0, int64_t n1, int64_t ahead) {
  const uint16_t* x = static_cast<const uint16_t*>(a.x);
  const auto load16 = [](const uint16_t* p) { return (__m256bh)_mm256_loadu_si256((const __m256i*)p); };
  for (int64_t o = n0; o < n1; ++o) {
    const uint16_t* w = a.w + o * a.k;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t kk = 0;
    for (; kk + 64 <= a.k; kk += 64) {
      if (kPrefetch) {   // as linear_row_stream
        _mm_prefetch((const char*)(w + kk) + ahead, _MM_HINT_T0);
        _mm_prefetch((const char*)(w + kk + 32) + ahead, _MM_HINT_T0);
      }
      a0 = _mm256_dpbf16_ps(a0, load16(x + kk), load16(w + kk));
      a1 = _mm256_dpbf16_ps(a1, load16(x + kk + 16), load16(w + kk + 16));
      a2 = _mm256_dpbf16_ps(a2, load16(x + kk + 32), load16(w + kk + 32));
      a3 = _mm256_dpbf16_ps(a3, load16(x + kk + 48), load16(w + kk + 48));
    }
    for (; kk + 16 <= a.k; kk += 16) a0 = _mm256_dpbf16_ps(a0, load16(x + kk), load16(w + kk));
    float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; kk < a.k; ++kk) s += bf16_to_f32(x[kk]) * bf16_to_f32(w[kk]);
    store_bf16_linear_output(a, 0, o, s);
  }
}
inline void linear_bf16_row_sequential(const Bf16LinearArgs& a, int64_t n0, int64_t n1) {
  if (const int64_t ahead = row_prefetch_bytes()) linear_bf16_row_stream<true>(a, n0, n1, ahead);
  else linear_bf16_row_stream<false>(a, n0, n1, 0);
}
constexpr bool kHasBf16RowSequential = true;
#else
constexpr bool kHasBf16RowSequential = false;
inline void linear_bf16_row_sequential(const Bf16LinearArgs&, int64_t, int64_t) {}
#endif

// Outputs [o0, o0 + O) for every row, row tiles of 4 then the rest (as linear_outputs).
template <bool kDp, int O>
void linear_bf16_outputs(const Bf16LinearArgs& a, int64_t o0, bool prefetch) {
  int64_t r = 0;
  for (; r + 4 <= a.rows; r += 4) linear_bf16_tile<kDp, 4, O>(a, r, o0, prefetch && r == 0);
  switch (a.rows - r) {
    case 3: linear_bf16_tile<kDp, 3, O>(a, r, o0, prefetch && r == 0); break;
    case 2: linear_bf16_tile<kDp, 2, O>(a, r, o0, prefetch && r == 0); break;
    case 1: linear_bf16_tile<kDp, 1, O>(a, r, o0, prefetch && r == 0); break;
    default: break;
  }
}

template <bool kDp, int O>
void linear_bf16_range(const Bf16LinearArgs& a, int64_t n0, int64_t n1) {
  int64_t o = n0;
  for (; o + O <= n1; o += O) linear_bf16_outputs<kDp, O>(a, o, o + 2 * O <= n1);
  for (; o < n1; ++o) linear_bf16_outputs<kDp, 1>(a, o, false);
}

// Outputs [n0, n1) of every row (as linear_rows_range).
template <bool kDp>
void linear_bf16_rows_range(const Bf16LinearArgs& a, int64_t n0, int64_t n1) {
  switch (a.rows) {
    case 1:
      if (kDp && kHasBf16RowSequential && a.k <= kBf16SequentialMaxColumns) linear_bf16_row_sequential(a, n0, n1);
      else linear_bf16_range<kDp, 8>(a, n0, n1);
      break;
    case 2: linear_bf16_range<kDp, 4>(a, n0, n1); break;
    default:
      if (kDp) linear_bf16_range<kDp, 4>(a, n0, n1);  // 16 accumulators of 32 zmm registers
      else linear_bf16_range<kDp, 3>(a, n0, n1);
      break;
  }
}

template <bool kDp>
void linear_bf16(const Bf16LinearArgs& a, int num_threads) {
  const int64_t units = (a.n + kOutputsPerUnit - 1) / kOutputsPerUnit;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t u = 0; u < units; ++u)
    linear_bf16_rows_range<kDp>(a, u * kOutputsPerUnit, std::min(a.n, (u + 1) * kOutputsPerUnit));
}

}  // namespace bm_float
