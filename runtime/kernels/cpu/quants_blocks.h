// llama.cpp's quantized block formats (ggml-common.h's block_q8_0 ... block_q6_K, byte for byte):
// their layouts, their row de-quantization to float32 and the quantization of an input row into the
// blocks their dot kernels take (linear_blocks.h). format_table.h makes them rows of the format table.
//
// Layouts (d, dmin, m: float16 bits; one row of a weight = k / block_elems blocks back to back):
//   q8_0  34 B / 32: d, int8 qs[32]                       value = d * q
//   q4_0  18 B / 32: d, qs[16] (j: low nibble of qs[j], 16 + j: high nibble)   value = d * (nib - 8)
//   q4_1  20 B / 32: d, m, qs[16]                         value = d * nib + m
//   q5_0  22 B / 32: d, qh[4] (bit j: element j's 5th bit), qs[16]            value = d * (q5 - 16)
//   q4_k 144 B / 256: d, dmin, scales[12] (8 6-bit scales, 8 6-bit mins), qs[128] (4 chunks of 32
//                     bytes: sub-block 2c in the low nibbles, 2c + 1 in the high)
//                     value = (d * sc_j) * nib - dmin * m_j   (8 sub-blocks of 32)
//   q5_k 176 B / 256: d, dmin, scales[12], qh[32] (bit j of byte l: sub-block j, element l), qs[128]
//   q6_k 210 B / 256: ql[128], qh[64], int8 scales[16], d    value = (d * sc_i) * (q6 - 32)
//
// De-quantization is bit-exact with gguf.quants.dequantize (numpy float32): the same products and
// sums in the same order, each rounded once. Every product that meets an add (q4_1's d * nib, the K
// formats' (d * sc) * q and dmin * m) is exact (an fp16 mantissa times <= 11 integer bits fits in 24),
// so a fused multiply-add could not change it; fp-contract is off anyway (BM_EXACT) so a new format
// with inexact products keeps numpy's two roundings.
//
// Input types (formats.h's InputType), per row of an input x float32 [rows, k]:
//   q8x32: the int8-activation mode's type (linear_act_quant.h's quantize_rows, same arithmetic):
//          per block b of 32: d = max|x| / 127, q = round-half-even(x / d) (0 where d == 0),
//          s = sum of the block's q. q int8 [rows, k], d float32 [rows, k/32], s int32 [rows, k/32].
//   q8k:   llama.cpp's block_q8_K role, blocks of 256: d = max|x| / 127 per 256, q as above,
//          bsums = sums of q per 16. q int8 [rows, k], d float32 [rows, k/256], bsums int16 [rows, k/16].
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "formats.h"
#include "vec.h"

namespace bm_blk {

constexpr int kQ = 32;     // elements of a 32-element block
constexpr int kQK = 256;   // elements of a K-format super-block

struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };
struct BlockQ4_0 { uint16_t d; uint8_t qs[16]; };
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[16]; };
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };
struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct BlockQ5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
struct BlockQ6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20, "ggml layout");
static_assert(sizeof(BlockQ5_0) == 22 && sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176, "ggml layout");
static_assert(sizeof(BlockQ6_K) == 210, "ggml layout");

inline float f16(uint16_t h) { return bm::half_to_float(h); }

// q4_k / q5_k: the 8 6-bit scales (bytes 0-7 of u) and mins (bytes 8-15) of scales[12] (ggml's
// get_scale_min_k4, 32 bits at a time as its AVX2 kernel does).
inline void scales_mins_k4(const uint8_t* s, uint32_t u[4]) {
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  memcpy(u, s, 12);
  u[3] = ((u[2] >> 4) & kLow4) | (((u[1] >> 6) & kLow2) << 4);
  const uint32_t mins_low = u[1] & kLow6;
  u[1] = (u[2] & kLow4) | (((u[0] >> 6) & kLow2) << 4);
  u[2] = mins_low;
  u[0] &= kLow6;
}

inline void scales_mins_k4(const uint8_t* s, uint8_t out[16]) {
  uint32_t u[4];
  scales_mins_k4(s, u);
  memcpy(out, u, 16);
}

// ---- row de-quantization: one weight row of k elements -> out float32 [k] ----

#define BM_EXACT __attribute__((optimize("fp-contract=off")))

BM_EXACT inline void dequant_q8_0(const uint8_t* row, int64_t k, float* out) {
  const BlockQ8_0* b = (const BlockQ8_0*)row;
  for (int64_t i = 0; i < k / kQ; ++i) {
    const float d = f16(b[i].d);
    for (int j = 0; j < kQ; ++j) out[i * kQ + j] = (float)b[i].qs[j] * d;
  }
}

BM_EXACT inline void dequant_q4_0(const uint8_t* row, int64_t k, float* out) {
  const BlockQ4_0* b = (const BlockQ4_0*)row;
  for (int64_t i = 0; i < k / kQ; ++i) {
    const float d = f16(b[i].d);
    float* o = out + i * kQ;
    for (int j = 0; j < 16; ++j) {
      o[j] = d * (float)((b[i].qs[j] & 15) - 8);
      o[j + 16] = d * (float)((b[i].qs[j] >> 4) - 8);
    }
  }
}

BM_EXACT inline void dequant_q4_1(const uint8_t* row, int64_t k, float* out) {
  const BlockQ4_1* b = (const BlockQ4_1*)row;
  for (int64_t i = 0; i < k / kQ; ++i) {
    const float d = f16(b[i].d), m = f16(b[i].m);
    float* o = out + i * kQ;
    for (int j = 0; j < 16; ++j) {
      o[j] = d * (float)(b[i].qs[j] & 15) + m;
      o[j + 16] = d * (float)(b[i].qs[j] >> 4) + m;
    }
  }
}

BM_EXACT inline void dequant_q5_0(const uint8_t* row, int64_t k, float* out) {
  const BlockQ5_0* b = (const BlockQ5_0*)row;
  for (int64_t i = 0; i < k / kQ; ++i) {
    const float d = f16(b[i].d);
    uint32_t qh;
    memcpy(&qh, b[i].qh, 4);
    float* o = out + i * kQ;
    for (int j = 0; j < 16; ++j) {
      o[j] = d * (float)((int)((b[i].qs[j] & 15) | (((qh >> j) & 1) << 4)) - 16);
      o[j + 16] = d * (float)((int)((b[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
  }
}

// q4_k and q5_k: (d * sc) * q - (dmin * m), qh null for q4_k.
BM_EXACT inline void dequant_k4(uint16_t dh, uint16_t dminh, const uint8_t* scales, const uint8_t* qh,
                                const uint8_t* qs, float* o) {
  uint8_t sm[16];
  scales_mins_k4(scales, sm);
  const uint8_t *sc = sm, *mn = sm + 8;
  const float d = f16(dh), dmin = f16(dminh);
  for (int j = 0; j < 8; ++j) {
    const float ds = d * (float)sc[j], dm = dmin * (float)mn[j];
    const uint8_t* q = qs + (j / 2) * 32;
    const int shift = (j & 1) * 4;
    for (int l = 0; l < 32; ++l) {
      const int hi = qh ? ((qh[l] >> j) & 1) << 4 : 0;
      o[j * 32 + l] = ds * (float)(((q[l] >> shift) & 15) | hi) - dm;
    }
  }
}

inline void dequant_q4_k(const uint8_t* row, int64_t k, float* out) {
  const BlockQ4_K* b = (const BlockQ4_K*)row;
  for (int64_t i = 0; i < k / kQK; ++i) dequant_k4(b[i].d, b[i].dmin, b[i].scales, nullptr, b[i].qs, out + i * kQK);
}

inline void dequant_q5_k(const uint8_t* row, int64_t k, float* out) {
  const BlockQ5_K* b = (const BlockQ5_K*)row;
  for (int64_t i = 0; i < k / kQK; ++i) dequant_k4(b[i].d, b[i].dmin, b[i].scales, b[i].qh, b[i].qs, out + i * kQK);
}

// q6_k: 2 halves of 128; in half h, chunk c of 32: low 4 bits from ql (c & 1: second 32 bytes,
// c >= 2: high nibbles), high 2 bits (qh >> 2c) & 3.
BM_EXACT inline void dequant_q6_k(const uint8_t* row, int64_t k, float* out) {
  const BlockQ6_K* b = (const BlockQ6_K*)row;
  for (int64_t i = 0; i < k / kQK; ++i) {
    const float d = f16(b[i].d);
    float* o = out + i * kQK;
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < 4; ++c) {
        const uint8_t* ql = b[i].ql + h * 64 + (c & 1) * 32;
        const uint8_t* qh = b[i].qh + h * 32;
        for (int l = 0; l < 32; ++l) {
          const int e = h * 128 + c * 32 + l;
          const int q = ((ql[l] >> ((c >> 1) * 4)) & 15) | (((qh[l] >> (2 * c)) & 3) << 4);
          o[e] = (d * (float)b[i].scales[e / 16]) * (float)(q - 32);
        }
      }
  }
}

// float32 and bf16 weights as rows of the same table (row bytes = k * 4 or k * 2).
inline void dequant_float32(const uint8_t* row, int64_t k, float* out) { memcpy(out, row, k * 4); }
inline void dequant_bf16(const uint8_t* row, int64_t k, float* out) {
  const uint16_t* w = (const uint16_t*)row;
  for (int64_t j = 0; j < k; ++j) out[j] = bm::bf16_to_f32(w[j]);
}

// ---- input rows: float32 -> the blocks a dot kernel takes ----

// One block of n values: d = max|x| / 127, q = round-half-even(x / d); returns the sum of q.
// Vectorized by hand for n a multiple of 32 (AVX-512 / AVX2): the same IEEE division, rounding and
// clamp per value, so the same q as the loop below. A standalone loop over 8 rows of 1536 (AMD EPYC
// Zen 4, one thread), ns a value: q8x32 1.17-1.23 -> 0.29-0.36 (the AVX2 body 0.32), q8k 1.05 ->
// 0.21 (with its sums of 16 by psadbw below). The fused step at 8 rows quantizes ~0.5 M values per
// thread (each thread its own copy of the RMSNorm outputs): SmolLM2 int8 + a8 and kept Q4_0 steps
// 1.07-1.12x faster at 8 rows, 1 row unchanged within the noise (one process, both orders).
inline int32_t quantize_block(const float* x, int n, int8_t* q, float* d) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (n % 32 == 0) {
    __m512 m = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + j)));
    const float db = _mm512_reduce_max_ps(m) / 127.f;
    *d = db;
    if (db == 0.f) {
      memset(q, 0, n);
      return 0;
    }
    const __m512 vd = _mm512_set1_ps(db), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
    __m512i sum = _mm512_setzero_si512();
    for (int j = 0; j < n; j += 16) {
      const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + j), vd),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i v = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, r)));
      _mm_storeu_si128((__m128i*)(q + j), _mm512_cvtepi32_epi8(v));
      sum = _mm512_add_epi32(sum, v);
    }
    return _mm512_reduce_add_epi32(sum);
  }
#elif defined(__AVX2__)
  if (n % 32 == 0) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < n; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float db = _mm_cvtss_f32(m4) / 127.f;
    *d = db;
    if (db == 0.f) {
      memset(q, 0, n);
      return 0;
    }
    const __m256 vd = _mm256_set1_ps(db), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    __m256i sum = _mm256_setzero_si256();
    for (int j = 0; j < n; j += 32) {
      __m256i v[4];
      for (int i = 0; i < 4; ++i) {
        const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + j + 8 * i), vd),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
        sum = _mm256_add_epi32(sum, v[i]);
      }
      // int32 -> int8 by two packs (lane-interleaved), then the dwords back in order
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
      _mm256_storeu_si256((__m256i*)(q + j),
                          _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
    return bm::hsum8_epi32(sum);
  }
#endif
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int j = 0; j < n; ++j) amax = std::max(amax, fabsf(x[j]));
  const float db = amax / 127.f;
  *d = db;
  if (db == 0.f) {
    memset(q, 0, n);
    return 0;
  }
  int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int j = 0; j < n; ++j) {
    const float v = std::min(127.f, std::max(-127.f, rintf(x[j] / db)));
    q[j] = (int8_t)v;
    sum += (int32_t)v;
  }
  return sum;
}

// Blocks [b0, b1) of x float32 [rows, k] (row stride ldx) in row-major block order (block i is row
// i / (k / kQ), column block i % (k / kQ)) -> q8x32 (q, d, s contiguous per row).
inline void quantize_q8x32_blocks(const float* x, int64_t ldx, int64_t k, int8_t* q, float* d, int32_t* s,
                                  int64_t b0, int64_t b1) {
  const int64_t nb = k / kQ;
  for (int64_t i = b0; i < b1; ++i) {
    const int64_t r = i / nb, b = i % nb;
    s[i] = quantize_block(x + r * ldx + b * kQ, kQ, q + r * k + b * kQ, d + i);
  }
}

// x float32 [rows, k] (row stride ldx) -> q8x32 (q, d, s contiguous per row).
inline void quantize_q8x32(const float* x, int64_t rows, int64_t ldx, int64_t k, int8_t* q, float* d, int32_t* s) {
  quantize_q8x32_blocks(x, ldx, k, q, d, s, 0, rows * (k / kQ));
}

// Super-blocks [b0, b1) of x float32 [rows, k] (row stride ldx), row-major as above -> q8k (q, d,
// bsums contiguous per row).
inline void quantize_q8k_blocks(const float* x, int64_t ldx, int64_t k, int8_t* q, float* d, int16_t* bsums,
                                int64_t b0, int64_t b1) {
  const int64_t nb = k / kQK;
  for (int64_t i = b0; i < b1; ++i) {
    const int64_t r = i / nb, b = i % nb;
    int8_t* qb = q + r * k + b * kQK;
    quantize_block(x + r * ldx + b * kQK, kQK, qb, d + i);
    for (int g = 0; g < 16; ++g) {   // sum of 16 int8: psadbw of q + 128 against zero, less 16 * 128
      const __m128i u = _mm_xor_si128(_mm_loadu_si128((const __m128i*)(qb + g * 16)), _mm_set1_epi8((char)0x80));
      const __m128i halves = _mm_sad_epu8(u, _mm_setzero_si128());
      bsums[i * 16 + g] = (int16_t)(_mm_cvtsi128_si32(halves) + _mm_extract_epi16(halves, 4) - 16 * 128);
    }
  }
}

// x float32 [rows, k] (row stride ldx) -> q8k (q, d, bsums contiguous per row).
inline void quantize_q8k(const float* x, int64_t rows, int64_t ldx, int64_t k, int8_t* q, float* d,
                         int16_t* bsums) {
  quantize_q8k_blocks(x, ldx, k, q, d, bsums, 0, rows * (k / kQK));
}

// Share `part` of `parts` (even ranges of its blocks) of quantizing x float32 [rows, k] (row stride
// ldx) into the block input type `input`: q8x32 (sums int32 [rows, k / 32]) or q8k (sums int16
// [rows, k / 16]). The one dispatch on the input type; false for any other type.
inline bool quantize_share(int input, const float* x, int64_t rows, int64_t ldx, int64_t k, int8_t* q, float* d,
                           void* sums, int64_t part, int64_t parts) {
  if (input != bm::kInputQ8x32 && input != bm::kInputQ8K) return false;
  const bool q8k = input == bm::kInputQ8K;
  const int64_t blocks = rows * (k / (q8k ? kQK : kQ)), b0 = blocks * part / parts, b1 = blocks * (part + 1) / parts;
  if (q8k) quantize_q8k_blocks(x, ldx, k, q, d, (int16_t*)sums, b0, b1);
  else quantize_q8x32_blocks(x, ldx, k, q, d, (int32_t*)sums, b0, b1);
  return true;
}

// Whether a linear's threads quantize its input, each a share before a barrier (true), or the
// caller before the parallel region (false). SmolLM2's four linears per layer, sharing against the
// caller, 2 threads of an AMD EPYC Zen 3 (AVX2): 1.01-1.04x at 4 rows, 1.04-1.10x at 64 and 512
// rows, but 0.965-0.977x at one row (the barrier costs more than it saves), so inputs below
// kShareMinInputs values stay with the caller.
constexpr int64_t kShareMinInputs = 2048;
inline bool quantize_by_threads(int64_t rows, int64_t k) { return rows * k >= kShareMinInputs; }

}  // namespace bm_blk
