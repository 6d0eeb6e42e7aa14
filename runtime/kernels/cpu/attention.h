// Attention family of the native CPU layer: one paged decode attention over a KV format's row
// reader. A KV row is one (slot, KV head) of a cache [num_blocks, tpb, kv_heads, head_dim]:
// row = slot * kv_heads + head, its values at cache + row * head_dim.
// KV formats (formats.h's KvFormat; runtime/kernels/kv_quant.py defines the int8 one): float32;
//   bf16 (rounded to nearest even); int8 with a float32 scale per row (scale = max|x| / 127,
//   q = round-half-even(x / scale), read as q * scale).
// The per-op decode attention (ops.cpp) and the fused step (decode_step.cpp) both call
// attend_rows, so they compute the same numbers. Its dot products and V sums are AVX2 + FMA
// intrinsics without a lower tier, as softmax's exp8 (vec.h) is: the library builds only for
// AVX2 / FMA CPUs (library.cpu_supported), and the ISA cap (isa.h) selects the linear tiers only.
#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "formats.h"
#include "norm_activation.h"
#include "vec.h"

namespace bm {

// One cache of one layer as rows of head_dim values in `format` (scales: int8 only).
struct KvRows {
  int32_t format;
  void* cache;
  float* scales;
  int64_t head_dim;
  // A row read from `fresh` (float32 [head_dim], as read() would return it) instead of the cache: a
  // task attending over a key another task is writing (decode_step.cpp's split of a KV head's queries).
  int64_t fresh_row = -1;
  const float* fresh = nullptr;

  // Row `row` as float32: the cache's own memory (float32) or `buffer` [head_dim] holding it converted.
  const float* read(int64_t row, float* buffer) const {
    const int64_t d = head_dim;
    if (row == fresh_row) return fresh;
    if (format == kKvFloat32) return (const float*)cache + row * d;
    if (format == kKvBf16) {
      const uint16_t* p = (const uint16_t*)cache + row * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) buffer[i] = bf16_to_f32(p[i]);
    } else {
      const int8_t* p = (const int8_t*)cache + row * d;
      const float s = scales[row];
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) buffer[i] = (float)p[i] * s;
    }
    return buffer;
  }

  // Row `row`'s bytes toward L1 (the cache was written steps ago; the weight stream has evicted it).
  void prefetch(int64_t row) const {
    const int64_t bytes = head_dim * (format == kKvFloat32 ? 4 : format == kKvBf16 ? 2 : 1);
    const char* p = (const char*)cache + row * bytes;
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
  }

  // out [head_dim] = x as read() returns it once write() stored it (bf16, int8: rounded the same way);
  // local: >= 4 * head_dim bytes of scratch. In place (out == x) is allowed.
  void round_trip(const float* x, float* out, uint8_t* local) const {
    float scale = 0.f;
    const KvRows one{format, local, &scale, head_dim};
    one.write(0, x);
    const float* stored = one.read(0, out);
    if (stored != out) std::copy(stored, stored + head_dim, out);
  }

  void write(int64_t row, const float* x) const {
    const int64_t d = head_dim;
    if (format == kKvFloat32) {
      std::copy(x, x + d, (float*)cache + row * d);
    } else if (format == kKvBf16) {
      uint16_t* p = (uint16_t*)cache + row * d;
      for (int64_t i = 0; i < d; ++i) p[i] = f32_to_bf16(x[i]);
    } else {
      float amax = 0.f;
      for (int64_t i = 0; i < d; ++i) amax = std::max(amax, fabsf(x[i]));
      const float scale = amax / 127.f, safe = scale > 0.f ? scale : 1.f;
      int8_t* p = (int8_t*)cache + row * d;
      for (int64_t i = 0; i < d; ++i) p[i] = (int8_t)nearbyintf(std::min(127.f, std::max(-127.f, x[i] / safe)));
      scales[row] = scale;
    }
  }
};

// The keys a decode query at position len - 1 attends to, as two spans of positions: [0, sinks)
// and [recent, len), recent >= sinks (window < 0: no window, all keys; else the last `window`
// plus the first `sink`).
struct KeySpans {
  int64_t sinks, recent, len;
};

inline KeySpans visible_keys(int64_t len, int64_t window, int64_t sink) {
  if (window < 0) return {0, 0, len};
  const int64_t sinks = std::min(std::max(sink, (int64_t)0), len);
  return {sinks, std::max(len - window, sinks), len};
}

// The rows of KV head kvh that a sequence's decode query reads: its visible keys through its block
// table, in position order (one division per span, none per key).
inline void visible_rows(int64_t len, int64_t window, int64_t sink, const int32_t* table, int64_t tpb,
                         int64_t num_kv_heads, int64_t kvh, std::vector<int64_t>& rows) {
  const KeySpans spans = visible_keys(len, window, sink);
  rows.resize(spans.sinks + spans.len - spans.recent);
  int64_t* out = rows.data();
  for (const auto [from, to] : {std::pair{(int64_t)0, spans.sinks}, std::pair{spans.recent, spans.len}}) {
    for (int64_t j = from, block = from / tpb; j < to; ++block) {
      const int64_t shift = ((int64_t)table[block] - block) * tpb, stop = std::min(to, (block + 1) * tpb);
      for (; j < stop; ++j) *out++ = (shift + j) * num_kv_heads + kvh;
    }
  }
}

struct AttentionScratch {
  std::vector<float> q, acc, row, scores, fresh_k, fresh_v;
  std::vector<uint8_t> local;
  std::vector<int64_t> keys;
};

// Keys per step of attend_rows, and how far ahead of the one being scored its K rows are prefetched.
constexpr int64_t kKeyTile = 4, kPrefetchKeys = 16;

// scores[g * n + t] = (q[g] . keys[t]) * scale for the group's heads and the tile's first `count` keys
// (keys [4] float32 [d]; the unused ones point at a valid row). Each dot product: two 8-lane
// accumulators over alternate 8-column chunks (then one more chunk into the first, then the columns
// past the last multiple of 8 added after the horizontal sum).
inline void score_tile(const float* q, int64_t group, int64_t d, const float* const* keys, int64_t count, float scale,
                       float* scores, int64_t n) {
  const int64_t d16 = d & ~(int64_t)15, d8 = d & ~(int64_t)7;
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * d;
    __m256 a[4], b[4];
    for (int t = 0; t < 4; ++t) a[t] = b[t] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d16; c += 16) {
      const __m256 x = _mm256_loadu_ps(qg + c), y = _mm256_loadu_ps(qg + c + 8);
      for (int t = 0; t < 4; ++t) {
        a[t] = _mm256_fmadd_ps(x, _mm256_loadu_ps(keys[t] + c), a[t]);
        b[t] = _mm256_fmadd_ps(y, _mm256_loadu_ps(keys[t] + c + 8), b[t]);
      }
    }
    if (d8 > d16) {
      const __m256 x = _mm256_loadu_ps(qg + d16);
      for (int t = 0; t < 4; ++t) a[t] = _mm256_fmadd_ps(x, _mm256_loadu_ps(keys[t] + d16), a[t]);
    }
    for (int64_t t = 0; t < count; ++t) {
      float sum = hsum8(_mm256_add_ps(a[t], b[t]));
      for (int64_t c = d8; c < d; ++c) sum += qg[c] * keys[t][c];
      scores[g * n + t] = sum * scale;
    }
  }
}

// out[g] += p[g * n + t] * values[t] for the tile's first `count` keys in order (one multiply-add
// per key and column, as key by key), over the group's heads; values [4] float32 [d].
inline void accumulate_tile(const float* p, int64_t n, int64_t group, int64_t d, const float* const* values,
                            int64_t count, float* out) {
  const int64_t d8 = d & ~(int64_t)7;
  for (int64_t g = 0; g < group; ++g) {
    float* o = out + g * d;
    const float* pg = p + g * n;
    if (count == 4) {
      const __m256 p0 = _mm256_set1_ps(pg[0]), p1 = _mm256_set1_ps(pg[1]), p2 = _mm256_set1_ps(pg[2]),
                   p3 = _mm256_set1_ps(pg[3]);
      for (int64_t c = 0; c < d8; c += 8) {
        __m256 acc = _mm256_fmadd_ps(p0, _mm256_loadu_ps(values[0] + c), _mm256_loadu_ps(o + c));
        acc = _mm256_fmadd_ps(p1, _mm256_loadu_ps(values[1] + c), acc);
        acc = _mm256_fmadd_ps(p2, _mm256_loadu_ps(values[2] + c), acc);
        _mm256_storeu_ps(o + c, _mm256_fmadd_ps(p3, _mm256_loadu_ps(values[3] + c), acc));
      }
    } else {
      for (int64_t t = 0; t < count; ++t) {
        const __m256 pt = _mm256_set1_ps(pg[t]);
        for (int64_t c = 0; c < d8; c += 8)
          _mm256_storeu_ps(o + c, _mm256_fmadd_ps(pt, _mm256_loadu_ps(values[t] + c), _mm256_loadu_ps(o + c)));
      }
    }
    for (int64_t c = d8; c < d; ++c)
      for (int64_t t = 0; t < count; ++t) o[c] = fmaf(pg[t], values[t][c], o[c]);
  }
}

// The `group` query heads q [group, d] (float32) sharing one KV head over its rows `keys`:
// out [group, d] = softmax(q k^T * scale) v, scores and sums in float32. Keys go 4 at a time: each
// K and V row is read (float32: in place; bf16, int8: converted once into s.row) for all the group's
// heads together.
// Rounding: a score is its dot product summed as score_tile says, then times scale; the weighted
// sum of V adds key by key in key order, one fused multiply-add per value.
BM_ONE_COPY void attend_rows(const float* q, int64_t group, int64_t d, const KvRows& k, const KvRows& v,
                             const std::vector<int64_t>& keys, float scale, AttentionScratch& s, float* out) {
  const int64_t n = (int64_t)keys.size();
  const int64_t* rows = keys.data();
  s.scores.resize(group * n);
  s.row.resize(kKeyTile * d);
  float* scores = s.scores.data();
  const float* tile[kKeyTile];
  for (int64_t j = 0; j < std::min(n, kPrefetchKeys); ++j) k.prefetch(rows[j]);
  for (int64_t i = 0; i < n; i += kKeyTile) {
    const int64_t count = std::min(kKeyTile, n - i);
    for (int64_t j = i + kPrefetchKeys; j < std::min(n, i + kPrefetchKeys + kKeyTile); ++j) k.prefetch(rows[j]);
    for (int64_t j = i; j < i + count; ++j) v.prefetch(rows[j]);
    for (int64_t t = 0; t < kKeyTile; ++t) tile[t] = k.read(rows[i + std::min(t, count - 1)], s.row.data() + t * d);
    score_tile(q, group, d, tile, count, scale, scores + i, n);
  }
  for (int64_t g = 0; g < group; ++g) softmax(scores + g * n, n);
  std::fill_n(out, group * d, 0.f);
  for (int64_t i = 0; i < n; i += kKeyTile) {
    const int64_t count = std::min(kKeyTile, n - i);
    for (int64_t t = 0; t < count; ++t) tile[t] = v.read(rows[i + t], s.row.data() + t * d);
    accumulate_tile(scores + i, n, group, d, tile, count, out);
  }
}

// Paged decode attention of one query per sequence (interface.KernelBackend.decode_attention):
// q, out T [batch, num_heads, head_dim] contiguous (T float or bf16 bits); block_tables int32
// [batch, bt_stride]; seq_lens int64 [batch]; window < 0: none. Tasks (sequence, KV head) over threads.
template <class T>
void decode_attention(const T* q, const KvRows& k, const KvRows& v, const int32_t* block_tables, int64_t bt_stride,
                      const int64_t* seq_lens, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t tokens_per_block, float scale, int64_t window, int64_t sink, T* out,
                      int num_threads) {
  const int64_t group = num_heads / num_kv_heads, d = head_dim;
#pragma omp parallel num_threads(num_threads)
  {
    AttentionScratch s;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < batch * num_kv_heads; ++task) {
      const int64_t b = task / num_kv_heads, kvh = task % num_kv_heads, at = (b * num_heads + kvh * group) * d;
      visible_rows(seq_lens[b], window, sink, block_tables + b * bt_stride, tokens_per_block, num_kv_heads, kvh,
                   s.keys);
      const float* qf;
      float* acc;
      if constexpr (std::is_same_v<T, float>) {
        qf = q + at, acc = out + at;
      } else {
        s.q.resize(group * d);
        s.acc.resize(group * d);
        for (int64_t i = 0; i < group * d; ++i) s.q[i] = load1_f32(q + at + i);
        qf = s.q.data(), acc = s.acc.data();
      }
      attend_rows(qf, group, d, k, v, s.keys, scale, s, acc);
      if constexpr (!std::is_same_v<T, float>)
        for (int64_t i = 0; i < group * d; ++i) store1(out + at + i, acc[i]);
    }
  }
}

}  // namespace bm
