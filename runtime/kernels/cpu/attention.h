// Attention family of the native CPU layer: one paged decode attention over a KV format's row
// reader. A KV row is one (slot, KV head) of a cache [num_blocks, tpb, kv_heads, head_dim]:
// row = slot * kv_heads + head, its values at cache + row * head_dim.
// KV formats (formats.h's KvFormat; runtime/kernels/kv_quant.py defines the int8 one): float32;
//   bf16 (rounded to nearest even); int8 with a float32 scale per row (scale = max|x| / 127,
//   q = round-half-even(x / scale), read as q * scale).
// The per-op decode attention (ops.cpp) and the fused step (decode_step.cpp) both call
// attend_rows, so they compute the same numbers.
#pragma once

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

  // Row `row` as float32: the cache's own memory (float32) or `buffer` [head_dim] holding it converted.
  const float* read(int64_t row, float* buffer) const {
    const int64_t d = head_dim;
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

// The keys a decode query at position len - 1 attends to: all, or the last `window` plus the
// first `sink` (window < 0: no window).
inline void visible_keys(int64_t len, int64_t window, int64_t sink, std::vector<int64_t>& keys) {
  const int64_t qpos = len - 1;
  keys.clear();
  for (int64_t j = 0; j < len; ++j)
    if (window < 0 || j > qpos - window || j < sink) keys.push_back(j);
}

// The rows of KV head kvh that a sequence's decode query reads: its visible keys through its block table.
inline void visible_rows(int64_t len, int64_t window, int64_t sink, const int32_t* table, int64_t tpb,
                         int64_t num_kv_heads, int64_t kvh, std::vector<int64_t>& rows) {
  visible_keys(len, window, sink, rows);
  for (int64_t& j : rows) j = ((int64_t)table[j / tpb] * tpb + j % tpb) * num_kv_heads + kvh;
}

struct AttentionScratch {
  std::vector<float> q, acc, row, scores;
  std::vector<int64_t> keys;
};

// The `group` query heads q [group, d] (float32) sharing one KV head over its rows `keys`:
// out [group, d] = softmax(q k^T * scale) v, scores and sums in float32.
BM_ONE_COPY void attend_rows(const float* q, int64_t group, int64_t d, const KvRows& k, const KvRows& v,
                             const std::vector<int64_t>& keys, float scale, AttentionScratch& s, float* out) {
  const int64_t n = (int64_t)keys.size();
  s.scores.resize(group * n);
  s.row.resize(d);
  float* scores = s.scores.data();
  for (int64_t i = 0; i < n; ++i) {
    const float* kr = k.read(keys[i], s.row.data());
    for (int64_t g = 0; g < group; ++g) scores[g * n + i] = dot(q + g * d, kr, d) * scale;
  }
  for (int64_t g = 0; g < group; ++g) softmax(scores + g * n, n);
  std::fill_n(out, group * d, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    const float* vr = v.read(keys[i], s.row.data());
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * n + i];
      float* __restrict o = out + g * d;
#pragma omp simd
      for (int64_t t = 0; t < d; ++t) o[t] += p * vr[t];
    }
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
