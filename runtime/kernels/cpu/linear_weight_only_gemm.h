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
//   3. A tile's sums go, a vector per (output, V::W rows), into the chunk's sums yt[o][r] (the
//      first column block writes, the later ones add, the last adds its sums plus the bias); after
//      the pass's last block they go to y[r, o] transposed (written, or added with accumulate).
//      Against the tile's sums written to y element by element per block (AVX2: transposed in
//      registers), samples.microbench.batch_linear at 512 rows, AMD EPYC Zen 4, 2 threads, one run
//      each, GFLOP/s as a fraction of the float32 GEMM's (oneDNN) in the same run, over SmolLM2's
//      and the ~1B LLaMA's six shapes: int8 0.77-0.92 -> 0.92-1.00, int4 (with its AVX-512
//      de-quantization below) 0.71-0.87 -> 0.90-1.00; at 16, 64 and 128 rows on SmolLM2's shapes
//      int8 at or above float32 in 11 of the 12 cases, int4 in 9 (the others 0.89-0.99).
// Each output's sum runs over the columns in order within a block (per lane: one row), so a row's
// result does not depend on the other rows of the call.
// Tiers: the V of linear_weight_only.h (Scalar, Avx2, Avx512); de-quantization is plain C++
// vectorized by the compiler, int4's at AVX-512 through a table per group.
#pragma once

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include <algorithm>
#include <type_traits>

#include "linear_weight_only.h"

namespace bm_wo {

constexpr int64_t kGemmMinRows = 16;    // rows from which bm_wo_* take this path (see weight_only_linear.py)
constexpr int kTileOutputs = 6;   // 12 x 2 zmm accumulators at AVX-512 ran no faster
constexpr int64_t kChunkOutputs = 96;   // a multiple of kTileOutputs
constexpr int64_t kBlockK = 256;        // a multiple of every int4 group size (32, 64, 128)
// Rows per pass over a chunk's column blocks (a multiple of every tier's panel): their outputs
// (kRowBlock * kChunkOutputs * 4 = 192 KiB), the chunk's de-quantized block (96 KiB) and a panel
// (32 KiB at AVX-512) stay in L2 from one column block to the next (512 KiB and more on the x86
// servers we run on); the chunk is de-quantized once per pass (0.13-0.2 ns per weight, AVX2). 512
// rows, against 128 before: int4 g32 at 512 rows 1.12-1.24x (SmolLM2's and the ~1B LLaMA's
// shapes, samples.microbench.batch_linear, AMD EPYC Zen 4, 2 threads), int8 0.99-1.09x.
constexpr int64_t kRowBlock = 512;
// The chunk's sums yt[o][r] are sums_stride(rows) floats apart per output: an odd number of lines,
// at least one more than a pass's rows (at most kRowBlock), so that the outputs' lines fall in
// different L1 sets when the pass's sums are read out by row (at 2 KiB apart they all fell in 2
// sets of 64). Sized by the call's rows, not kRowBlock: 12 KiB per thread for a 16-row prompt
// instead of 198 KiB, which the allocator kept resident after the call.
inline int64_t sums_stride(int64_t rows) { return 16 * (((std::min(kRowBlock, rows) + 15) / 16 + 1) | 1); }

// wb[o - o0][c - c0] = w[o, c] for o in [o0, o1), c in [c0, c1).
template <class V>
inline void dequant_block(const Int8Args& a, int64_t o0, int64_t o1, int64_t c0, int64_t c1, float* wb) {
  for (int64_t o = o0; o < o1; ++o) {
    const int8_t* src = a.w + o * a.k + c0;
    float* dst = wb + (o - o0) * kBlockK;
    const float s = a.scale[o];
#pragma omp simd
    for (int64_t c = 0; c < c1 - c0; ++c) dst[c] = (float)src[c] * s;
  }
}

// int4: c0 and c1 on group boundaries (c1 == k or a multiple of kBlockK). AVX-512 (V::kLut): each
// group's 16 de-quantized values in a table, 32 weights by two vpermps (int4_tile_lut's way; the
// same values: q * d + m is one FMA either way).
template <class V>
inline void dequant_block(const Int4Args& a, int64_t o0, int64_t o1, int64_t c0, int64_t c1, float* wb) {
  const int64_t groups = a.k / a.gs, half = a.gs / 2;
  for (int64_t o = o0; o < o1; ++o) {
    float* dst = wb + (o - o0) * kBlockK;
    for (int64_t g = c0 / a.gs; g < c1 / a.gs; ++g) {
      const float d = half_to_float(a.scale[o * groups + g]), m = half_to_float(a.min[o * groups + g]);
      const uint8_t* b = a.w + o * (a.k / 2) + g * half;
      float* lo = dst + g * a.gs - c0;
      if constexpr (V::kLut) {
        const typename V::F lut = V::fma(V::iota(), V::set1(d), V::set1(m));
        for (int64_t j = 0; j < half; j += V::W) {
          typename V::F l, h;
          V::u4_lut(b + j, lut, l, h);
          V::store(lo + j, l);
          V::store(lo + half + j, h);
        }
      } else {
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          lo[j] = (float)(b[j] & 15) * d + m;
          lo[half + j] = (float)(b[j] >> 4) * d + m;
        }
      }
    }
  }
}

// O outputs x H * V::W rows of one panel over one column block, into the chunk's sums held output by
// output: yt[o * ldt + r] (r: the panel's rows). first: the block that writes yt; bias (the last
// block's) is added to the block's sums before they go into yt.
template <class V, int O, int H>
void gemm_tile(const float* xt, int64_t kc, const float* wb, float* yt, int64_t ldt, const float* bias, bool first) {
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
  for (int o = 0; o < O; ++o)
    for (int h = 0; h < H; ++h) {
      const typename V::F sum = bias ? V::add(acc[o][h], V::set1(bias[o])) : acc[o][h];
      float* dst = yt + o * ldt + h * V::W;
      V::store(dst, first ? sum : V::add(V::load(dst), sum));
    }
}

// One panel's rows (L1-resident over the chunk) against the chunk's outputs, O at a time.
template <class V, int H>
void gemm_panel(const float* panel, int64_t kc, const float* wb, int64_t outputs, float* yt, int64_t ldt,
                const float* bias, bool first) {
  int64_t o = 0;
  const float* b = bias;
  for (; o + kTileOutputs <= outputs; o += kTileOutputs)
    gemm_tile<V, kTileOutputs, H>(panel, kc, wb + o * kBlockK, yt + o * ldt, ldt, b ? b + o : b, first);
  const float* w = wb + o * kBlockK;
  float* t = yt + o * ldt;
  switch (outputs - o) {   // the chunk's last outputs
    case 5: gemm_tile<V, 5, H>(panel, kc, w, t, ldt, b ? b + o : b, first); break;
    case 4: gemm_tile<V, 4, H>(panel, kc, w, t, ldt, b ? b + o : b, first); break;
    case 3: gemm_tile<V, 3, H>(panel, kc, w, t, ldt, b ? b + o : b, first); break;
    case 2: gemm_tile<V, 2, H>(panel, kc, w, t, ldt, b ? b + o : b, first); break;
    case 1: gemm_tile<V, 1, H>(panel, kc, w, t, ldt, b ? b + o : b, first); break;
    default: break;
  }
}

// Every panel of `rows` rows against the chunk's `outputs` over the columns [c0, c0 + kc), into
// yt (a last panel of at most V::W rows runs half tiles).
template <class V>
void gemm_chunk_block(const float* xt, int64_t k, int64_t rows, int64_t c0, int64_t kc, const float* wb,
                      int64_t outputs, float* yt, int64_t ldt, const float* bias, bool first) {
  constexpr int P = 2 * V::W;
  for (int64_t r0 = 0; r0 < rows; r0 += P) {
    const float* panel = xt + r0 * k + c0 * P;
    if (rows - r0 > V::W) gemm_panel<V, 2>(panel, kc, wb, outputs, yt + r0, ldt, bias, first);
    else gemm_panel<V, 1>(panel, kc, wb, outputs, yt + r0, ldt, bias, first);
  }
}

// xt[p][c][P] for the rows [p * P, p * P + P) of panel p. kVector: whole 8 x 8 blocks moved by
// bm::transpose8x8, the rest one by one (the same values either way: a move). Scalar per element it
// took 7-10 % of an int4 GEMM of 512 rows with k = 1536, n = 576 (AMD EPYC Zen 4).
template <int P, bool kVector>
void pack_panel(const float* x, int64_t ldx, int64_t rows, int64_t k, int64_t p, float* xt) {
  float* dst = xt + p * P * k;
  const int64_t r0 = p * P, n = std::min<int64_t>(P, rows - r0);
  const int64_t n8 = kVector ? n / 8 * 8 : 0, k8 = kVector ? k / 8 * 8 : 0;
  for (int64_t i = 0; i < n8; i += 8)
    for (int64_t c = 0; c < k8; c += 8) bm::transpose8x8(x + (r0 + i) * ldx + c, ldx, dst + c * P + i, P);
  for (int64_t c = 0; c < k; ++c) {
    for (int64_t i = c < k8 ? n8 : 0; i < n; ++i) dst[c * P + i] = x[(r0 + i) * ldx + c];
    for (int64_t i = n; i < P; ++i) dst[c * P + i] = 0.f;
  }
}

// y[r0 + r, o0 + j] (+)= yt[j * ldt + r] for r < rows, j < outputs: a pass's sums into y, transposed
// (bm::transpose8x8 for whole 8 x 8 blocks where kVector; each value added once either way).
template <bool kVector>
void store_sums(const float* yt, int64_t ldt, int64_t rows, int64_t outputs, float* y, int64_t ldy, int accumulate) {
  const int64_t rows8 = kVector ? rows / 8 * 8 : 0, outputs8 = kVector ? outputs / 8 * 8 : 0;
  alignas(32) float block[64];
  for (int64_t r = 0; r < rows8; r += 8)
    for (int64_t j = 0; j < outputs8; j += 8) {
      if (!accumulate) {
        bm::transpose8x8(yt + j * ldt + r, ldt, y + r * ldy + j, ldy);
        continue;
      }
      bm::transpose8x8(yt + j * ldt + r, ldt, block, 8);
      for (int64_t i = 0; i < 8; ++i) {
        float* yr = y + (r + i) * ldy + j;
        _mm256_storeu_ps(yr, _mm256_add_ps(_mm256_loadu_ps(yr), _mm256_load_ps(block + 8 * i)));
      }
    }
  for (int64_t r = 0; r < rows; ++r) {
    float* yr = y + r * ldy;
    for (int64_t j = r < rows8 ? outputs8 : 0; j < outputs; ++j) {
      const float s = yt[j * ldt + r];
      yr[j] = accumulate ? yr[j] + s : s;
    }
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
    for (int64_t p = 0; p < panels; ++p) pack_panel<P, (V::W >= 8)>(a.x, a.ldx, rows, a.k, p, xt);
    // NOTE: on the heap per thread and call (~1 us against a GEMM of >= 16 rows), not thread_local:
    // a large TLS array in a dlopen'ed library is at the mercy of the loader's TLS space.
    float* wb = (float*)aligned_alloc(64, kChunkOutputs * kBlockK * sizeof(float));
    const int64_t ldt = sums_stride(rows);
    float* yt = (float*)aligned_alloc(64, kChunkOutputs * ldt * sizeof(float));
#pragma omp for schedule(static)
    for (int64_t u = 0; u < chunks; ++u) {
      const int64_t o0 = u * kChunkOutputs, o1 = std::min(a.n, o0 + kChunkOutputs);
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
        const int64_t pass_rows = std::min(kRowBlock, rows - r0);
        for (int64_t c0 = 0; c0 < a.k; c0 += kBlockK) {
          const int64_t c1 = std::min(a.k, c0 + kBlockK);
          dequant_block<V>(a, o0, o1, c0, c1, wb);
          gemm_chunk_block<V>(xt + r0 * a.k, a.k, pass_rows, c0, c1 - c0, wb, o1 - o0, yt, ldt,
                              c1 == a.k && a.bias ? a.bias + o0 : nullptr, c0 == 0);
        }
        store_sums<(V::W >= 8)>(yt, ldt, pass_rows, o1 - o0, a.y + r0 * a.ldy + o0, a.ldy, a.accumulate);
      }
    }
    free(yt);
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
