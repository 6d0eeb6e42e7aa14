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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// int8 on AMX-BF16 tiles (bm::kAmx, where the tier's tile permission was granted: isa.h), for k a
// multiple of 32. Each input value is split into three bf16 parts, x = hi + mid + lo (each the top
// 16 bits of what the parts before it left: exact, 24 bits in all); an int8 weight is exact in bf16;
// so every product tdpbf16ps forms is exact and the sums are float32 (its own order within a
// tile step; denormal inputs and results flushed to zero), as the AVX-512 tiles' are in theirs.
// Layout per call: the parts xp[3][rows32][k] (rows32: rows rounded up to 32, zero rows past the
// last), then per chunk of kAmxChunkOutputs outputs the weights as bf16 pairs, wb[block of 32
// outputs][k / 32][2 halves of 16 outputs][16 column pairs][16 outputs][2] (tdpbf16ps's B layout;
// outputs past n zero), then 32 x 32 output blocks each over all of k: 4 accumulator tiles (2 row
// halves x 2 output halves), per 32 columns 2 weight tiles and 2 x 3 input tiles, 12 tdpbf16ps.
constexpr int64_t kAmxChunkOutputs = 512;   // weights packed at once (32 KiB per 32 columns)
// From 32 rows (one row block; below it half of every input tile would be zeros): at 16 rows, k =
// 1536, it ran 0.85-0.93x of torch's float32 GEMM rate where the AVX-512 tiles ran 0.96-1.12x.
constexpr int64_t kAmxMinRows = 32;

struct alignas(64) TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// The three bf16 parts of row x[0, k): hi, mid, lo at h, m, l.
inline void split_bf16x3(const float* x, int64_t k, uint16_t* h, uint16_t* m, uint16_t* l) {
  const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
  for (int64_t c = 0; c < k; c += 16) {
    const __m512 v = _mm512_loadu_ps(x + c);
    const __m512i vh = _mm512_and_si512(_mm512_castps_si512(v), top);
    const __m512 r1 = _mm512_sub_ps(v, _mm512_castsi512_ps(vh));
    const __m512i vm = _mm512_and_si512(_mm512_castps_si512(r1), top);
    const __m512 r2 = _mm512_sub_ps(r1, _mm512_castsi512_ps(vm));
    _mm256_storeu_si256((__m256i*)(h + c), _mm512_cvtepi32_epi16(_mm512_srli_epi32(vh, 16)));
    _mm256_storeu_si256((__m256i*)(m + c), _mm512_cvtepi32_epi16(_mm512_srli_epi32(vm, 16)));
    _mm256_storeu_si256((__m256i*)(l + c), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(r2), 16)));
  }
}

// r[p] = column p of the 16 x 16 dwords r[0..15] (4 rounds of shuffles).
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// The 32 outputs from o0 (zero past n) as wb's block: int8 -> bf16 (exact), pairs of columns as dwords.
inline void pack_int8_block(const Int8Args& a, int64_t o0, uint32_t* wb) {
  for (int64_t kb = 0; kb < a.k / 32; ++kb)
    for (int h = 0; h < 2; ++h) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) {
        const int64_t o = o0 + 16 * h + j;
        if (o >= a.n) { r[j] = _mm512_setzero_si512(); continue; }
        const __m256i q = _mm256_loadu_si256((const __m256i*)(a.w + o * a.k + 32 * kb));
        const __m512i lo = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
        const __m512i hi = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
        r[j] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(_mm512_srli_epi32(lo, 16))),
                                  _mm512_cvtepi32_epi16(_mm512_srli_epi32(hi, 16)), 1);
      }
      transpose16x16(r);
      for (int p = 0; p < 16; ++p) _mm512_store_si512(wb + ((2 * kb + h) * 16 + p) * 16, r[p]);
    }
}

// One 32 x 32 block: rows [r0, r0 + 32) of xp against wb's block, into y (+ bias, accumulate).
inline void amx_block(const Int8Args& a, const uint16_t* xp, int64_t rows, int64_t rows32, int64_t r0, int64_t o0,
                      const uint32_t* wb) {
  const int64_t k = a.k, part = rows32 * k;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t kb = 0; kb < k / 32; ++kb) {
    _tile_loadd(6, wb + (2 * kb) * 256, 64);
    _tile_loadd(7, wb + (2 * kb + 1) * 256, 64);
    for (int p = 0; p < 3; ++p) {
      const uint16_t* x = xp + p * part + r0 * k + 32 * kb;
      _tile_loadd(4, x, 2 * k);
      _tile_loadd(5, x + 16 * k, 2 * k);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[4][16][16];
  _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64); _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
  for (int h = 0; h < 2; ++h) {
    const int64_t ob = o0 + 16 * h;
    if (ob >= a.n) break;
    const __mmask16 live = (__mmask16)(a.n - ob >= 16 ? 0xFFFF : (1u << (a.n - ob)) - 1);
    const __m512 scale = _mm512_maskz_loadu_ps(live, a.scale + ob);
    const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(live, a.bias + ob) : _mm512_setzero_ps();
    for (int t = 0; t < 2; ++t)
      for (int i = 0; i < 16; ++i) {
        const int64_t r = r0 + 16 * t + i;
        if (r >= rows) break;
        float* yr = a.y + r * a.ldy + ob;
        __m512 v = _mm512_fmadd_ps(_mm512_load_ps(c[2 * t + h][i]), scale, bias);
        if (a.accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(live, yr), v);
        _mm512_mask_storeu_ps(yr, live, v);
      }
  }
}

inline void amx_gemm(const Int8Args& a, int64_t rows, int num_threads) {
  const int64_t k = a.k, rows32 = (rows + 31) / 32 * 32, row_blocks = rows32 / 32;
  uint16_t* xp = (uint16_t*)aligned_alloc(64, 3 * rows32 * k * sizeof(uint16_t));
  const int64_t chunk = std::min(kAmxChunkOutputs, (a.n + 31) / 32 * 32);
  uint32_t* wb = (uint32_t*)aligned_alloc(64, chunk * k * sizeof(uint16_t));
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows32; ++r) {
      uint16_t* h = xp + r * k;
      if (r < rows) split_bf16x3(a.x + r * a.ldx, k, h, h + rows32 * k, h + 2 * rows32 * k);
      else for (int p = 0; p < 3; ++p) std::fill_n(h + p * rows32 * k, k, (uint16_t)0);
    }
    TileConfig cfg{};
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
    for (int64_t c0 = 0; c0 < a.n; c0 += chunk) {
      const int64_t blocks = (std::min(a.n - c0, chunk) + 31) / 32;
#pragma omp for schedule(static)
      for (int64_t b = 0; b < blocks; ++b) pack_int8_block(a, c0 + 32 * b, wb + b * 16 * k);
#pragma omp for schedule(static) collapse(2)
      for (int64_t rb = 0; rb < row_blocks; ++rb)
        for (int64_t b = 0; b < blocks; ++b) amx_block(a, xp, rows, rows32, 32 * rb, c0 + 32 * b, wb + b * 16 * k);
    }
    _tile_release();
  }
  free(wb);
  free(xp);
}
#endif

// y (+)= x W^T (+ bias) for `rows` rows in the best tier at or below `isa` compiled in.
template <class Args>
void gemm(const Args& a, int64_t rows, int isa, int num_threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if constexpr (std::is_same_v<Args, Int8Args>)
    if (isa >= bm::kAmx && a.k % 32 == 0 && rows >= kAmxMinRows) { amx_gemm(a, rows, num_threads); return; }
#endif
#ifdef __AVX512F__
  if (isa >= bm::kAvx512) { gemm_tier<Avx512>(a, rows, num_threads); return; }
#endif
  if (isa >= bm::kAvx2) gemm_tier<Avx2>(a, rows, num_threads);
  else gemm_tier<Scalar>(a, rows, num_threads);
}

}  // namespace bm_wo
