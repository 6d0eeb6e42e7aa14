// Linear family, weight-only int8 / int4 weights with float32 activations: the few-row GEMV range
// drivers, the weights de-quantized a register tile at a time (ops.cpp's bm_wo_* and the fused
// step run these same ranges).
//   int8: y[r, o] (+)= scale[o] * sum_k x[r, k] * w[o, k] (+ bias[o]); w int8 [n, k]; scale float32 [n].
//   int4: w[o, k] = q[o, k] * scale[o, g] + min[o, g] with g = k / gs; packed uint8 [n, k / 2]: in
//       group g of row o, byte j (j < gs / 2) holds column g*gs + j in its low nibble and column
//       g*gs + gs/2 + j in its high nibble (GGUF Q4_0 / Q4_1's layout at gs 32); scale, min
//       float16 [n, k / gs] (their bits, uint16_t); gs in {32, 64, 128} divides k.
//   Tiers (the vector type V): Scalar, Avx2 (AVX2 + FMA), Avx512 (AVX-512F where compiled in; int4
//       there de-quantizes through a 16-entry table per group, int4_tile_lut).
#pragma once

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <type_traits>

#include "isa.h"
#include "vec.h"

namespace bm_wo {

using bm::half_to_float;
using bm::halves_to_floats;


struct Scalar {
  using F = float;
  static constexpr int W = 1;
  static constexpr bool kLut = false;
  static F zero() { return 0.f; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F v) { *p = v; }
  static F set1(float v) { return v; }
  static F fma(F a, F b, F c) { return a * b + c; }
  static F add(F a, F b) { return a + b; }
  static float hsum(F v) { return v; }
  static F i8(const int8_t* p) { return (float)*p; }
  static void u4(const uint8_t* p, F& lo, F& hi) { lo = (float)(*p & 15); hi = (float)(*p >> 4); }
};

struct Avx2 {
  using F = __m256;
  static constexpr int W = 8;
  static constexpr bool kLut = false;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static F i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
  }
  static void u4(const uint8_t* p, F& lo, F& hi) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
};

#ifdef __AVX512F__
struct Avx512 {
  using F = __m512;
  static constexpr int W = 16;
  static constexpr bool kLut = true;  // int4: 16-entry lookup of de-quantized values (int4_tile_lut)
  static F iota() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  // 32 weights of 16 bytes as their values in `lut` (vpermps reads an index's low 4 bits: no mask)
  static void u4_lut(const uint8_t* p, F lut, F& lo, F& hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    lo = _mm512_permutexvar_ps(b, lut);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut);
  }
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  static F i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  }
  static void u4(const uint8_t* p, F& lo, F& hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  }
};
#endif

struct Int8Args {
  const float* x; int64_t ldx; const int8_t* w; const float* scale; int64_t n, k;
  const float* bias; float* y; int64_t ldy; int accumulate;
};


struct Int4Args {
  const float* x; int64_t ldx; const uint8_t* w; const uint16_t* scale; const uint16_t* min; int64_t n, k, gs;
  const float* bias; float* y; int64_t ldy; int accumulate;
};

// Tiles ahead whose weight rows are prefetched: a tile streams O short rows, too short (and too
// many at once) for the hardware prefetcher to follow.
constexpr int kPrefetch = 2;

inline void store(float* dst, float s, int accumulate) { *dst = accumulate ? *dst + s : s; }

// R rows x O outputs from row r0, output o0: R * O accumulators over k.
template <class V, int R, int O>
void int8_tile(const Int8Args& a, int64_t r0, int64_t o0) {
  typename V::F acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = V::zero();
  const float* x = a.x + r0 * a.ldx;
  const int8_t* w = a.w + o0 * a.k;
  int64_t kk = 0;
  for (; kk + V::W <= a.k; kk += V::W) {
    typename V::F wv[O];
    for (int o = 0; o < O; ++o) wv[o] = V::i8(w + o * a.k + kk);
    if ((kk & 63) < V::W)  // the next tile's rows, a line per 64 bytes (see kPrefetch)
      for (int o = 0; o < O; ++o) _mm_prefetch((const char*)(w + (kPrefetch * O + o) * a.k + kk), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      const typename V::F xv = V::load(x + r * a.ldx + kk);
      for (int o = 0; o < O; ++o) acc[r][o] = V::fma(xv, wv[o], acc[r][o]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) {
      float s = V::hsum(acc[r][o]);
      for (int64_t t = kk; t < a.k; ++t) s += x[r * a.ldx + t] * (float)w[o * a.k + t];
      s *= a.scale[o0 + o];
      if (a.bias) s += a.bias[o0 + o];
      store(a.y + (r0 + r) * a.ldy + o0 + o, s, a.accumulate);
    }
}

// One row: each weight row read after the last, so a thread reads its range as one sequential
// stream (the hardware prefetcher's case, as linear_float.h's linear_row_sequential); 4
// accumulators of V::W lanes, x in L1. Run 8 lanes wide under AVX-512 too (Int8K::row), up to
// kSequentialMaxColumns. Measured on an AMD EPYC Zen 4, 1 thread, weights cold, GB/s of int8 weight
// read, x 64-byte aligned / 16 bytes off:
//                      8-output tile   this, 16 lanes   this, 8 lanes
//   1536 x 576          10.3 / 10.1     23.3 / 18.3      17.2 / 16.1
//   576 x 1536          12.9 / 12.4     24.2 / 17.8      23.1 / 20.0
//   8192 x 2048         14.4 / 14.5     10.6 / 20.7      19.0 / 20.5
//   4096 x 4096         17.8 / 17.7      9.6 / 19.2      17.9 / 19.1
//   2048 x 8192         17.7 / 17.4      9.1 / 10.0       8.6 /  8.7
// 16 lanes fall to half speed on an aligned x from 2048 columns (not understood); at 8192 columns
// x (32 KiB) leaves L1 and each row reads it again, where the tile reads it once per 8 outputs.
constexpr int64_t kSequentialMaxColumns = 4096;

// kPrefetch: a line `ahead` bytes on every 64 weight bytes (bm::row_prefetch_bytes: Intel 2 KiB;
// elsewhere the AVX2 tier's 1 KiB, measured on an AMD EPYC Zen 3, weights streamed, 2 threads, both
// builds alternating in one process: 1.02-1.11x faster on 8192 x 2048 and SmolLM2's 1536 x 576 /
// 49152 x 576; 512 and 2048 bytes gained less there. AMD's AVX-512 tier, not measured, runs none).
template <class V, bool kPrefetch>
void int8_row_sequential(const Int8Args& a, int64_t r0, int64_t n0, int64_t n1, int64_t ahead) {
  const float* x = a.x + r0 * a.ldx;
  constexpr int64_t kStep = 4 * V::W;
  for (int64_t o = n0; o < n1; ++o) {
    const int8_t* w = a.w + o * a.k;
    typename V::F a0 = V::zero(), a1 = a0, a2 = a0, a3 = a0;
    int64_t kk = 0;
    for (; kk + kStep <= a.k; kk += kStep) {
      if (kPrefetch && (kk & 63) < kStep) _mm_prefetch((const char*)(w + kk) + ahead, _MM_HINT_T0);
      a0 = V::fma(V::load(x + kk), V::i8(w + kk), a0);
      a1 = V::fma(V::load(x + kk + V::W), V::i8(w + kk + V::W), a1);
      a2 = V::fma(V::load(x + kk + 2 * V::W), V::i8(w + kk + 2 * V::W), a2);
      a3 = V::fma(V::load(x + kk + 3 * V::W), V::i8(w + kk + 3 * V::W), a3);
    }
    for (; kk + V::W <= a.k; kk += V::W) a0 = V::fma(V::load(x + kk), V::i8(w + kk), a0);
    float s = V::hsum(V::add(V::add(a0, a1), V::add(a2, a3)));
    for (; kk < a.k; ++kk) s += x[kk] * (float)w[kk];
    s *= a.scale[o];
    if (a.bias) s += a.bias[o];
    store(a.y + r0 * a.ldy + o, s, a.accumulate);
  }
}

// Per group: each output's weights de-quantized in registers (q * scale + min, an FMA per vector)
// and multiplied into its accumulators: the arithmetic of int4_tile_lut without a table. This
// replaced per-group partial sums (sum x * q, then times the scale, the mins added from the input's
// group sums at the end), whose per-group zeroing, scale broadcast and FMA cost more than the
// de-quantizing FMA at gs 32 (two vectors a group). Measured on an AMD EPYC Zen 3 (AVX2), one row:
// 8192 x 2048 on one thread 3.10 -> 2.28-2.39 ms; SmolLM2's fused step in int4 g32 1.16x faster
// at one row, 1.55x at 4 and 8 (both builds alternating in one process).
template <class V, int R, int O>
void int4_tile(const Int4Args& a, int64_t r0, int64_t o0) {
  typename V::F acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = V::zero();
  const int64_t groups = a.k / a.gs, half = a.gs / 2, row_bytes = a.k / 2;
  const float* x = a.x + r0 * a.ldx;
  constexpr int64_t kChunk = 8;   // groups whose float16 scales and mins are converted at once
  float scales[O][kChunk], mins[O][kChunk];
  for (int64_t g = 0; g < groups; ++g) {
    if (g % kChunk == 0)
      for (int o = 0; o < O; ++o) {
        const int64_t count = std::min(kChunk, groups - g);
        halves_to_floats(a.scale + (o0 + o) * groups + g, count, scales[o]);
        halves_to_floats(a.min + (o0 + o) * groups + g, count, mins[o]);
      }
    if (((g * half) & 63) < half)  // the next tiles' rows, a line per 64 bytes (see kPrefetch)
      for (int o = 0; o < O; ++o)
        _mm_prefetch((const char*)(a.w + (o0 + kPrefetch * O + o) * row_bytes + g * half), _MM_HINT_T0);
    typename V::F d[O], m[O];
    for (int o = 0; o < O; ++o) d[o] = V::set1(scales[o][g % kChunk]), m[o] = V::set1(mins[o][g % kChunk]);
    const float* xg = x + g * a.gs;
    for (int64_t j = 0; j < half; j += V::W)
      for (int o = 0; o < O; ++o) {   // O independent accumulator chains per row
        typename V::F lo, hi;
        V::u4(a.w + (o0 + o) * row_bytes + g * half + j, lo, hi);
        lo = V::fma(lo, d[o], m[o]);
        hi = V::fma(hi, d[o], m[o]);
        for (int r = 0; r < R; ++r)
          acc[r][o] = V::fma(V::load(xg + r * a.ldx + half + j), hi, V::fma(V::load(xg + r * a.ldx + j), lo, acc[r][o]));
      }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) {
      float s = V::hsum(acc[r][o]);
      if (a.bias) s += a.bias[o0 + o];
      store(a.y + (r0 + r) * a.ldy + o0 + o, s, a.accumulate);
    }
}

// AVX-512: per group, a lookup table of the 16 de-quantized values (q * scale + min) of each output;
// the weights come out of it ready for the FMA: no per-group partial sums, no mins term. Measured
// against int4_tile at one row, g32, 1 thread: 3072 x 576 0.109 -> 0.096 ms, 49152 x 576 1.64 -> 1.42.
template <class V, int R, int O>
void int4_tile_lut(const Int4Args& a, int64_t r0, int64_t o0) {
  typename V::F acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = V::zero();
  const int64_t groups = a.k / a.gs, half = a.gs / 2, row_bytes = a.k / 2;
  const float* x = a.x + r0 * a.ldx;
  const typename V::F iota = V::iota();
  constexpr int64_t kChunk = 8;   // groups whose float16 scales and mins are converted at once
  float scales[O][kChunk], mins[O][kChunk];
  for (int64_t g = 0; g < groups; ++g) {
    if (g % kChunk == 0)
      for (int o = 0; o < O; ++o) {
        const int64_t count = std::min(kChunk, groups - g);
        halves_to_floats(a.scale + (o0 + o) * groups + g, count, scales[o]);
        halves_to_floats(a.min + (o0 + o) * groups + g, count, mins[o]);
      }
    typename V::F lut[O];
    for (int o = 0; o < O; ++o) lut[o] = V::fma(iota, V::set1(scales[o][g % kChunk]), V::set1(mins[o][g % kChunk]));
    for (int64_t j = 0; j < half; j += V::W) {
      if (((g * half + j) & 63) < V::W)
        for (int o = 0; o < O; ++o)
          _mm_prefetch((const char*)(a.w + (o0 + kPrefetch * O + o) * row_bytes + g * half + j), _MM_HINT_T0);
      typename V::F lo[O], hi[O];
      for (int o = 0; o < O; ++o) V::u4_lut(a.w + (o0 + o) * row_bytes + g * half + j, lut[o], lo[o], hi[o]);
      for (int r = 0; r < R; ++r) {
        const typename V::F xl = V::load(x + r * a.ldx + g * a.gs + j);
        const typename V::F xh = V::load(x + r * a.ldx + g * a.gs + half + j);
        for (int o = 0; o < O; ++o) acc[r][o] = V::fma(xh, hi[o], V::fma(xl, lo[o], acc[r][o]));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) {
      float s = V::hsum(acc[r][o]);
      if (a.bias) s += a.bias[o0 + o];
      store(a.y + (r0 + r) * a.ldy + o0 + o, s, a.accumulate);
    }
}

#ifdef __AVX512VBMI__
// One row, AVX-512 with VBMI: each weight row read after the last (one sequential stream per thread),
// 64 bytes (128 weights) at a time transposed by one vpermb so that dword lane i holds byte i of each
// 16-byte quarter b: a shift by 8b (+ 4) puts quarter b's low (high) nibbles in the lanes' low 4
// bits, the columns of 16 consecutive inputs, looked up in the quarter's group's 16-entry table of
// de-quantized values (vpermps reads an index's low 4 bits: no mask). Per 128 weights one vpermb
// and 7 shifts replace int4_tile_lut's 4 vpmovzxbd (cross-lane, like vpermb) and 4 shifts. A row's
// bytes past its last whole 64 take the vpmovzxbd way, a quarter at a time. Measured on an AMD
// EPYC Zen 4, 1 thread, gs 32, weights cold, GB/s of int4 weight, x 64-byte aligned / 16 bytes
// off, 8-output tile -> this: 1536 x 576 6.3 / 6.7 -> 8.0 / 7.9, 576 x 1536 6.5 / 6.6 -> 8.4 / 8.3,
// 8192 x 2048 6.6 / 6.8 -> 8.0 / 9.2, 2048 x 8192 6.5 / 6.3 -> 7.3 / 7.6. With the weights in cache
// (256 x 512) both ran at 8.5-8.6 GB/s: cold, this one runs near its in-cache (compute) rate.
// On Intel a line 2 KiB ahead is prefetched per 64 bytes (bm::row_prefetch_bytes): Intel Xeon
// (AVX-512, AMX), weights streamed, gemv_bandwidth alternating with and without, 8192 x 2048 at
// 1 thread 6.0-6.8 -> 9.9-10.5 GB/s, 2 threads 9.4-12.5 -> 11.9-17.3; 49152 x 576 1 thread
// 3.8-4.4 -> 5.9-8.8, 2 threads 7.3-10.9 -> 9.2-11.2.
inline void int4_row_vbmi(const Int4Args& a, int64_t r0, int64_t n0, int64_t n1) {
  const float* x = a.x + r0 * a.ldx;
  const int64_t groups = a.k / a.gs, half = a.gs / 2, row_bytes = a.k / 2;
  const int half_shift = __builtin_ctzll(half);   // gs is a power of two: no division per quarter
  const int64_t ahead = bm::row_prefetch_bytes();
  const __m512 iota = Avx512::iota();
  alignas(64) static constexpr uint8_t kTranspose[64] = {
      0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53,
      6, 22, 38, 54, 7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
      12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
  const __m512i transpose = _mm512_load_si512(kTranspose);
  constexpr int64_t kWindow = 64;  // groups whose float16 scales and mins are converted at once
  float scales[kWindow], mins[kWindow];
  for (int64_t o = n0; o < n1; ++o) {
    const uint8_t* w = a.w + o * row_bytes;
    const uint16_t* scale = a.scale + o * groups;
    const uint16_t* min = a.min + o * groups;
    int64_t window = -kWindow;   // first group of the converted window
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    // the groups of row bytes [first, last] converted (at most 4: kWindow is well above)
    auto convert = [&](int64_t first, int64_t last) {
      if ((last >> half_shift) < window + kWindow) return;
      window = first >> half_shift;
      halves_to_floats(scale + window, std::min(kWindow, groups - window), scales);
      halves_to_floats(min + window, std::min(kWindow, groups - window), mins);
    };
    // the table of the group holding row byte `byte` (a quarter never straddles two: 16 | half)
    auto table = [&](int64_t byte) {
      const int64_t g = (byte >> half_shift) - window;
      return _mm512_fmadd_ps(iota, _mm512_set1_ps(scales[g]), _mm512_set1_ps(mins[g]));
    };
    // x of row byte `byte`'s low nibbles (the high nibbles' are half columns on)
    auto inputs = [&](int64_t byte) { return x + (byte >> half_shift) * a.gs + (byte & (half - 1)); };
    int64_t c = 0;
    for (; c + 64 <= row_bytes; c += 64) {
      if (ahead) _mm_prefetch((const char*)(w + c) + ahead, _MM_HINT_T0);
      const __m512i t = _mm512_permutexvar_epi8(transpose, _mm512_loadu_si512(w + c));
      convert(c, c + 63);
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) {
        const __m512 lut = table(c + 16 * b);
        const float* xb = inputs(c + 16 * b);
        const __m512i lo = b ? _mm512_srli_epi32(t, 8 * b) : t;
        acc[b] = _mm512_fmadd_ps(_mm512_loadu_ps(xb), _mm512_permutexvar_ps(lo, lut), acc[b]);
        acc[b] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + half), _mm512_permutexvar_ps(_mm512_srli_epi32(t, 8 * b + 4), lut),
                                 acc[b]);
      }
    }
    for (; c < row_bytes; c += 16) {   // into acc[0]: an index known at compile time keeps acc in registers
      __m512 lo, hi;
      convert(c, c + 15);
      Avx512::u4_lut(w + c, table(c), lo, hi);
      const float* xb = inputs(c);
      acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + half), hi, _mm512_fmadd_ps(_mm512_loadu_ps(xb), lo, acc[0]));
    }
    float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    if (a.bias) s += a.bias[o];
    store(a.y + r0 * a.ldy + o, s, a.accumulate);
  }
}
#endif

// One row's tiles where no row kernel runs (int4 without VBMI; int8 past kSequentialMaxColumns):
// 8 outputs (independent FMA chains) with AVX-512's 32 registers, 4 with AVX2's 16 (measured
// before the row kernels, AVX-512, 1 thread, 3072 x 576, int4: 0.158 -> 0.109 ms).
template <class V>
constexpr int kRowTileOutputs = V::W == 16 ? 8 : 4;

// Tiles for R rows: O outputs at a time (fewer rows: more outputs, for independent FMA chains).
template <class V, int R, int O, class Args, void (*Tile1)(const Args&, int64_t, int64_t),
          void (*TileO)(const Args&, int64_t, int64_t)>
void cover_outputs(const Args& a, int64_t r0, int64_t n0, int64_t n1) {
  int64_t o = n0;
  for (; o + O <= n1; o += O) TileO(a, r0, o);
  for (; o < n1; ++o) Tile1(a, r0, o);
}

template <class V, class Args, template <class, int, int> class K>
void run_range(const Args& a, int64_t rows, int64_t n0, int64_t n1) {
  for (int64_t r = 0; r < rows;) {
    const int64_t left = rows - r;
    if (left >= 4) {
      cover_outputs<V, 4, 2, Args, K<V, 4, 1>::run, K<V, 4, 2>::run>(a, r, n0, n1); r += 4;
    } else if (left == 3) {
      cover_outputs<V, 3, 2, Args, K<V, 3, 1>::run, K<V, 3, 2>::run>(a, r, n0, n1); r += 3;
    } else if (left == 2) {
      cover_outputs<V, 2, 4, Args, K<V, 2, 1>::run, K<V, 2, 4>::run>(a, r, n0, n1); r += 2;
    } else {
      K<V, 1, 1>::row(a, r, n0, n1); r += 1;
    }
  }
}

template <class V, int R, int O>
struct Int8K {
  static void run(const Int8Args& a, int64_t r0, int64_t o0) { int8_tile<V, R, O>(a, r0, o0); }
  static void row(const Int8Args& a, int64_t r0, int64_t n0, int64_t n1) {
    if (a.k <= kSequentialMaxColumns) {
      using Row = std::conditional_t<V::W == 16, Avx2, V>;   // 8 lanes under AVX-512 too (above)
      if (const int64_t ahead = bm::row_prefetch_bytes(V::W == 8 ? 1024 : 0))
        int8_row_sequential<Row, true>(a, r0, n0, n1, ahead);
      else
        int8_row_sequential<Row, false>(a, r0, n0, n1, 0);
    } else {
      constexpr int kO = kRowTileOutputs<V>;
      cover_outputs<V, 1, kO, Int8Args, Int8K<V, 1, 1>::run, Int8K<V, 1, kO>::run>(a, r0, n0, n1);
    }
  }
};
template <class V, int R, int O>
struct Int4K {
  static void run(const Int4Args& a, int64_t r0, int64_t o0) {
    if constexpr (V::kLut) int4_tile_lut<V, R, O>(a, r0, o0);
    else int4_tile<V, R, O>(a, r0, o0);
  }
  // one row: int4_row_vbmi where AVX-512 has VBMI, else the row tiles
  static void row(const Int4Args& a, int64_t r0, int64_t n0, int64_t n1) {
#ifdef __AVX512VBMI__
    if constexpr (V::W == 16) { int4_row_vbmi(a, r0, n0, n1); return; }
#endif
    constexpr int kO = kRowTileOutputs<V>;
    cover_outputs<V, 1, kO, Int4Args, Int4K<V, 1, 1>::run, Int4K<V, 1, kO>::run>(a, r0, n0, n1);
  }
};

constexpr int64_t kOutputsPerUnit = 32;  // the unit of thread work (a multiple of every O)

// Outputs [n0, n1) of every row in this family's best tier at or below `isa` (bm::Isa) compiled in.
template <class Args, template <class, int, int> class K>
void tier_range(const Args& a, int64_t rows, int64_t n0, int64_t n1, int isa) {
#ifdef __AVX512F__
  if (isa >= bm::kAvx512) { run_range<Avx512, Args, K>(a, rows, n0, n1); return; }
#endif
  if (isa >= bm::kAvx2) run_range<Avx2, Args, K>(a, rows, n0, n1);
  else run_range<Scalar, Args, K>(a, rows, n0, n1);
}

template <class Args, template <class, int, int> class K>
void parallel_linear(const Args& a, int64_t rows, int isa, int num_threads) {
  const int64_t units = (a.n + kOutputsPerUnit - 1) / kOutputsPerUnit;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t u = 0; u < units; ++u)
    tier_range<Args, K>(a, rows, u * kOutputsPerUnit, std::min(a.n, (u + 1) * kOutputsPerUnit), isa);
}

}  // namespace bm_wo
