// Vector helpers of the native CPU layer (ggml-cpu's vec.h): horizontal sums, bf16 and float16
// conversions, the 8-wide polynomial exp and a float32 dot product. Header-only; every op family
// and entry point includes it, so the per-op calls and the fused step round alike.
#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "isa.h"

// One out-of-line copy of a function in the library (no inlining): every caller runs the same code.
#define BM_ONE_COPY inline __attribute__((noinline))

namespace bm {

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline int32_t hsum4_epi32(__m128i v) {
  v = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
  return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, 1)));
}
inline int32_t hsum8_epi32(__m256i v) {
  return hsum4_epi32(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

// Software prefetch of the one-row kernels' sequential weight streams (linear_float.h's float32 and
// bf16 rows, linear_weight_only.h's int8 row): a line `row_prefetch_bytes()` bytes on per line read,
// or none (0: the hardware prefetcher alone). By CPU vendor, as measured (one-row GEMV in a
// standalone loop, weights streamed from memory, builds with and without alternating, GB/s of
// weight read; gemv_bandwidth's A/B is in the README):
//   Intel Xeon (AVX-512, AMX; 2 threads, 8192 x 2048 and 1536 x 576), 2 KiB ahead: float32
//   16.4-18.3 -> 20.0-23.9, bf16 15.9-18.6 -> 20.6-24.6, int8 10.6-13.3 -> 13.3-19.5 (1 KiB gained
//   less; 4 KiB about the same). One thread: float32 7.6-9.2 -> 9.7-13.6, int8 6.9 -> 10.3.
//   AMD EPYC Zen 3 (AVX2): the float32 stream ran 0.75-1.0x as fast with 1-4 KiB; the int8 row
//   1.02-1.11x faster with 1 KiB (the `other_bytes` its AVX2 tier passes). Zen 4: not measured,
//   so AMD keeps what it ran before.
inline int64_t row_prefetch_bytes(int64_t other_bytes = 0) { return cpu_is_intel() ? 2048 : other_bytes; }

// dst[j * ld_dst + i] = src[i * ld_src + j] for an 8 x 8 block of floats (AVX2 shuffles: 8 loads,
// 24 shuffles, 8 stores); a pure move, so the values are bit for bit the scalar loop's.
inline void transpose8x8(const float* src, int64_t ld_src, float* dst, int64_t ld_dst) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld_src);
  for (int i = 0; i < 8; i += 2) {   // t[i]: rows i, i + 1 interleaved, columns 0, 1 | 4, 5; t[i + 1]: 2, 3 | 6, 7
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int h = 0; h < 8; h += 4) {   // r[h + c]: column c (c < 4) of rows h..h+3 | column c + 4
    r[h + 0] = _mm256_shuffle_ps(t[h], t[h + 2], 0x44);
    r[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], 0xEE);
    r[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0x44);
    r[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(dst + c * ld_dst, _mm256_permute2f128_ps(r[c], r[c + 4], 0x20));
    _mm256_storeu_ps(dst + (c + 4) * ld_dst, _mm256_permute2f128_ps(r[c], r[c + 4], 0x31));
  }
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint32_t r = ((u & 0x7fffffffu) > 0x7f800000u) ? (u | 0x00400000u) : (u + 0x7fffu + ((u >> 16) & 1u));
  return (uint16_t)(r >> 16);
}

inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_f32(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline float load1_f32(const float* p) { return *p; }
inline float load1_f32(const uint16_t* p) { return bf16_to_f32(*p); }
inline void store1(float* p, float v) { *p = v; }
inline void store1(uint16_t* p, float v) { *p = f32_to_bf16(v); }

// exp(x) for 8 floats (Cephes' expf polynomial; relative error ~1e-7, far below a bf16 rounding).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}

// 8 floats to bf16, rounded to nearest even (NaN stays NaN), as f32_to_bf16.
inline __m128i bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_srli_epi32(_mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), nan), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16x8(v)); }

// float16 bits -> float (F16C where compiled for it, else by hand; int4 scales and mins are float16)
inline float half_to_float(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) bits = sign | 0x7f800000 | (mantissa << 13);
  else if (exponent != 0) bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  else if (mantissa == 0) bits = sign;
  else {   // subnormal: normalize
    int e = -1;
    uint32_t m = mantissa;
    do { m <<= 1; ++e; } while (!(m & 0x400));
    bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
#endif
}

// n float16 values -> float (8 at a time with F16C: one conversion per scale in a GEMV's inner loop
// cost the int4 one-row step ~30 %).
inline void halves_to_floats(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
#endif
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < d; ++t) sum += a[t] * b[t];
  return sum;
}

}  // namespace bm
