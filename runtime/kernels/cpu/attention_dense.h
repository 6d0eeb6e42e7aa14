// Attention family, the context step: causal attention of n queries over `total` contiguous keys
// and values (a fresh prompt's own, or a chunk's gathered cache), float32, no window, no ALiBi
// (cpu_attention.py keeps torch's SDPA for those). Query token i sits at position past + i and sees
// keys [0, past + i]; query head h reads KV head h / group.
//
// Layout: q [n, H, D], k and v [total, KV, D], out [n, H, D]: head rows of D contiguous floats,
// token rows at strides ldq / ldk / ldv / ldo (q and v are views into a fused qkv row).
//
// Work (per call): phase 1 packs every KV head's keys transposed in tiles of kDenseKeys keys,
// kt[head][tile][d][kDenseKeys] (zeros past the last key), the threads sharing the tiles; one
// barrier; phase 2 takes items (KV head, tile of kDenseQueryTokens query tokens) in decreasing cost,
// dynamically. An item's rows are its tokens x the group's heads (R = kDenseQueryTokens * group, token
// major), and it runs:
//   1. qs[R][D] = q * scale (gathers the strided rows);
//   2. scores s[R][keys] = qs . k over the keys the item's last token sees, by register tiles of
//      4 rows x kDenseKeys keys over the packed tiles (per d: 2 key-vector loads, 4 broadcasts, 8 FMAs);
//   3. per row the exact softmax over its visible keys (max, exp8, sum), the rest zeroed;
//   4. o[R][D] = p . v by register tiles of 4 rows x 16 columns (per key: 2 value-vector loads,
//      4 broadcasts, 8 FMAs), then out = o / sum.
// The softmax is exact per row (two passes over the row's scores, no running rescale), so a
// query's result depends neither on the tiling nor on the thread count. Scratch per item:
// (R x keys + R x D) floats (R = 24, 512 keys: 54 KiB).
// Requires D % 16 == 0 (the value tiles; callers fall back to torch otherwise).
#pragma once

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <math.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "norm_activation.h"
#include "vec.h"

namespace bm {

constexpr int64_t kDenseKeys = 16;
constexpr int64_t kDenseQueryTokens = 8;
constexpr int kDenseRows = 6;   // rows per register tile: 12 accumulators + 2 loads + 1 broadcast of 16 ymm

struct DenseAttention {
  const float* q; int64_t ldq;
  const float* k; int64_t ldk;
  const float* v; int64_t ldv;
  float* out; int64_t ldo;
  int64_t n, total, past, heads, kv_heads, head_dim;
  float scale;
};

// s[r][key0 .. key0 + 16) for NR rows of qs from one packed tile kt[D][16].
template <int NR>
inline void score_tile(const float* qs, int64_t d_count, const float* kt, float* s, int64_t lds) {
  __m256 acc[NR][2];
  for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < d_count; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * kDenseKeys), k1 = _mm256_loadu_ps(kt + d * kDenseKeys + 8);
    for (int r = 0; r < NR; ++r) {
      const __m256 qb = _mm256_broadcast_ss(qs + r * d_count + d);
      acc[r][0] = _mm256_fmadd_ps(qb, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qb, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    _mm256_storeu_ps(s + r * lds, acc[r][0]);
    _mm256_storeu_ps(s + r * lds + 8, acc[r][1]);
  }
}

// o[r][d0 .. d0 + 16) = sum over keys [0, keys) of p[r][key] * v[key][d0 ..] for NR rows.
template <int NR>
inline void value_tile(const float* p, int64_t ldp, int64_t keys, const float* v, int64_t ldv, float* o,
                       int64_t ldo) {
  __m256 acc[NR][2];
  for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t j = 0; j < keys; ++j) {
    const __m256 v0 = _mm256_loadu_ps(v + j * ldv), v1 = _mm256_loadu_ps(v + j * ldv + 8);
    for (int r = 0; r < NR; ++r) {
      const __m256 pb = _mm256_broadcast_ss(p + r * ldp + j);
      acc[r][0] = _mm256_fmadd_ps(pb, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(pb, v1, acc[r][1]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    _mm256_storeu_ps(o + r * ldo, acc[r][0]);
    _mm256_storeu_ps(o + r * ldo + 8, acc[r][1]);
  }
}

// tile(std::integral_constant<int, NR>, r) over rows [0, rows): tiles of kDenseRows, then one of
// the remaining 1 .. kDenseRows - 1 rows.
template <class Tile>
inline void by_row_tiles(int64_t rows, Tile&& tile) {
  int64_t r = 0;
  for (; r + kDenseRows <= rows; r += kDenseRows) tile(std::integral_constant<int, kDenseRows>{}, r);
  switch (rows - r) {
    case 5: tile(std::integral_constant<int, 5>{}, r); break;
    case 4: tile(std::integral_constant<int, 4>{}, r); break;
    case 3: tile(std::integral_constant<int, 3>{}, r); break;
    case 2: tile(std::integral_constant<int, 2>{}, r); break;
    case 1: tile(std::integral_constant<int, 1>{}, r); break;
  }
}
static_assert(kDenseRows == 6, "by_row_tiles' remainder cases");

inline void dense_attention(const DenseAttention& a, int num_threads) {
  const int64_t D = a.head_dim, group = a.heads / a.kv_heads;
  const int64_t tiles = (a.total + kDenseKeys - 1) / kDenseKeys, tile_floats = D * kDenseKeys;
  std::vector<float> kt(a.kv_heads * tiles * tile_floats);
  const int64_t query_tiles = (a.n + kDenseQueryTokens - 1) / kDenseQueryTokens, items = a.kv_heads * query_tiles;
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < a.kv_heads * tiles; ++t) {
      const int64_t head = t / tiles, key0 = t % tiles * kDenseKeys;
      float* dst = kt.data() + t * tile_floats;
      for (int64_t j = 0; j < kDenseKeys; ++j) {
        const float* src = a.k + (key0 + j) * a.ldk + head * D;
        for (int64_t d = 0; d < D; ++d) dst[d * kDenseKeys + j] = key0 + j < a.total ? src[d] : 0.f;
      }
    }   // the implicit barrier: every packed tile is written before any item reads it
    const int64_t max_rows = kDenseQueryTokens * group;
    std::vector<float> qs(max_rows * D), s(max_rows * tiles * kDenseKeys), o(max_rows * D), inv_sum(max_rows);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      // the last query tiles (most keys) first
      const int64_t tile = query_tiles - 1 - item / a.kv_heads, head = item % a.kv_heads;
      const int64_t t0 = tile * kDenseQueryTokens, t1 = std::min(a.n, t0 + kDenseQueryTokens);
      const int64_t rows = (t1 - t0) * group, keys = a.past + t1, key_tiles = (keys + kDenseKeys - 1) / kDenseKeys;
      const int64_t lds = key_tiles * kDenseKeys;
      for (int64_t i = t0; i < t1; ++i)
        for (int64_t g = 0; g < group; ++g) {
          const float* src = a.q + i * a.ldq + (head * group + g) * D;
          float* dst = qs.data() + ((i - t0) * group + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * a.scale;
        }
      const float* kh = kt.data() + head * tiles * tile_floats;
      for (int64_t kt_i = 0; kt_i < key_tiles; ++kt_i) {
        const float* tile_k = kh + kt_i * tile_floats;
        float* sc = s.data() + kt_i * kDenseKeys;
        by_row_tiles(rows, [&](auto nr, int64_t r) {
          score_tile<decltype(nr)::value>(qs.data() + r * D, D, tile_k, sc + r * lds, lds);
        });
      }
      for (int64_t r = 0; r < rows; ++r)
        inv_sum[r] = 1.f / softmax_row(s.data() + r * lds, a.past + t0 + r / group + 1, keys).sum;
      const float* vh = a.v + head * D;
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        const float* vd = vh + d0;
        float* od = o.data() + d0;
        by_row_tiles(rows, [&](auto nr, int64_t r) {
          value_tile<decltype(nr)::value>(s.data() + r * lds, lds, keys, vd, a.ldv, od + r * D, D);
        });
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = t0 + r / group, g = r % group;
        float* dst = a.out + i * a.ldo + (head * group + g) * D;
        const __m256 inv = _mm256_set1_ps(inv_sum[r]);
        for (int64_t d = 0; d < D; d += 8)
          _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(o.data() + r * D + d), inv));
      }
    }
  }
}

}  // namespace bm
