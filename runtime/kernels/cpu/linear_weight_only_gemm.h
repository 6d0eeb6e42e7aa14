// Linear family, weight-only int8 / int4 at batch (context steps, large generation batches): a
// fused de-quantize-and-multiply with float32 activations, the same contract as
// linear_weight_only.h's int8 / int4 (Int8Args, Int4Args). ops.cpp's bm_wo_* run it
// from kGemmMinRows rows; the GEMV ranges stay below (and in the fused step).
//
// Layout and loops (per call):
//   1. The input rows are packed once, column-major per panel of P = 2 * V::W rows:
//      xt[p][k][P] = x[p * P + i, k] (zero rows past the last), the threads sharing the panels.
//   2. Each thread takes chunks of kChunkOutputs outputs (static) and, per kRowBlock rows and per
//      block of at most kBlockK columns, de-quantizes the chunk's weights into its own float32 buffer
//      wb[o][kk] (kChunkOutputs * kBlockK * 4 = 96 KiB: L2-resident), then for every panel runs
//      register tiles of kTileOutputs outputs x P rows over the block: per column 2 vector loads
//      of the panel (L1-resident across the chunk's tiles), kTileOutputs broadcast weights,
//      2 * kTileOutputs FMAs (AVX2: 12 of the 16 ymm registers accumulate).
//   3. A tile's sums go to y[r, o] transposed; the first column block writes (or adds, with
//      accumulate), the later ones add, the last adds the bias.
// Each output's sum runs over the columns in order within a block (per lane: one row), so a row's
// result does not depend on the other rows of the call.
// Tiers: the V of linear_weight_only.h (Scalar, Avx2, Avx512); de-quantization is plain C++
// vectorized by the compiler.
#pragma once

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include <algorithm>
#include <type_traits>

#include "linear_weight_only.h"

namespace bm_wo {

constexpr int64_t kGemmMinRows = 16;    // rows from which bm_wo_* take this path (see weight_only_linear.py)
constexpr int kTileOutputs = 6;
constexpr int64_t kChunkOutputs = 96;   // a multiple of kTileOutputs
constexpr int64_t kBlockK = 256;        // a multiple of every int4 group size (32, 64, 128)
// Rows per pass over a chunk's column blocks (a multiple of every tier's panel): their outputs
// (kRowBlock * kChunkOutputs * 4 = 192 KiB), the chunk's de-quantized block (96 KiB) and a panel
// (32 KiB at AVX-512) stay in L2 from one column block to the next (512 KiB and more on the x86
// servers we run on); the chunk is de-quantized once per pass (0.13-0.2 ns per weight, AVX2). 512
// rows, against 128 before: int4 g32 at 512 rows 1.12-1.24x (SmolLM2's and the ~1B LLaMA's
// shapes, samples.microbench.batch_linear, AMD EPYC Zen 4, 2 threads), int8 0.99-1.09x.
constexpr int64_t kRowBlock = 512;

// wb[o - o0][c - c0] = w[o, c] for o in [o0, o1), c in [c0, c1).
inline void dequant_block(const Int8Args& a, int64_t o0, int64_t o1, int64_t c0, int64_t c1, float* wb) {
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* src = a.w + o * a.k + c0;
    float* dst = wb + (o - o0) * kBlockK;
    const float s = a.scale[o];
#pragma omp simd
    for (int64_t c = 0; c < c1 - c0; ++c) dst[c] = (float)src[c] * s;
  }
}

// int4: c0 and c1 on group boundaries (c1 == k or a multiple of kBlockK).
inline void dequant_block(const Int4Args& a, int64_t o0, int64_t o1, int64_t c0, int64_t c1, float* wb) {
  const int64_t groups = a.k / a.gs, half = a.gs / 2;
  for (int64_t o = o0; o < o1; ++o) {
    float* dst = wb + (o - o0) * kBlockK;
    for (int64_t g = c0 / a.gs; g < c1 / a.gs; ++g) {
      const float d = half_to_float(a.scale[o * groups + g]), m = half_to_float(a.min[o * groups + g]);
      const uint8_t* b = a.w + o * (a.k / 2) + g * half;
      float* lo = dst + g * a.gs - c0;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        lo[j] = (float)(b[j] & 15) * d + m;
        lo[half + j] = (float)(b[j] >> 4) * d + m;
      }
    }
  }
}

#ifdef __AVX2__
// a_o holds output o of 8 rows: y[r, 0..5] (+)= (a_0[r], ..., a_5[r]) (+ bias) for r < rows.
inline void store_6x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, float* y, int64_t ldy,
                      int64_t rows, const float* bias, bool write) {
  const __m256 t0 = _mm256_unpacklo_ps(a0, a1), t1 = _mm256_unpackhi_ps(a0, a1);   // rows 0 1 | 4 5, 2 3 | 6 7
  const __m256 t2 = _mm256_unpacklo_ps(a2, a3), t3 = _mm256_unpackhi_ps(a2, a3);
  const __m256 pairs[2] = {_mm256_unpacklo_ps(a4, a5), _mm256_unpackhi_ps(a4, a5)};  // outputs 4 5 per row
  const __m256 quads[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),   // rows 0 | 4, 1 | 5
                           _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE)};  // 2 | 6, 3 | 7
  const __m128 zero = _mm_setzero_ps();
  const __m128 b4 = bias ? _mm_loadu_ps(bias) : zero;
  const __m128 b2 = bias ? _mm_loadl_pi(zero, (const __m64*)(bias + 4)) : zero;
  for (int64_t r = 0; r < rows; ++r) {
    const int half = r >= 4;
    const int i = r & 3;
    const __m128 q = half ? _mm256_extractf128_ps(quads[i], 1) : _mm256_castps256_ps128(quads[i]);
    const __m128 pp = half ? _mm256_extractf128_ps(pairs[i >> 1], 1) : _mm256_castps256_ps128(pairs[i >> 1]);
    const __m128 p = (i & 1) ? _mm_movehl_ps(pp, pp) : pp;
    float* yr = y + r * ldy;
    const __m128 y4 = write ? b4 : _mm_add_ps(_mm_loadu_ps(yr), b4);
    const __m128 y2 = write ? b2 : _mm_add_ps(_mm_loadl_pi(zero, (const __m64*)(yr + 4)), b2);
    _mm_storeu_ps(yr, _mm_add_ps(y4, q));
    _mm_storel_pi((__m64*)(yr + 4), _mm_add_ps(y2, p));
  }
}
#endif

// O outputs x H * V::W rows of one panel over one column block: sums into y[r, o] (r < rows).
// first: the block that writes (or adds into, with accumulate) y; last: the block that adds bias.
template <class V, int O, int H>
void gemm_tile(const float* xt, int64_t kc, const float* wb, float* y, int64_t ldy, int64_t rows,
               const float* bias, bool write) {
  constexpr int P = 2 * V::W;
  typename V::F acc[O][H];
  for (int o = 0; o < O; ++o)
    for (int h = 0; h < H; ++h) acc[o][h] = V::zero();
  for (int64_t c = 0; c < kc; ++c) {
    typename V::F xv[H];
    for (int h = 0; h < H; ++h) xv[h] = V::load(xt + c * P + h * V::W);
    for (int o = 0; o < O; ++o) {
      const typename V::F b = V::set1(wb[o * kBlockK + c]);
      for (int h = 0; h < H; ++h) acc[o][h] = V::fma(xv[h], b, acc[o][h]);
    }
  }
#ifdef __AVX2__
  if constexpr (std::is_same_v<V, Avx2> && O == 6) {   // transposed in registers (a tenth of the scalar stores)
    for (int h = 0; h < H; ++h)
      store_6x8(acc[0][h], acc[1][h], acc[2][h], acc[3][h], acc[4][h], acc[5][h], y + h * 8 * ldy, ldy,
                std::min<int64_t>(8, rows - h * 8), bias, write);
    return;
  }
#endif
  float sums[O][P];
  for (int o = 0; o < O; ++o)
    for (int h = 0; h < H; ++h) V::store(sums[o] + h * V::W, acc[o][h]);
  for (int64_t r = 0; r < rows; ++r) {
    float* yr = y + r * ldy;
    for (int o = 0; o < O; ++o) {
      const float s = sums[o][r] + (bias ? bias[o] : 0.f);
      yr[o] = write ? s : yr[o] + s;
    }
  }
}

// One panel's rows (L1-resident over the chunk) against the chunk's outputs, O at a time.
template <class V, int H>
void gemm_panel(const float* panel, int64_t kc, const float* wb, int64_t o0, int64_t o1, float* y, int64_t ldy,
                int64_t rows, const float* bias, bool write) {
  int64_t o = o0;
  const float* b = bias;
  for (; o + kTileOutputs <= o1; o += kTileOutputs)
    gemm_tile<V, kTileOutputs, H>(panel, kc, wb + (o - o0) * kBlockK, y + o, ldy, rows, b ? b + o : b, write);
  const float* w = wb + (o - o0) * kBlockK;
  switch (o1 - o) {   // the chunk's last outputs
    case 5: gemm_tile<V, 5, H>(panel, kc, w, y + o, ldy, rows, b ? b + o : b, write); break;
    case 4: gemm_tile<V, 4, H>(panel, kc, w, y + o, ldy, rows, b ? b + o : b, write); break;
    case 3: gemm_tile<V, 3, H>(panel, kc, w, y + o, ldy, rows, b ? b + o : b, write); break;
    case 2: gemm_tile<V, 2, H>(panel, kc, w, y + o, ldy, rows, b ? b + o : b, write); break;
    case 1: gemm_tile<V, 1, H>(panel, kc, w, y + o, ldy, rows, b ? b + o : b, write); break;
    default: break;
  }
}

// Every panel against the chunk's outputs [o0, o1) over the columns [c0, c0 + kc) (a last panel
// of at most V::W rows runs half tiles).
template <class V>
void gemm_chunk_block(const float* xt, int64_t k, int64_t rows, int64_t c0, int64_t kc, const float* wb,
                      int64_t o0, int64_t o1, float* y, int64_t ldy, const float* bias, bool write) {
  constexpr int P = 2 * V::W;
  for (int64_t r0 = 0; r0 < rows; r0 += P) {
    const float* panel = xt + r0 * k + c0 * P;
    const int64_t n = std::min<int64_t>(P, rows - r0);
    if (n > V::W) gemm_panel<V, 2>(panel, kc, wb, o0, o1, y + r0 * ldy, ldy, n, bias, write);
    else gemm_panel<V, 1>(panel, kc, wb, o0, o1, y + r0 * ldy, ldy, n, bias, write);
  }
}

// xt[p][c][P] for the rows [p * P, p * P + P) of panel p.
template <int P>
void pack_panel(const float* x, int64_t ldx, int64_t rows, int64_t k, int64_t p, float* xt) {
  float* dst = xt + p * P * k;
  const int64_t r0 = p * P, n = std::min<int64_t>(P, rows - r0);
  for (int64_t c = 0; c < k; ++c) {
    for (int64_t i = 0; i < n; ++i) dst[c * P + i] = x[(r0 + i) * ldx + c];
    for (int64_t i = n; i < P; ++i) dst[c * P + i] = 0.f;
  }
}

template <class V, class Args>
void gemm_tier(const Args& a, int64_t rows, int num_threads) {
  constexpr int P = 2 * V::W;
  const int64_t panels = (rows + P - 1) / P, chunks = (a.n + kChunkOutputs - 1) / kChunkOutputs;
  float* xt = (float*)aligned_alloc(64, ((panels * P * a.k * sizeof(float)) + 63) / 64 * 64);
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>(num_threads, std::max(chunks, panels)));
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) pack_panel<P>(a.x, a.ldx, rows, a.k, p, xt);
    // NOTE: on the heap per thread and call (~1 us against a GEMM of >= 16 rows), not thread_local:
    // a large TLS array in a dlopen'ed library is at the mercy of the loader's TLS space.
    float* wb = (float*)aligned_alloc(64, kChunkOutputs * kBlockK * sizeof(float));
#pragma omp for schedule(static)
    for (int64_t u = 0; u < chunks; ++u) {
      const int64_t o0 = u * kChunkOutputs, o1 = std::min(a.n, o0 + kChunkOutputs);
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock)
        for (int64_t c0 = 0; c0 < a.k; c0 += kBlockK) {
          const int64_t c1 = std::min(a.k, c0 + kBlockK);
          dequant_block(a, o0, o1, c0, c1, wb);
          gemm_chunk_block<V>(xt + r0 * a.k, a.k, std::min(kRowBlock, rows - r0), c0, c1 - c0, wb, o0, o1,
                              a.y + r0 * a.ldy, a.ldy, c1 == a.k ? a.bias : nullptr, c0 == 0 && !a.accumulate);
        }
    }
    free(wb);
  }
  free(xt);
}

// y (+)= x W^T (+ bias) for `rows` rows in the best tier at or below `isa` compiled in.
template <class Args>
void gemm(const Args& a, int64_t rows, int isa, int num_threads) {
#ifdef __AVX512F__
  if (isa >= bm::kAvx512) { gemm_tier<Avx512>(a, rows, num_threads); return; }
#endif
  if (isa >= bm::kAvx2) gemm_tier<Avx2>(a, rows, num_threads);
  else gemm_tier<Scalar>(a, rows, num_threads);
}

}  // namespace bm_wo
