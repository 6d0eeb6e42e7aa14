// Linear family, int8 activations (input type: Q8 blocks of 32): integer GEMVs, activations
// quantized per block of 32 input columns to symmetric int8, dot products with int8 / int4 weights
// in int32 (vpdpbusd), like
// llama.cpp's Q8_0 x Q8_0 and Q4_0 x Q8_0. ops.cpp (bm_aq_*) and the fused step call
// quantize_rows and act_linear_range (namespace bm_aq).
//
// Contracts (all arrays contiguous):
//   quantize_rows: x float32 [rows, k], k % 32 == 0 -> per block b of 32 columns
//       d[r, b] = max|x| / 127, q[r, j] = round-half-even(x / d) in [-127, 127] (0 where d == 0),
//       s[r, b] = sum of the block's q. q int8 [rows, k], d float32 [rows, k/32], s int32 [rows, k/32].
//   act_linear_range: outputs [n0, n1) of
//       int8: y[r, o] (+)= scale[o] * sum_b d[r, b] * (sum_{j in b} w[o, j] q[r, j]) (+ bias[o])
//       int4: y[r, o] (+)= sum_b d[r, b] * (scale[o, g] * (sum_{j in b} nib[o, j] q[r, j])
//                                             + min[o, g] * s[r, b]) (+ bias[o]),  g = b * 32 / gs
//       n0 a multiple of kActUnit, n1 too or n1 == n; any number of rows (blocks of up to V::kRows
//       share each weight vector load; at batch the units go in panels of kPanelBytes of weights,
//       each met by every row block while it sits in L2). Single-threaded: callers split the units
//       over threads.
//   Packed layouts (act_quant.pack builds them once at load; n_units = ceil(n / 16), rows past n are
//   zero weights with zero scales), per unit of 16 output rows and per 32-column block b:
//       int8: 8 vectors of 64 bytes; vector j, lane i (output 16u + i) holds w[o, 32b + 4j .. +3] + 128
//             (unsigned). scale float32 [n_units * 16].
//       int4: 4 vectors of 64 bytes; vector j, lane i holds in its low nibbles columns 32b + 4j .. +3
//             and in its high nibbles columns 32b + 16 + 4j .. +3 (unsigned 0..15).
//             scale, min float16 [n_units, k / gs, 16] (the stored format's float16 values, read
//             as float32: the conversion is exact).
//   isa (bm::Isa, isa.h): this family's best tier at or below it runs: scalar, AVX2 (vpmaddubsw +
//       vpmaddwd; int8 via the sign trick on w = u8 ^ 0x80), AVX-VNNI (ymm vpdpbusd), AVX512-VNNI
//       (zmm vpdpbusd); a tier not compiled in falls back to the next lower one.
// The integer sums are exact (|sum| < 2^24, so their float conversion is exact too).

#pragma once

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "formats.h"
#include "isa.h"
#include "quants_blocks.h"
#include "vec.h"

namespace bm_aq {

// Outputs per unit of the packed layout and of act_linear_range's [n0, n1).
constexpr int64_t kActUnit = 16;

// One packed linear (act_quant.PackedActWeight's tensors; a plain struct for the fused step's context).
struct ActLinear {
  int32_t format;      // bm::kWeightInt8 or bm::kWeightInt4 (formats.h)
  int32_t pad;
  const void* packed;  // uint8: int8 [n_units, k/32, 8, 16, 4] (w + 128); int4 [n_units, k/32, 4, 16, 4]
  const void* scale;   // int8 float32 [n_units * 16]; int4 float16 bits (uint16_t) [n_units, k / gs, 16]
  const uint16_t* min; // int4 float16 bits [n_units, k / gs, 16]; int8 nullptr
  const float* bias;   // [n] or nullptr
  int64_t n, k, gs;    // outputs, inputs (k % 32 == 0), int4 group size (32, 64, 128; int8: 0)
};


constexpr int64_t kBlock = 32;

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

inline void store_out(float* y, float v, int accumulate) { *y = accumulate ? *y + v : v; }

// The lanes (16 outputs of one unit) of one row, after the blocks: bias, (+)= into y[o0, o1).
inline void finish_unit(const float* sums, const float* bias, float* y, int64_t o0, int64_t o1, int accumulate) {
  for (int64_t o = o0; o < o1; ++o) store_out(y + o, sums[o - o0] + (bias ? bias[o] : 0.f), accumulate);
}

// ---- scalar tier: the same layout, one lane at a time -------------------------------------------

inline void unit_scalar(const ActLinear& a, int64_t unit, const int8_t* q, const float* d, const int32_t* s,
                        int64_t rows, float* y, int64_t ldy, int accumulate) {
  const int64_t blocks = a.k / kBlock, o0 = unit * 16, o1 = std::min(a.n, o0 + 16);
  const uint8_t* w = (const uint8_t*)a.packed;
  for (int64_t r = 0; r < rows; ++r) {
    float acc[16] = {0};
    const int8_t* qr = q + r * a.k;
    for (int64_t b = 0; b < blocks; ++b) {
      const int8_t* qb = qr + b * kBlock;
      const float db = d[r * blocks + b];
      const int32_t sb = s[r * blocks + b];
      for (int i = 0; i < 16; ++i) {
        int32_t isum = 0;
        if (a.format == bm::kWeightInt8) {
          const uint8_t* wb = w + (unit * blocks + b) * 512;
          for (int j = 0; j < 8; ++j)
            for (int t = 0; t < 4; ++t) isum += ((int32_t)wb[j * 64 + i * 4 + t] - 128) * qb[4 * j + t];
          acc[i] = fmaf((float)isum, db, acc[i]);
        } else {
          const uint8_t* wb = w + (unit * blocks + b) * 256;
          for (int j = 0; j < 4; ++j)
            for (int t = 0; t < 4; ++t) {
              const uint8_t byte = wb[j * 64 + i * 4 + t];
              isum += (byte & 15) * qb[4 * j + t] + (byte >> 4) * qb[16 + 4 * j + t];
            }
          const int64_t g = (unit * (a.k / a.gs) + b * kBlock / a.gs) * 16 + i;
          const float t = fmaf(bm::half_to_float(a.min[g]), (float)sb,
                               (float)isum * bm::half_to_float(((const uint16_t*)a.scale)[g]));
          acc[i] = fmaf(t, db, acc[i]);
        }
      }
    }
    if (a.format == bm::kWeightInt8)
      for (int i = 0; i < 16; ++i) acc[i] *= ((const float*)a.scale)[o0 + i];
    finish_unit(acc, a.bias, y + r * ldy, o0, o1, accumulate);
  }
}

// ---- vector tiers: L lanes (outputs) per vector, 16 / L vectors per unit ------------------------
// I: int32 lanes; F: float lanes. acc4 / acc8 add one vector of a block's products per lane; done4
// turns the int4 accumulator into int32 sums. kBiased8: acc8 multiplies the biased u8 weights (the
// caller subtracts 128 * s).

#ifdef __AVX2__
struct Avx2Base {
  using I = __m256i;
  using F = __m256;
  static constexpr int L = 8;
  static I zero() { return _mm256_setzero_si256(); }
  static I load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
  static I bcast(const int8_t* p) { return _mm256_set1_epi32(load_i32(p)); }
  static I low4(I w) { return _mm256_and_si256(w, _mm256_set1_epi8(15)); }
  static I high4(I w) { return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(15)); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fload(const float* p) { return _mm256_loadu_ps(p); }
  static F hload(const uint16_t* p) {   // 8 float16 -> float32 (exact)
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
    float f[8];
    bm::halves_to_floats(p, 8, f);
    return _mm256_loadu_ps(f);
#endif
  }
  static F fset1(float v) { return _mm256_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static void fstore(float* p, F v) { _mm256_storeu_ps(p, v); }
};

struct Avx2 : Avx2Base {
  static constexpr bool kBiased8 = false;
  // rows per block: 4 rows x 2 parts of int32 sums and float accumulators take 16 of the 16 ymm
  // registers (blocks of 6 rows, one part at a time, ran 0.75-0.93x as fast at 6 and 8 rows on
  // an AMD EPYC Zen 3).
  static constexpr int kRows = 4;
  // s16 products: nibble (<= 15) x q (|q| <= 127), 2 per maddubs lane, 8 maddubs per block: <= 30480.
  static I acc4(I acc, I u, I q) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, q)); }
  static I done4(I acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
  static I acc8(I acc, I wb, I q) {  // sign trick: |w| * sign(q, w) == w * q, pairs <= 2 * 127 * 127
    const I w = _mm256_xor_si256(wb, _mm256_set1_epi8((char)0x80));
    const I p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(q, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
  }
};
#endif

#ifdef __AVXVNNI__
struct AvxVnni : Avx2Base {
  static constexpr bool kBiased8 = true;
  static constexpr int kRows = 4;   // as Avx2's (16 ymm registers)
  static I acc4(I acc, I u, I q) { return _mm256_dpbusd_avx_epi32(acc, u, q); }
  static I done4(I acc) { return acc; }
  static I acc8(I acc, I wb, I q) { return _mm256_dpbusd_avx_epi32(acc, wb, q); }
};
#endif

#ifdef __AVX512VNNI__
struct Avx512Vnni {
  using I = __m512i;
  using F = __m512;
  static constexpr int L = 16;
  static constexpr bool kBiased8 = true;
  static constexpr int kRows = 8;
  static I zero() { return _mm512_setzero_si512(); }
  static I load(const uint8_t* p) { return _mm512_loadu_si512((const void*)p); }
  static I bcast(const int8_t* p) { return _mm512_set1_epi32(load_i32(p)); }
  static I low4(I w) { return _mm512_and_si512(w, _mm512_set1_epi8(15)); }
  static I high4(I w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(15)); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I acc4(I acc, I u, I q) { return _mm512_dpbusd_epi32(acc, u, q); }
  static I done4(I acc) { return acc; }
  static I acc8(I acc, I wb, I q) { return _mm512_dpbusd_epi32(acc, wb, q); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fload(const float* p) { return _mm512_loadu_ps(p); }
  static F hload(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static F fset1(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static void fstore(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#endif

// Software prefetch of the weight stream, 4 blocks ahead: every line of a block under AVX2 (two
// vectors a line; a one-row int8 GEMV 8192 x 2048, one thread, AMD EPYC Zen 3, weights streamed:
// 11.5 GB/s with the block's first line prefetched alone, 19.3 with every line), the first line
// under AVX-512 (one vector a line; not measured per line).
template <class V>
constexpr bool prefetch_line(int j) { return j == 0 || V::L < 16; }

// R rows x one unit's 16 lanes, 16 / L vectors (parts) of L lanes each: every weight vector is
// loaded once and fed to the R rows' accumulators, and each 64-byte line read once as it streams in.
template <class V, int R>
void int8_unit(const ActLinear& a, int64_t unit, const int8_t* q, const float* d, const int32_t* s,
               float out[R][16]) {
  constexpr int P = 16 / V::L;
  const int64_t blocks = a.k / kBlock;
  const uint8_t* w = (const uint8_t*)a.packed + unit * blocks * 512;
  typename V::F acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = V::fzero();
  for (int64_t b = 0; b < blocks; ++b) {
    typename V::I isum[R][P];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) isum[r][p] = V::zero();
    const uint8_t* wb = w + b * 512;
    for (int j = 0; j < 8; ++j) {
      if (prefetch_line<V>(j)) _mm_prefetch((const char*)(wb + 2048 + j * 64), _MM_HINT_T0);
      for (int p = 0; p < P; ++p) {
        const typename V::I wv = V::load(wb + j * 64 + p * V::L * 4);
        for (int r = 0; r < R; ++r)
          isum[r][p] = V::acc8(isum[r][p], wv, V::bcast(q + r * a.k + b * kBlock + 4 * j));
      }
    }
    for (int r = 0; r < R; ++r) {
      const typename V::F db = V::fset1(d[r * blocks + b]);
      for (int p = 0; p < P; ++p) {
        if (V::kBiased8) isum[r][p] = V::sub(isum[r][p], V::set1(128 * s[r * blocks + b]));
        acc[r][p] = V::fma(V::cvt(isum[r][p]), db, acc[r][p]);
      }
    }
  }
  for (int p = 0; p < P; ++p) {
    const typename V::F scale = V::fload((const float*)a.scale + unit * 16 + p * V::L);
    for (int r = 0; r < R; ++r) V::fstore(out[r] + p * V::L, V::mul(acc[r][p], scale));
  }
}

template <class V, int R>
void int4_unit(const ActLinear& a, int64_t unit, const int8_t* q, const float* d, const int32_t* s,
               float out[R][16]) {
  constexpr int P = 16 / V::L;
  const int64_t blocks = a.k / kBlock, groups = a.k / a.gs;
  const uint8_t* w = (const uint8_t*)a.packed + unit * blocks * 256;
  const uint16_t* scale = (const uint16_t*)a.scale + unit * groups * 16;
  const uint16_t* min = a.min + unit * groups * 16;
  typename V::F acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = V::fzero();
  for (int64_t b = 0; b < blocks; ++b) {
    typename V::I isum[R][P];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) isum[r][p] = V::zero();
    const uint8_t* wb = w + b * 256;
    for (int j = 0; j < 4; ++j) {
      if (prefetch_line<V>(j)) _mm_prefetch((const char*)(wb + 1024 + j * 64), _MM_HINT_T0);
      for (int p = 0; p < P; ++p) {
        const typename V::I wv = V::load(wb + j * 64 + p * V::L * 4), lo = V::low4(wv), hi = V::high4(wv);
        for (int r = 0; r < R; ++r) {
          const int8_t* qb = q + r * a.k + b * kBlock + 4 * j;
          isum[r][p] = V::acc4(V::acc4(isum[r][p], lo, V::bcast(qb)), hi, V::bcast(qb + 16));
        }
      }
    }
    const int64_t g = b * kBlock / a.gs;
    for (int p = 0; p < P; ++p) {
      const typename V::F sc = V::hload(scale + g * 16 + p * V::L), mn = V::hload(min + g * 16 + p * V::L);
      for (int r = 0; r < R; ++r) {
        const typename V::F t =
            V::fma(mn, V::fset1((float)s[r * blocks + b]), V::mul(V::cvt(V::done4(isum[r][p])), sc));
        acc[r][p] = V::fma(t, V::fset1(d[r * blocks + b]), acc[r][p]);
      }
    }
  }
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) V::fstore(out[r] + p * V::L, acc[r][p]);
}

template <class V, int R>
void unit_rows(const ActLinear& a, int64_t unit, const int8_t* q, const float* d, const int32_t* s,
               float* y, int64_t ldy, int accumulate) {
  float out[R][16];
  if (a.format == bm::kWeightInt8) int8_unit<V, R>(a, unit, q, d, s, out);
  else int4_unit<V, R>(a, unit, q, d, s, out);
  const int64_t o0 = unit * 16, o1 = std::min(a.n, o0 + 16);
  for (int r = 0; r < R; ++r) finish_unit(out[r], a.bias, y + r * ldy, o0, o1, accumulate);
}

// Weight bytes of the units that one pass of row blocks covers (kept in L2 while every row block
// of the call meets them: at batch the weights are read from memory once, not once per row block).
constexpr int64_t kPanelBytes = 128 << 10;

// unit_rows<V, R> for the R = rows (1 <= rows <= V::kRows) known at run time: only the row counts a
// tier's blocks can have are instantiated.
template <class V, int R = V::kRows>
inline void unit_rows_of(int64_t rows, const ActLinear& a, int64_t u, const int8_t* q, const float* d,
                         const int32_t* s, float* y, int64_t ldy, int accumulate) {
  if constexpr (R > 1) {
    if (rows < R) return unit_rows_of<V, R - 1>(rows, a, u, q, d, s, y, ldy, accumulate);
  }
  unit_rows<V, R>(a, u, q, d, s, y, ldy, accumulate);
}

// Rows in blocks of up to V::kRows (the row loop inside a panel of units, so a block's activations
// stay in L1 over the panel's units and the panel's weights in L2 over the row blocks). A row's
// arithmetic does not depend on the blocking: every split of rows and units gives the same numbers.
template <class V>
void range_rows(const ActLinear& a, const int8_t* q, const float* d, const int32_t* s, int64_t rows,
                float* y, int64_t ldy, int accumulate, int64_t u0, int64_t u1) {
  const int64_t blocks = a.k / kBlock;
  const int64_t unit_bytes = kActUnit * a.k / (a.format == bm::kWeightInt8 ? 1 : 2);
  const int64_t panel_units = std::max<int64_t>(1, kPanelBytes / unit_bytes);
  for (int64_t p0 = u0; p0 < u1; p0 += panel_units) {
    const int64_t p1 = std::min(u1, p0 + panel_units);
    for (int64_t r0 = 0; r0 < rows; r0 += V::kRows) {
      const int64_t R = std::min<int64_t>(V::kRows, rows - r0);
      for (int64_t u = p0; u < p1; ++u)
        unit_rows_of<V>(R, a, u, q + r0 * a.k, d + r0 * blocks, s + r0 * blocks, y + r0 * ldy, ldy, accumulate);
    }
  }
}

// The q8x32 input type: the one from_float of the 32-element block formats (quants_blocks.h).
inline void quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* q, float* d, int32_t* s) {
  bm_blk::quantize_q8x32(x, rows, k, k, q, d, s);
}

inline void act_linear_range(const ActLinear& w, const int8_t* q, const float* d, const int32_t* s, int64_t rows,
                             int64_t k, float* y, int64_t ldy, int accumulate, int64_t n0, int64_t n1, int isa) {
  const ActLinear& a = w;
  const int64_t u0 = n0 / kActUnit, u1 = (n1 + kActUnit - 1) / kActUnit;
  (void)k;
#ifdef __AVX512VNNI__
  if (isa >= bm::kAvx512Vnni) { range_rows<Avx512Vnni>(a, q, d, s, rows, y, ldy, accumulate, u0, u1); return; }
#endif
#ifdef __AVXVNNI__
  if (isa >= bm::kAvxVnni) { range_rows<AvxVnni>(a, q, d, s, rows, y, ldy, accumulate, u0, u1); return; }
#endif
#ifdef __AVX2__
  if (isa >= bm::kAvx2) { range_rows<Avx2>(a, q, d, s, rows, y, ldy, accumulate, u0, u1); return; }
#endif
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t u = u0; u < u1; ++u)
      unit_scalar(a, u, q + r * a.k, d + r * (a.k / kBlock), s + r * (a.k / kBlock), 1, y + r * ldy, ldy,
                  accumulate);
}
}  // namespace bm_aq
