// Attention family of the native CPU layer: one paged decode attention over a KV format's row
// reader (a context step's causal attention over contiguous keys: attention_dense.h). A KV row is
// one (slot, KV head) of a cache [num_blocks, tpb, kv_heads, head_dim]: row = slot * kv_heads +
// head, its values at cache + row * head_dim.
// KV formats (formats.h's KvFormat; runtime/kernels/kv_quant.py defines the int8 one): float32;
//   bf16 (rounded to nearest even); int8 with a float32 scale per row (scale = max|x| / 127,
//   q = round-half-even(x / scale), read as q * scale).
// The per-op decode attention (ops.cpp) and the fused step (decode_step.cpp) both call
// attend_chunk and combine_chunks over the same chunks (ChunkPlan), so they compute the same
// numbers. Its dot products and V sums are AVX2 + FMA
// intrinsics without a lower tier, as the weights' exp8 (vec.h) is: the library builds only for
// AVX2 / FMA CPUs (library.cpu_supported), and the ISA cap (isa.h) selects the linear tiers only.
#pragma once

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <atomic>
#include <memory>
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

  int64_t row_bytes() const { return head_dim * (format == kKvFloat32 ? 4 : format == kKvBf16 ? 2 : 1); }

  // Every 64-byte line of `count` consecutive rows from `row` loaded once into `sink` (a plain
  // streaming read; see attend_chunk_as for why not a prefetch). Integer adds: the bytes may be any
  // format's, and a float add of a denormal pattern can stall.
  void touch(int64_t row, int64_t count, __m256i& sink) const {
    const int64_t bytes = count * row_bytes();
    const char* p = (const char*)cache + row * row_bytes();
    for (int64_t b = 0; b + 32 <= bytes; b += 64)
      sink = _mm256_add_epi32(sink, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + b)));
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
  int64_t count() const { return sinks + len - recent; }
};

inline KeySpans visible_keys(int64_t len, int64_t window, int64_t sink) {
  if (window < 0) return {0, 0, len};
  const int64_t sinks = std::min(std::max(sink, (int64_t)0), len);
  return {sinks, std::max(len - window, sinks), len};
}

// The cache slots (block * tpb + offset) of visible keys [from, to) (in position order) through
// the block table: one division per block, none per key.
inline void visible_slots(const KeySpans& spans, int64_t from, int64_t to, const int32_t* table, int64_t tpb,
                          std::vector<int64_t>& slots) {
  slots.resize(to - from);
  int64_t* out = slots.data();
  for (const auto& [first, last] : {std::pair{(int64_t)0, spans.sinks}, std::pair{spans.recent, spans.len}}) {
    // this span's positions whose visible index lies in [from, to)
    const int64_t base = first == 0 ? 0 : spans.sinks - spans.recent;   // visible index = position + base
    const int64_t p0 = std::max(first, from - base), p1 = std::min(last, to - base);
    for (int64_t j = p0, block = p0 / tpb; j < p1; ++block) {
      const int64_t shift = ((int64_t)table[block] - block) * tpb, stop = std::min(p1, (block + 1) * tpb);
      for (; j < stop; ++j) *out++ = shift + j;
    }
  }
}

// A sequence's visible keys are attended in chunks (flash-decoding's split over the keys): each
// chunk's partial result is its own task, and the last chunk to finish combines them. The chunk
// size depends on the number of visible keys only, never on the thread count or the batch, so every
// path and any number of threads compute the same numbers. Up to kMinChunkKeys keys are one chunk;
// more go in an even number of chunks (so that one sequence splits evenly over 2 threads) of about
// kTargetChunkKeys keys (32-64), at most kMaxKeyChunks, each a multiple of kChunkKeyUnit keys
// (whole key tiles) but the last. Each task starts its K and V reads cold and pays its fixed work:
// with chunks of 16 keys (the rule before) SmolLM2's int8 + a8 step of 4 and 8 sequences of 64-144
// keys was 1.06-1.13x slower than with this rule (AMD EPYC Zen 4, 2 threads, one process); chunks
// of about 64 keys with no even count made 1 sequence up to 1.05x slower and 8 no faster.
constexpr int64_t kMaxKeyChunks = 8, kMinChunkKeys = 16, kTargetChunkKeys = 64, kChunkKeyUnit = 8;

inline int64_t chunk_keys(int64_t n) {
  if (n <= kMinChunkKeys) return kMinChunkKeys;
  const int64_t pairs = (n + 2 * kTargetChunkKeys - 1) / (2 * kTargetChunkKeys);
  const int64_t chunks = std::min(kMaxKeyChunks, 2 * pairs), per = (n + chunks - 1) / chunks;
  return (per + kChunkKeyUnit - 1) / kChunkKeyUnit * kChunkKeyUnit;
}

inline int64_t num_key_chunks(int64_t n) { return std::max<int64_t>(1, (n + chunk_keys(n) - 1) / chunk_keys(n)); }

// A chunk's partial result for all query heads: float [num_heads * (head_dim + 2)], the weighted
// sums of V [num_heads, head_dim] (weights exp(score - max), not normalised), then the heads'
// maximum scores [num_heads], then their sums of weights [num_heads].
inline int64_t partial_size(int64_t num_heads, int64_t head_dim) { return num_heads * (head_dim + 2); }

struct AttentionScratch {
  std::vector<float> q, scores, lanes, tails, k_new;
  std::vector<int64_t> slots;
};

// Keys per tile of attend_chunk's score pass (one sum8x8 per head and tile), keys per tile of its
// value pass (one load and store of the accumulators per tile), keys per burst of touch reads
// (attend_chunk_as), and the most V bytes a chunk may read with its K rows before the score pass
// (they must still be in L2 at the value pass).
constexpr int64_t kKeyTile = 8, kValueTile = 16, kTouchKeys = 64, kMaxEarlyValueBytes = 256 << 10;
static_assert(kTouchKeys % kKeyTile == 0 && kTouchKeys % kValueTile == 0,
              "each pass starts a run of touched keys on one of its tiles");

// A KV row as attend_chunk reads it: 8 values at a time converted to float32 in registers, as
// KvRows' format stores them (bf16: widened; int8: q * its row's scale, one multiply).
struct F32Row {
  const float* p;
  __m256 load8(int64_t c) const { return _mm256_loadu_ps(p + c); }
  float at(int64_t c) const { return p[c]; }
};
struct Bf16Row {
  const uint16_t* p;
  __m256 load8(int64_t c) const { return load8_f32(p + c); }
  float at(int64_t c) const { return bf16_to_f32(p[c]); }
};
struct Int8Row {
  const int8_t* p;
  float scale;
  __m256 load8(int64_t c) const {
    const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + c)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(scale));
  }
  float at(int64_t c) const { return (float)p[c] * scale; }
};

template <class R>
inline R kv_row(const KvRows& kv, int64_t row) {
  if constexpr (std::is_same_v<R, F32Row>) return {(const float*)kv.cache + row * kv.head_dim};
  else if constexpr (std::is_same_v<R, Bf16Row>) return {(const uint16_t*)kv.cache + row * kv.head_dim};
  else return {(const int8_t*)kv.cache + row * kv.head_dim, kv.scales[row]};
}

// The 8 lanes of each of a[0..7] summed: lane t of the result = the sum of a[t]'s lanes (a pairwise
// tree: adjacent lanes, then pairs, then the two 128-bit halves).
inline __m256 sum8x8(const float* lanes) {   // a[t] = lanes[8 t, 8 t + 8)
  __m256 a[8];
  for (int t = 0; t < 8; ++t) a[t] = _mm256_loadu_ps(lanes + 8 * t);
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// The functions below take the group (query heads per KV head) as a template constant G for the
// common 1-8, so their per-head accumulators and weights stay in registers and the head loops
// unroll, or G = 0 for any group at run time: the same operations in the same order either way.
template <int G>
inline int64_t group_of(int64_t group) { return G ? G : group; }

// q[g] . x[j] for the group's query heads q [group, d] over `keys` key rows x (1 or 2), each row read
// once for all of them and each q chunk loaded once for both rows (2 rows: 2 x up to 4 accumulators
// per q load, where one row had one FMA per q load and the K pass ran load-bound):
// lanes[(g * kKeyTile + j) * 8, + 8) = one 8-lane accumulator per head and row over the 8-column
// chunks (summed later by sum8x8), tails[g * kKeyTile + j] += the columns past the last multiple
// of 8. Each (head, row) score adds the same products in the same order whatever `keys` is.
template <int G = 0, int keys = 1, class R>
inline void dot_rows(const float* q, int64_t group_rt, const R* x, int64_t d, float* lanes, float* tails) {
  const int64_t group = group_of<G>(group_rt), d8 = d & ~(int64_t)7;
  for (int64_t g0 = 0; g0 < group; g0 += 4) {
    const int64_t gs = std::min<int64_t>(4, group - g0);
    __m256 a[4][keys];
    for (int64_t g = 0; g < 4; ++g)
      for (int j = 0; j < keys; ++j) a[g][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d8; c += 8) {
      __m256 v[keys];
      for (int j = 0; j < keys; ++j) v[j] = x[j].load8(c);
      for (int64_t g = 0; g < gs; ++g) {
        const __m256 qg = _mm256_loadu_ps(q + (g0 + g) * d + c);
        for (int j = 0; j < keys; ++j) a[g][j] = _mm256_fmadd_ps(qg, v[j], a[g][j]);
      }
    }
    for (int64_t g = 0; g < gs; ++g)
      for (int j = 0; j < keys; ++j) _mm256_storeu_ps(lanes + ((g0 + g) * kKeyTile + j) * 8, a[g][j]);
    for (int64_t c = d8; c < d; ++c)
      for (int64_t g = 0; g < gs; ++g)
        for (int j = 0; j < keys; ++j) tails[(g0 + g) * kKeyTile + j] += q[(g0 + g) * d + c] * x[j].at(c);
  }
}

// acc[g] += sum over the tile's keys t of w[g * stride + t] * values[t] for the group's heads (acc
// [group, d]), key by key in key order, one fused multiply-add per value: the accumulators of up to
// 4 heads x 16 columns stay in registers over the tile (one load and store per tile, not per key),
// each value chunk converted once for those heads.
template <int G = 0, class R>
inline void accumulate_values(const R* values, int64_t count, const float* w, int64_t stride, int64_t group_rt,
                              int64_t d, float* acc) {
  const int64_t group = group_of<G>(group_rt), d8 = d & ~(int64_t)7;
  for (int64_t g0 = 0; g0 < group; g0 += 4) {
    const int64_t gs = std::min<int64_t>(4, group - g0);
    for (int64_t c = 0; c < d8; c += 16) {
      const bool two = c + 8 < d8;   // a second 8-column chunk in this step
      __m256 a[4][2];
      for (int64_t g = 0; g < gs; ++g) {
        a[g][0] = _mm256_loadu_ps(acc + (g0 + g) * d + c);
        a[g][1] = two ? _mm256_loadu_ps(acc + (g0 + g) * d + c + 8) : _mm256_setzero_ps();
      }
      for (int64_t t = 0; t < count; ++t) {
        const __m256 x0 = values[t].load8(c), x1 = two ? values[t].load8(c + 8) : _mm256_setzero_ps();
        for (int64_t g = 0; g < gs; ++g) {
          const __m256 p = _mm256_broadcast_ss(w + (g0 + g) * stride + t);
          a[g][0] = _mm256_fmadd_ps(p, x0, a[g][0]);
          if (two) a[g][1] = _mm256_fmadd_ps(p, x1, a[g][1]);
        }
      }
      for (int64_t g = 0; g < gs; ++g) {
        _mm256_storeu_ps(acc + (g0 + g) * d + c, a[g][0]);
        if (two) _mm256_storeu_ps(acc + (g0 + g) * d + c + 8, a[g][1]);
      }
    }
  }
  for (int64_t t = 0; t < count; ++t)
    for (int64_t c = d8; c < d; ++c) {
      const float x = values[t].at(c);
      for (int64_t g = 0; g < group; ++g) acc[g * d + c] = fmaf(w[g * stride + t], x, acc[g * d + c]);
    }
}

template <class R, int G>
inline void attend_chunk_as(const float* q, int64_t num_heads, int64_t num_kv_heads, int64_t d, const KvRows& k,
                            const KvRows& v, const int64_t* slots, int64_t n, float scale, AttentionScratch& s,
                            float* partial) {
  const int64_t group = group_of<G>(num_heads / num_kv_heads), d8 = d & ~(int64_t)7;
  const int64_t stride = (n + kKeyTile - 1) / kKeyTile * kKeyTile;
  float* acc = partial;
  float* top = partial + num_heads * d;
  float* sums = top + num_heads;
  std::fill_n(acc, num_heads * d, 0.f);
  std::fill_n(top, num_heads, -INFINITY);
  std::fill_n(sums, num_heads, 0.f);
  s.scores.resize(num_heads * stride);
  s.lanes.resize(num_heads * kKeyTile * 8);
  s.tails.resize(num_heads * kKeyTile);   // zeroed per tile when used
  float* w = s.scores.data();       // [num_heads, stride]: the chunk's scores, then their weights
  float* lanes = s.lanes.data();    // [num_heads, 8 keys, 8 lanes]: each score's partial sums
  float* tails = s.tails.data();    // [num_heads, 8]: each score's columns past the last multiple of 8
  // Memory: the cache rows are cold (the weight stream evicted them). Each run of kTouchKeys keys is
  // first read in one burst of plain loads (KvRows::touch), its K rows and, where the chunk's V rows
  // fit kMaxEarlyValueBytes, its V rows with them (two streams); else each run's V rows are read so
  // before the value pass. The passes then read L1 and L2: the passes' own loads, behind their FMA
  // chains, kept too few misses in flight. One thread, chunks of 64 SmolLM2 keys (9 heads, 3 KV
  // heads of 64) each from a new place in a 256 MiB cache, AMD EPYC Zen 4, ns per key: these bursts
  // 101-118; software prefetches 16 keys ahead (the code before) 186-213 in the same run, and in
  // another as slow at distances 8 to 64 as with none; the reads alone 53-77, the passes on
  // cached rows 52-55.
  const bool early_values = n * num_kv_heads * v.row_bytes() <= kMaxEarlyValueBytes;
  __m256i sink = _mm256_setzero_si256();
  // 1. scores, 8 keys at a time, each K row read once for its group's heads
  for (int64_t i = 0; i < n; i += kKeyTile) {
    const int64_t count = std::min(kKeyTile, n - i);
    if (i % kTouchKeys == 0)
      for (int64_t j = i; j < std::min(n, i + kTouchKeys); ++j) {
        k.touch(slots[j] * num_kv_heads, num_kv_heads, sink);
        if (early_values) v.touch(slots[j] * num_kv_heads, num_kv_heads, sink);
      }
    if (d8 < d) std::fill_n(tails, num_heads * kKeyTile, 0.f);
    int64_t t = 0;
    for (; t + 2 <= count; t += 2)
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const R x[2] = {kv_row<R>(k, slots[i + t] * num_kv_heads + h),
                        kv_row<R>(k, slots[i + t + 1] * num_kv_heads + h)};
        dot_rows<G, 2>(q + h * group * d, group, x, d, lanes + (h * group * kKeyTile + t) * 8,
                       tails + h * group * kKeyTile + t);
      }
    for (; t < count; ++t)
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const R x = kv_row<R>(k, slots[i + t] * num_kv_heads + h);
        dot_rows<G, 1>(q + h * group * d, group, &x, d, lanes + (h * group * kKeyTile + t) * 8,
                       tails + h * group * kKeyTile + t);
      }
    for (int64_t t = count; t < kKeyTile; ++t)   // past the chunk's last key: lanes the live mask drops
      for (int64_t hq = 0; hq < num_heads; ++hq) std::fill_n(lanes + (hq * kKeyTile + t) * 8, 8, 0.f);
    for (int64_t hq = 0; hq < num_heads; ++hq) {
      __m256 sums8 = sum8x8(lanes + hq * kKeyTile * 8);
      if (d8 < d) sums8 = _mm256_add_ps(sums8, _mm256_loadu_ps(tails + hq * kKeyTile));
      _mm256_storeu_ps(w + hq * stride + i, _mm256_mul_ps(sums8, _mm256_set1_ps(scale)));
    }
  }
  // 2. per head: the chunk's maximum score, then the weights exp(score - maximum) and their sum
  for (int64_t hq = 0; hq < num_heads; ++hq) {
    const SoftmaxRow row = softmax_row(w + hq * stride, n, stride);
    top[hq] = row.maximum, sums[hq] = row.sum;
  }
  // 3. the weighted sums of V, kValueTile keys at a time, each V row read once for its group's heads
  R rows[kValueTile];
  for (int64_t i = 0; i < n; i += kValueTile) {
    const int64_t count = std::min(kValueTile, n - i);
    if (!early_values && i % kTouchKeys == 0)
      for (int64_t j = i; j < std::min(n, i + kTouchKeys); ++j)
        v.touch(slots[j] * num_kv_heads, num_kv_heads, sink);
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t t = 0; t < count; ++t) rows[t] = kv_row<R>(v, slots[i + t] * num_kv_heads + h);
      accumulate_values<G>(rows, count, w + h * group * stride + i, stride, group, d, acc + h * group * d);
    }
  }
  asm volatile("" : : "x"(sink));   // the touch loads are kept for their effect on the caches
}

// attend_chunk_as with the group as a template constant where it is 1-8 (else at run time).
template <class R>
inline void attend_chunk_of(const float* q, int64_t num_heads, int64_t num_kv_heads, int64_t d, const KvRows& k,
                            const KvRows& v, const int64_t* slots, int64_t n, float scale, AttentionScratch& s,
                            float* partial) {
  switch (num_heads / num_kv_heads) {
#define BM_GROUP(G) \
  case G:           \
    return attend_chunk_as<R, G>(q, num_heads, num_kv_heads, d, k, v, slots, n, scale, s, partial);
    BM_GROUP(1) BM_GROUP(2) BM_GROUP(3) BM_GROUP(4) BM_GROUP(5) BM_GROUP(6) BM_GROUP(7) BM_GROUP(8)
#undef BM_GROUP
    default:
      return attend_chunk_as<R, 0>(q, num_heads, num_kv_heads, d, k, v, slots, n, scale, s, partial);
  }
}

// One chunk of a sequence's visible keys (their cache slots [n]) for all its query heads q
// [num_heads, d] (float32; query head h reads KV head h / group): the chunk's partial result (see
// partial_size), in three passes: every key's score, then per head the chunk's maximum score and the
// weights exp(score - maximum), then the weighted sums of V. Memory is read in the cache's own
// order: a slot's KV heads are consecutive rows, so each slot's keys (then its values) are one
// contiguous run, read slot after slot (reading 8 slots' rows head by head instead ran at a third of
// the bandwidth on the machine measured). bf16 and int8 rows are converted 8 values at a time in
// registers (F32Row, Bf16Row, Int8Row), each key and value row once for the group's heads; k and v
// are in one format.
// Rounding: a score is one 8-lane accumulator over the 8-column chunks (dot_rows), its lanes summed
// by sum8x8's pairwise tree, plus the columns past the last multiple of 8 summed one by one, times
// scale; a head's weights and their sum are softmax_row's (norm_activation.h) over the chunk's
// scores; the V sums add key by key in key order, one fused multiply-add per value.
BM_ONE_COPY void attend_chunk(const float* q, int64_t num_heads, int64_t num_kv_heads, int64_t d, const KvRows& k,
                              const KvRows& v, const int64_t* slots, int64_t n, float scale, AttentionScratch& s,
                              float* partial) {
  switch (k.format) {
    case kKvFloat32:
      return attend_chunk_of<F32Row>(q, num_heads, num_kv_heads, d, k, v, slots, n, scale, s, partial);
    case kKvBf16:
      return attend_chunk_of<Bf16Row>(q, num_heads, num_kv_heads, d, k, v, slots, n, scale, s, partial);
    default:
      return attend_chunk_of<Int8Row>(q, num_heads, num_kv_heads, d, k, v, slots, n, scale, s, partial);
  }
}

// out [num_heads, d] = the chunks' partial results (num_chunks <= kMaxKeyChunks) combined: per query
// head, each chunk's weighted sum times exp(its max - the overall max) / the total weight, added
// chunk by chunk in order (one fused multiply-add per chunk and value).
template <class T>
BM_ONE_COPY void combine_chunks(const float* partials, int64_t num_chunks, int64_t num_heads, int64_t d, T* out) {
  const int64_t size = partial_size(num_heads, d);
  for (int64_t hq = 0; hq < num_heads; ++hq) {
    float top = -INFINITY, total = 0.f;
    for (int64_t c = 0; c < num_chunks; ++c) top = std::max(top, partials[c * size + num_heads * d + hq]);
    for (int64_t c = 0; c < num_chunks; ++c) {
      const float* p = partials + c * size + num_heads * d;
      total += expf(p[hq] - top) * p[num_heads + hq];
    }
    float weight[kMaxKeyChunks];
    for (int64_t c = 0; c < num_chunks; ++c) weight[c] = expf(partials[c * size + num_heads * d + hq] - top) / total;
    for (int64_t i = 0; i < d; ++i) {
      float o = 0.f;
      for (int64_t c = 0; c < num_chunks; ++c) o = fmaf(weight[c], partials[c * size + hq * d + i], o);
      store1(out + hq * d + i, o);
    }
  }
}

// The attention tasks of a batch of decode queries: (sequence, key chunk) pairs, and where each
// sequence's partial results start. Built once per call, before the threads split the tasks.
struct ChunkPlan {
  std::vector<int64_t> first_task;   // [batch + 1]: sequence b's tasks are [first_task[b], first_task[b + 1])
  std::vector<int64_t> task_sequence;
  std::vector<int64_t> first_key;    // [num_tasks + 1]: task t's keys, counted over the batch, start here
  std::unique_ptr<std::atomic<int64_t>[]> done;   // [batch]: chunks finished

  ChunkPlan(const int64_t* seq_lens, int64_t batch, int64_t window, int64_t sink)
      : first_task(batch + 1, 0), first_key(1, 0), done(new std::atomic<int64_t>[batch]) {
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t n = visible_keys(seq_lens[b], window, sink).count();
      const int64_t chunks = num_key_chunks(n), per = chunk_keys(n);
      first_task[b + 1] = first_task[b] + chunks;
      task_sequence.insert(task_sequence.end(), chunks, b);
      for (int64_t c = 0; c < chunks; ++c) first_key.push_back(first_key.back() + std::min(per, n - c * per));
      done[b].store(0, std::memory_order_relaxed);
    }
  }
  int64_t num_tasks() const { return first_task.back(); }
  // Thread `thread` of `num_threads`'s tasks [begin, end): the consecutive tasks whose first key falls
  // in its equal share of the batch's keys, so each thread's keys are within one chunk's of that
  // share at either end. Static and consecutive: a sequence's chunks mostly stay on one thread, and
  // no task is claimed through an atomic.
  void thread_tasks(int thread, int num_threads, int64_t& begin, int64_t& end) const {
    const int64_t total = first_key.back();
    const auto first_at = [&](int64_t share) {   // the first task with first key * num_threads >= total * share
      int64_t t = 0;
      while (t < num_tasks() && first_key[t] * num_threads < total * share) ++t;
      return t;
    };
    begin = first_at(thread), end = thread + 1 == num_threads ? num_tasks() : first_at(thread + 1);
  }
  void reset() {
    for (int64_t b = 0; b + 1 < (int64_t)first_task.size(); ++b) done[b].store(0, std::memory_order_relaxed);
  }
  // Task `task`'s chunk of its sequence's visible keys [from, to).
  void keys(int64_t task, const int64_t* seq_lens, int64_t window, int64_t sink, KeySpans& spans, int64_t& from,
            int64_t& to) const {
    const int64_t b = task_sequence[task], c = task - first_task[b];
    spans = visible_keys(seq_lens[b], window, sink);
    const int64_t n = spans.count(), per = chunk_keys(n);
    from = std::min(n, c * per), to = std::min(n, from + per);
  }
  // Marks task's chunk done; true for the last of its sequence to finish (which then combines: the
  // acquire-release count makes the other chunks' partial results visible to it).
  bool finish(int64_t task) {
    const int64_t b = task_sequence[task];
    return done[b].fetch_add(1, std::memory_order_acq_rel) + 1 == first_task[b + 1] - first_task[b];
  }
};

// Paged decode attention of one query per sequence (interface.KernelBackend.decode_attention):
// q, out T [batch, num_heads, head_dim] contiguous (T float or bf16 bits); block_tables int32
// [batch, bt_stride]; seq_lens int64 [batch]; window < 0: none. Tasks (sequence, key chunk) over threads.
template <class T>
void decode_attention(const T* q, const KvRows& k, const KvRows& v, const int32_t* block_tables, int64_t bt_stride,
                      const int64_t* seq_lens, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t tokens_per_block, float scale, int64_t window, int64_t sink, T* out,
                      int num_threads) {
  const int64_t d = head_dim, size = partial_size(num_heads, d);
  ChunkPlan plan(seq_lens, batch, window, sink);
  std::vector<float> partials(plan.num_tasks() * size);
#pragma omp parallel num_threads(num_threads)
  {
    AttentionScratch s;
    int64_t begin, end;
    plan.thread_tasks(omp_get_thread_num(), omp_get_num_threads(), begin, end);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = plan.task_sequence[task];
      KeySpans spans;
      int64_t from, to;
      plan.keys(task, seq_lens, window, sink, spans, from, to);
      visible_slots(spans, from, to, block_tables + b * bt_stride, tokens_per_block, s.slots);
      s.q.resize(num_heads * d);
      for (int64_t i = 0; i < num_heads * d; ++i) s.q[i] = load1_f32(q + b * num_heads * d + i);
      attend_chunk(s.q.data(), num_heads, num_kv_heads, d, k, v, s.slots.data(), to - from, scale, s,
                   partials.data() + task * size);
      if (plan.finish(task))
        combine_chunks(partials.data() + plan.first_task[b] * size, plan.first_task[b + 1] - plan.first_task[b],
                       num_heads, d, out + b * num_heads * d);
    }
  }
}

}  // namespace bm
