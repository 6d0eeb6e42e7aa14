// Linear family, llama.cpp's quantized block formats (quants_blocks.h) x 8-bit input blocks: per
// format a dot kernel per ISA tier over R input rows at once (R <= kMaxRows: each weight block is
// loaded and unpacked once and fed to the R rows), and the range driver that format_table.h makes
// a row of the format table. blocks.cpp's bm_blk_linear runs it over threads. Every format also
// has AVX2 and VNNI kernels over an 8-row interleaved layout (linear_blocks_avx2.h, the K formats'
// linear_blocks_avx2_k.h) and their driver linear_range_x8 (a bound weight's repacked copy,
// blocks.py's repack_x8).
//
// Contract of linear_range<K>(a, o0, o1): for outputs o in [o0, o1) and every input row r < a.rows
//     y[r, o] (+)= dot(w row o, input row r) (+ bias[o])
// w uint8 [n, row_bytes] (ggml's blocks, rows back to back), the input already quantized into the
// format's input type (QInput), y float32 row stride ldy. Outputs run in tiles of kTile; within a
// tile every group of kMaxRows input rows streams the tile's weights once (from L2 after the first).
//
// Arithmetic (ggml's x86 approach): per block the integer dot of the weight codes with the int8
// inputs, exact in int32; code offsets (q4_0: 8, q5_0: 16, q6_k: 32) and the K formats' mins either
// in the codes (AVX2's signed q4_0 / q5_0 codes) or through the input's integer block sums (s,
// bsums); then per block one float fma(isum, d_w * d_x, acc). The K formats, on every tier and
// layout, per super-block and row: acc = fma(float(isum), d_w * d_x, acc), then (q4_k, q5_k) acc =
// fma(-float(msum), dmin_w * d_x, acc), isum and msum the row's exact integer totals, acc from 0
// over the super-blocks in order: the same bits whichever kernel runs. |isum| < 2^24 for real data,
// so its float conversion is exact; the float sums round as any float dot product does
// (tests/runtime/kernels/test_blocks.py states its tolerance).
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include <algorithm>

#include "quants_blocks.h"

namespace bm_blk {

constexpr int kMaxRows = 4;     // input rows sharing each weight block load
constexpr int64_t kTile = 16;   // outputs whose weights stay cache-resident over the row groups

// An input quantized into a format's input type (quants_blocks.h); row r at q + r * k, d + r * nd,
// s + r * (k / 32) (q8x32), bsums + r * (k / 16) (q8k).
struct QInput {
  const int8_t* q;
  const float* d;
  const int32_t* s;
  const int16_t* bsums;
  int64_t k, nd;
  QInput rows_from(int64_t r) const {
    return {q + r * k, d + r * nd, s ? s + r * (k / kQ) : nullptr, bsums ? bsums + r * (k / 16) : nullptr, k, nd};
  }
};

struct LinearArgs {
  const uint8_t* w;
  int64_t row_bytes, n, k;
  QInput x;
  int64_t rows;
  const float* bias;
  float* y;
  int64_t ldy;
  int accumulate;
};

// ---- scalar tier: the integer sums, then the same float combination per block ----

struct ScalarQ8_0 {
  template <int R>
  static void dot(const uint8_t* row, const QInput& x, float out[R]) {
    const BlockQ8_0* b = (const BlockQ8_0*)row;
    const int64_t nb = x.k / kQ;
    for (int r = 0; r < R; ++r) out[r] = 0.f;
    for (int64_t i = 0; i < nb; ++i) {
      const float dw = f16(b[i].d);
      for (int r = 0; r < R; ++r) {
        const int8_t* q = x.q + r * x.k + i * kQ;
        int32_t isum = 0;
        for (int j = 0; j < kQ; ++j) isum += b[i].qs[j] * q[j];
        out[r] += (float)isum * (dw * x.d[r * x.nd + i]);
      }
    }
  }
};

// q4_0, q4_1, q5_0: unsigned codes u (0..15 or 0..31); value = d * (u - offset) (+ m for q4_1).
template <class B>
inline void codes32(const B& b, uint8_t u[32]) {
  for (int j = 0; j < 16; ++j) {
    u[j] = b.qs[j] & 15;
    u[j + 16] = b.qs[j] >> 4;
  }
}
inline void codes32(const BlockQ5_0& b, uint8_t u[32]) {
  uint32_t qh;
  memcpy(&qh, b.qh, 4);
  for (int j = 0; j < 16; ++j) {
    u[j] = (b.qs[j] & 15) | (((qh >> j) & 1) << 4);
    u[j + 16] = (b.qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
  }
}
inline float block_min(const BlockQ4_1& b) { return f16(b.m); }
template <class B>
inline float block_min(const B&) { return 0.f; }

template <class B, int kOffset, bool kHasMin>
struct ScalarSmall {
  template <int R>
  static void dot(const uint8_t* row, const QInput& x, float out[R]) {
    const B* b = (const B*)row;
    const int64_t nb = x.k / kQ;
    for (int r = 0; r < R; ++r) out[r] = 0.f;
    for (int64_t i = 0; i < nb; ++i) {
      uint8_t u[32];
      codes32(b[i], u);
      const float dw = f16(b[i].d), m = block_min(b[i]);
      for (int r = 0; r < R; ++r) {
        const int8_t* q = x.q + r * x.k + i * kQ;
        const int32_t s = x.s[r * nb + i];
        int32_t isum = 0;
        for (int j = 0; j < kQ; ++j) isum += u[j] * q[j];
        const float dx = x.d[r * x.nd + i];
        out[r] += (float)(isum - kOffset * s) * (dw * dx);
        if (kHasMin) out[r] += m * (dx * (float)s);
      }
    }
  }
};

// q4_k / q5_k: sub-block j's codes (0..31) of a super-block.
inline void codes_k4(const uint8_t* qs, const uint8_t* qh, int j, uint8_t u[32]) {
  for (int l = 0; l < 32; ++l)
    u[l] = ((qs[(j / 2) * 32 + l] >> ((j & 1) * 4)) & 15) | (qh ? ((qh[l] >> j) & 1) << 4 : 0);
}

inline const uint8_t* high_bits(const BlockQ4_K&) { return nullptr; }
inline const uint8_t* high_bits(const BlockQ5_K& b) { return b.qh; }

template <class B>
struct ScalarK4 {
  template <int R>
  static void dot(const uint8_t* row, const QInput& x, float out[R]) {
    const B* b = (const B*)row;
    const int64_t nb = x.k / kQK;
    for (int r = 0; r < R; ++r) out[r] = 0.f;
    for (int64_t i = 0; i < nb; ++i) {
      uint8_t sm[16];
      scales_mins_k4(b[i].scales, sm);
      int32_t isum[R] = {}, msum[R] = {};
      for (int j = 0; j < 8; ++j) {
        uint8_t u[32];
        codes_k4(b[i].qs, high_bits(b[i]), j, u);
        for (int r = 0; r < R; ++r) {
          const int8_t* q = x.q + r * x.k + i * kQK + j * 32;
          const int16_t* bs = x.bsums + r * (x.k / 16) + i * 16;
          int32_t sub = 0;
          for (int l = 0; l < 32; ++l) sub += u[l] * q[l];
          isum[r] += sm[j] * sub;
          msum[r] += sm[8 + j] * (bs[2 * j] + bs[2 * j + 1]);
        }
      }
      const float d = f16(b[i].d), dmin = f16(b[i].dmin);
      for (int r = 0; r < R; ++r) {
        const float dx = x.d[r * x.nd + i];
        out[r] = fmaf(-(float)msum[r], dmin * dx, fmaf((float)isum[r], d * dx, out[r]));
      }
    }
  }
};

struct ScalarQ6_K {
  template <int R>
  static void dot(const uint8_t* row, const QInput& x, float out[R]) {
    const BlockQ6_K* b = (const BlockQ6_K*)row;
    const int64_t nb = x.k / kQK;
    for (int r = 0; r < R; ++r) out[r] = 0.f;
    for (int64_t i = 0; i < nb; ++i) {
      int32_t isum[R] = {};
      for (int e0 = 0; e0 < kQK; e0 += 16) {   // one scale per 16 elements
        const int h = e0 / 128, c = (e0 % 128) / 32, l0 = e0 % 32;
        const uint8_t* ql = b[i].ql + h * 64 + (c & 1) * 32;
        const uint8_t* qh = b[i].qh + h * 32;
        uint8_t u[16];
        for (int l = 0; l < 16; ++l)
          u[l] = ((ql[l0 + l] >> ((c >> 1) * 4)) & 15) | (((qh[l0 + l] >> (2 * c)) & 3) << 4);
        for (int r = 0; r < R; ++r) {
          const int8_t* q = x.q + r * x.k + i * kQK + e0;
          int32_t sub = 0;
          for (int l = 0; l < 16; ++l) sub += u[l] * q[l];
          sub -= 32 * x.bsums[r * (x.k / 16) + i * 16 + e0 / 16];
          isum[r] += b[i].scales[e0 / 16] * sub;
        }
      }
      const float d = f16(b[i].d);
      for (int r = 0; r < R; ++r) out[r] = fmaf((float)isum[r], d * x.d[r * x.nd + i], out[r]);
    }
  }
};

using ScalarQ4_0 = ScalarSmall<BlockQ4_0, 8, false>;
using ScalarQ4_1 = ScalarSmall<BlockQ4_1, 0, true>;
using ScalarQ5_0 = ScalarSmall<BlockQ5_0, 16, false>;
using ScalarQ4_K = ScalarK4<BlockQ4_K>;
using ScalarQ5_K = ScalarK4<BlockQ5_K>;

}  // namespace bm_blk

#include "linear_blocks_avx2.h"
#include "linear_blocks_avx2_k.h"

namespace bm_blk {

// ---- the range driver over a kernel K (one of the structs above or in linear_blocks_avx2.h) ----

template <class K, int R>
void tile_rows(const LinearArgs& a, const QInput& x, int64_t r0, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o) {
    float out[R];
    K::template dot<R>(a.w + o * a.row_bytes, x, out);
    const float b = a.bias ? a.bias[o] : 0.f;
    for (int r = 0; r < R; ++r) {
      float* y = a.y + (r0 + r) * a.ldy + o;
      *y = (a.accumulate ? *y : 0.f) + (out[r] + b);
    }
  }
}

template <class K>
void linear_range(const LinearArgs& a, int64_t o0, int64_t o1) {
  for (int64_t t0 = o0; t0 < o1; t0 += kTile) {
    const int64_t t1 = std::min(o1, t0 + kTile);
    for (int64_t r0 = 0; r0 < a.rows; r0 += kMaxRows) {
      const QInput x = a.x.rows_from(r0);
      switch (std::min<int64_t>(kMaxRows, a.rows - r0)) {
        case 1: tile_rows<K, 1>(a, x, r0, t0, t1); break;
        case 2: tile_rows<K, 2>(a, x, r0, t0, t1); break;
        case 3: tile_rows<K, 3>(a, x, r0, t0, t1); break;
        default: tile_rows<K, 4>(a, x, r0, t0, t1); break;
      }
    }
  }
}

#ifdef BM_BLK_X8
// The 8-row interleaved layout (linear_blocks_avx2.h): groups of 8 outputs by KX8, the rows after
// the last whole group (n % 8, still in ggml's layout at their usual offsets) by K. o0 is a multiple
// of 8 (the callers split at whole tiles).
template <class KX8, int R>
void tile_groups(const LinearArgs& a, const QInput& x, int64_t r0, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; o += 8) {
    __m256 out[R];
    KX8::template group<R>(a.w + o * a.row_bytes, x, out);
    const __m256 b = a.bias ? _mm256_loadu_ps(a.bias + o) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      float* y = a.y + (r0 + r) * a.ldy + o;
      const __m256 before = a.accumulate ? _mm256_loadu_ps(y) : _mm256_setzero_ps();
      _mm256_storeu_ps(y, _mm256_add_ps(before, _mm256_add_ps(out[r], b)));
    }
  }
}

template <class KX8, class K>
void linear_range_x8(const LinearArgs& a, int64_t o0, int64_t o1) {
  const int64_t grouped = a.n / 8 * 8;
  for (int64_t t0 = o0; t0 < o1; t0 += kTile) {
    const int64_t t1 = std::min(o1, t0 + kTile), g1 = std::min(t1, std::max(t0, grouped));
    for (int64_t r0 = 0; r0 < a.rows; r0 += kMaxRows) {
      const QInput x = a.x.rows_from(r0);
      switch (std::min<int64_t>(kMaxRows, a.rows - r0)) {
        case 1: tile_groups<KX8, 1>(a, x, r0, t0, g1); tile_rows<K, 1>(a, x, r0, g1, t1); break;
        case 2: tile_groups<KX8, 2>(a, x, r0, t0, g1); tile_rows<K, 2>(a, x, r0, g1, t1); break;
        case 3: tile_groups<KX8, 3>(a, x, r0, t0, g1); tile_rows<K, 3>(a, x, r0, g1, t1); break;
        default: tile_groups<KX8, 4>(a, x, r0, t0, g1); tile_rows<K, 4>(a, x, r0, g1, t1); break;
      }
    }
  }
}
#endif  // BM_BLK_X8

}  // namespace bm_blk
