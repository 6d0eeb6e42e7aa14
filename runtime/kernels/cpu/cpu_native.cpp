// Native CPU kernels of the generation path (float32, AVX2 + FMA), built at run time by
// cpu_native.py and called through ctypes. OpenMP regions run on the process's OpenMP runtime:
// loaded after torch, `libgomp.so.1` resolves to the copy torch already loaded, so these kernels
// share torch's thread pool instead of adding a second one on the same cores.
//
// Contracts (every pointer float32 unless noted; rows are contiguous along their last dimension):
//   bm_linear:  y[r, o] (+)= sum_k x[r, k] * w[o, k] (+ bias[o]);  x [rows, k] row stride ldx,
//               w [n, k] contiguous (the checkpoint's own layout), y [rows, n] row stride ldy.
//   bm_rms_norm: y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w;  x, y [rows, h] strides ldx, ldy.
//   bm_silu_mul: y[r, i] = silu(x[r, i]) * x[r, n + i] for i < n;  x [rows, 2n] stride ldx, y [rows, n] contiguous.
//   bm_decode_attention: one query per sequence over the paged cache, as
//               interface.KernelBackend.decode_attention: q, out [B, H, D] contiguous; k_cache,
//               v_cache [num_blocks, tpb, kvH, D] contiguous; block_tables int32 [B, bt_stride];
//               seq_lens int64 [B]; window < 0 means none. Scratch: one float per key and head.
//   bm_decode_attention_int8: the same over an int8 cache (runtime/kernels/kv_quant.py): k_cache,
//               v_cache int8, k_scales, v_scales float32 [num_blocks, tpb, kvH]; a key reads as
//               k * its scale; float32 accumulation.
//   bm_shm_all_reduce: the sum over the `size` processes of one host of their data[n], through a
//               shared region (see the function); returns 0, 1 (timed out) or 2 (a peer exited).
#include <errno.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <vector>

namespace {

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R rows x O outputs of bm_linear: R * O accumulators over k, each x vector loaded once for O
// FMAs, each weight vector once for R. The next tile's weight rows are prefetched one cache line
// per 16 floats: a tile streams O short runs of the weight, too short for the hardware prefetcher.
template <int R, int O>
inline void linear_tile(const float* x, int64_t ldx, const float* w, int64_t k, const float* bias, float* y,
                        int64_t ldy, int accumulate, bool prefetch) {
  __m256 acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = _mm256_setzero_ps();
  int64_t kk = 0;
  for (; kk + 8 <= k; kk += 8) {
    __m256 wv[O];
    for (int o = 0; o < O; ++o) wv[o] = _mm256_loadu_ps(w + o * k + kk);
    if (prefetch && (kk & 15) == 0)
      for (int o = 0; o < O; ++o) _mm_prefetch((const char*)(w + (O + o) * k + kk), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      __m256 xv = _mm256_loadu_ps(x + r * ldx + kk);
      asm("" : "+x"(xv));  // NOTE: keeps xv in a register; folded into each FMA it is loaded O times
      for (int o = 0; o < O; ++o) acc[r][o] = _mm256_fmadd_ps(xv, wv[o], acc[r][o]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) {
      float s = hsum8(acc[r][o]);
      for (int64_t t = kk; t < k; ++t) s += x[r * ldx + t] * w[o * k + t];
      if (bias) s += bias[o];
      float* dst = y + r * ldy + o;
      *dst = accumulate ? *dst + s : s;
    }
}

// Outputs [n0, n1) for every row: per tile of O outputs, all rows (tiles of 4, then the rest), so
// the tile's weight rows come from memory once and stay in L1 for the later row tiles while the
// prefetches of the next tile are in flight. O: 8, 4, 3 outputs for 1, 2, 3 rows; 3 from 4 rows
// (12 accumulators; measured 1.07-1.10x over 2 at 8 rows, and over row tiles outermost).
template <int O>
void linear_outputs(const float* x, int64_t rows, int64_t ldx, const float* w, int64_t o, int64_t k,
                    const float* bias, float* y, int64_t ldy, int accumulate, bool prefetch) {
  const float* wo = w + o * k;
  const float* bo = bias ? bias + o : nullptr;
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4)
    linear_tile<4, O>(x + r * ldx, ldx, wo, k, bo, y + r * ldy + o, ldy, accumulate, prefetch && r == 0);
  const float* xr = x + r * ldx;
  float* yr = y + r * ldy + o;
  switch (rows - r) {
    case 3: linear_tile<3, O>(xr, ldx, wo, k, bo, yr, ldy, accumulate, prefetch && r == 0); break;
    case 2: linear_tile<2, O>(xr, ldx, wo, k, bo, yr, ldy, accumulate, prefetch && r == 0); break;
    case 1: linear_tile<1, O>(xr, ldx, wo, k, bo, yr, ldy, accumulate, prefetch && r == 0); break;
    default: break;
  }
}

template <int O>
void linear_range(const float* x, int64_t rows, int64_t ldx, const float* w, int64_t n0, int64_t n1, int64_t k,
                  const float* bias, float* y, int64_t ldy, int accumulate) {
  int64_t o = n0;
  for (; o + O <= n1; o += O) linear_outputs<O>(x, rows, ldx, w, o, k, bias, y, ldy, accumulate, o + 2 * O <= n1);
  for (; o < n1; ++o) linear_outputs<1>(x, rows, ldx, w, o, k, bias, y, ldy, accumulate, false);
}

constexpr int64_t kOutputsPerUnit = 48;  // a multiple of every tile's O; the unit of thread work

// The keys a decode query at position len - 1 attends to: all, or the last `window` plus the
// first `sink` (window < 0: no window). Shared by the decode-attention kernels of every cache dtype.
inline void visible_keys(int64_t len, int64_t window, int64_t sink, std::vector<int64_t>& keys) {
  const int64_t qpos = len - 1;
  keys.clear();
  for (int64_t j = 0; j < len; ++j)
    if (window < 0 || j > qpos - window || j < sink) keys.push_back(j);
}

// Softmax, in place, of each of `group` rows of n scores (row g at scores + g * n).
inline void softmax_rows(float* scores, int64_t group, int64_t n) {
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * n;
    float m = -INFINITY, total = 0.f;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
    for (int64_t i = 0; i < n; ++i) total += (s[i] = expf(s[i] - m));
    const float inv = 1.f / total;
    for (int64_t i = 0; i < n; ++i) s[i] *= inv;
  }
}

}  // namespace

extern "C" void bm_linear(const float* x, int64_t rows, int64_t ldx, const float* w, int64_t n, int64_t k,
                          const float* bias, float* y, int64_t ldy, int accumulate, int num_threads) {
  const int64_t units = (n + kOutputsPerUnit - 1) / kOutputsPerUnit;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t n0 = u * kOutputsPerUnit, n1 = std::min(n, n0 + kOutputsPerUnit);
    switch (rows) {
      case 1: linear_range<8>(x, rows, ldx, w, n0, n1, k, bias, y, ldy, accumulate); break;
      case 2: linear_range<4>(x, rows, ldx, w, n0, n1, k, bias, y, ldy, accumulate); break;
      default: linear_range<3>(x, rows, ldx, w, n0, n1, k, bias, y, ldy, accumulate); break;  // 3 rows and more
    }
  }
}

extern "C" void bm_rms_norm(const float* x, int64_t rows, int64_t ldx, int64_t h, const float* w, float eps,
                            float* y, int64_t ldy, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * h >= 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    float* yr = y + r * ldy;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < h; ++i) sum += xr[i] * xr[i];
    const float inv = 1.f / sqrtf(sum / (float)h + eps);
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) yr[i] = xr[i] * inv * w[i];
  }
}

extern "C" void bm_silu_mul(const float* x, int64_t rows, int64_t ldx, int64_t n, float* y, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * n >= 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = x + r * ldx;
    const float* up = gate + n;
    float* yr = y + r * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) yr[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
  }
}

// Guided decoding: logits[rows[i], v] = -inf where bit v % 32 of bitmask[i, v / 32] is clear
// (llguidance's packed layout; torch_decoder.apply_token_bitmask is the reference).
extern "C" void bm_token_bitmask(float* logits, const int64_t* rows, const int32_t* bitmask, int64_t n,
                                 int64_t words, int64_t vocab, int64_t row_stride, int num_threads) {
  const float neg_inf = -__builtin_inff();
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n * vocab >= 262144)
  for (int64_t i = 0; i < n; ++i) {
    float* x = logits + rows[i] * row_stride;
    const uint32_t* mask = reinterpret_cast<const uint32_t*>(bitmask + i * words);
    for (int64_t w = 0; w * 32 < vocab; ++w) {
      const uint32_t bits = mask[w];
      if (bits == 0xffffffffu) continue;   // every token of this word allowed
      const int64_t end = std::min<int64_t>(32, vocab - w * 32);
      for (int64_t b = 0; b < end; ++b) {
        if (!((bits >> b) & 1u)) x[w * 32 + b] = neg_inf;
      }
    }
  }
}

extern "C" void bm_decode_attention(const float* q, const float* k_cache, const float* v_cache,
                                    const int32_t* block_tables, int64_t bt_stride, const int64_t* seq_lens,
                                    int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                    int64_t tokens_per_block, float scale, int64_t window, int64_t sink,
                                    float* out, int num_threads) {
  const int64_t group = num_heads / num_kv_heads;  // query heads per kv head
  const int64_t token_stride = num_kv_heads * head_dim;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores;  // [group, keys] of this thread's current (sequence, kv head)
    std::vector<int64_t> keys;  // visible key positions
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < batch * num_kv_heads; ++task) {
      const int64_t b = task / num_kv_heads, kvh = task % num_kv_heads;
      visible_keys(seq_lens[b], window, sink, keys);
      const int64_t n = (int64_t)keys.size();
      scores.resize(group * n);
      const int32_t* table = block_tables + b * bt_stride;
      const float* qh = q + (b * num_heads + kvh * group) * head_dim;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t j = keys[i];
        const float* kv = k_cache + ((int64_t)table[j / tokens_per_block] * tokens_per_block + j % tokens_per_block)
                                        * token_stride + kvh * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qh + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * kv[d];
          scores[g * n + i] = dot * scale;
        }
      }
      softmax_rows(scores.data(), group, n);
      std::fill_n(out + (b * num_heads + kvh * group) * head_dim, group * head_dim, 0.f);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t j = keys[i];
        const float* vv = v_cache + ((int64_t)table[j / tokens_per_block] * tokens_per_block + j % tokens_per_block)
                                        * token_stride + kvh * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          float* o = out + (b * num_heads + kvh * group + g) * head_dim;
          const float p = scores[g * n + i];
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) o[d] += p * vv[d];
        }
      }
    }
  }
}

extern "C" void bm_decode_attention_int8(const float* q, const int8_t* k_cache, const int8_t* v_cache,
                                         const float* k_scales, const float* v_scales,
                                         const int32_t* block_tables, int64_t bt_stride, const int64_t* seq_lens,
                                         int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                         int64_t tokens_per_block, float scale, int64_t window, int64_t sink,
                                         float* out, int num_threads) {
  const int64_t group = num_heads / num_kv_heads;  // query heads per kv head
  const int64_t token_stride = num_kv_heads * head_dim;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores;  // [group, keys] of this thread's current (sequence, kv head)
    std::vector<int64_t> rows;  // each visible key's row: slot * num_kv_heads + kv head
    std::vector<float> row;     // one de-quantized K or V row
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < batch * num_kv_heads; ++task) {
      const int64_t b = task / num_kv_heads, kvh = task % num_kv_heads;
      const int32_t* table = block_tables + b * bt_stride;
      visible_keys(seq_lens[b], window, sink, rows);
      for (int64_t& j : rows)   // key position -> its row: slot * num_kv_heads + kv head
        j = ((int64_t)table[j / tokens_per_block] * tokens_per_block + j % tokens_per_block) * num_kv_heads + kvh;
      const int64_t n = (int64_t)rows.size();
      scores.resize(group * n);
      row.resize(head_dim);
      const float* qh = q + (b * num_heads + kvh * group) * head_dim;
      for (int64_t i = 0; i < n; ++i) {
        const int8_t* kv = k_cache + rows[i] / num_kv_heads * token_stride + kvh * head_dim;
        const float ks = k_scales[rows[i]];
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) row[d] = (float)kv[d] * ks;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qh + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * row[d];
          scores[g * n + i] = dot * scale;
        }
      }
      softmax_rows(scores.data(), group, n);
      std::fill_n(out + (b * num_heads + kvh * group) * head_dim, group * head_dim, 0.f);
      for (int64_t i = 0; i < n; ++i) {
        const int8_t* vv = v_cache + rows[i] / num_kv_heads * token_stride + kvh * head_dim;
        const float vs = v_scales[rows[i]];
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) row[d] = (float)vv[d] * vs;
        for (int64_t g = 0; g < group; ++g) {
          float* o = out + (b * num_heads + kvh * group + g) * head_dim;
          const float p = scores[g * n + i];
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) o[d] += p * row[d];
        }
      }
    }
  }
}

// Shared-memory all-reduce among the ranks of one host (tensor parallelism on CPUs, where gloo's
// loopback TCP costs ~0.3 ms per small all-reduce). Region layout: `size` control lines of 64
// bytes (int64 sequence number posted, int64 pid), then two phases of `size` slots of `capacity`
// floats. Call s (s = 1, 2, ...) uses phase s % 2: copy data into the rank's slot, post s, wait
// until every peer posted s, then sum the slots in rank order (so every rank gets the same bits).
// Two phases make it safe: a peer posts s - 1 only after reading the slots of call s - 2, and a
// rank starts call s only after seeing every peer post s - 1. Waiting spins briefly, then yields,
// then sleeps 20 us at a time (an idle wait costs little CPU); every ~10 ms of sleeping it checks
// that the peers' processes still exist. n <= capacity.
// With `gathered` non-null the call is a gather instead: gathered[r * ld + i] = rank r's data[i]
// (data unchanged); ranks that pass null only contribute.
extern "C" int bm_shm_all_reduce(float* data, int64_t n, char* region, int64_t capacity, int rank, int size,
                                 int64_t seq, int64_t timeout_ns, float* gathered, int64_t ld) {
  auto posted = [&](int r) { return reinterpret_cast<std::atomic<int64_t>*>(region + 64 * r); };
  auto pid = [&](int r) { return reinterpret_cast<int64_t*>(region + 64 * r + 8); };
  float* slots = reinterpret_cast<float*>(region + 64 * size) + (seq & 1) * size * capacity;
  memcpy(slots + rank * capacity, data, n * sizeof(float));
  posted(rank)->store(seq, std::memory_order_release);
  timespec start, now;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    for (int64_t polls = 0; posted(r)->load(std::memory_order_acquire) < seq; ++polls) {
      if (polls < 4000) {
        _mm_pause();
        continue;
      }
      if (polls < 8000) {
        sched_yield();
        continue;
      }
      timespec nap = {0, 20000};
      nanosleep(&nap, nullptr);
      if (polls % 500 == 0) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        int64_t waited = (now.tv_sec - start.tv_sec) * 1000000000LL + (now.tv_nsec - start.tv_nsec);
        if (waited > timeout_ns) return 1;
        if (kill(static_cast<pid_t>(*pid(r)), 0) != 0 && errno == ESRCH) return 2;
      }
    }
  }
  if (gathered != nullptr) {
    for (int r = 0; r < size; ++r) memcpy(gathered + r * ld, slots + r * capacity, n * sizeof(float));
    return 0;
  }
  const float* first = slots;
  for (int64_t i = 0; i < n; ++i) {
    float sum = first[i];
    for (int r = 1; r < size; ++r) sum += slots[r * capacity + i];
    data[i] = sum;
  }
  return 0;
}

// ---- bfloat16 kernels (bf16 storage, float32 accumulation) ----
// Contracts (bf16 pointers are uint16_t: the upper half of a float32's bits):
//   bm_linear_bf16[_avx2]: as bm_linear with w bf16 [n, k] contiguous; x float32 or bf16 (x_bf16),
//               y float32 or bf16 (y_bf16), bias float32 [n] or null; sums in float32, rounded to
//               nearest even once when y is bf16. `_avx2` always converts by shifting (8-wide
//               FMA); the plain entry uses AVX512-BF16's dot product where compiled for it
//               (__AVX512BF16__, x bf16), else the same shifting path.
//   bm_rms_norm_bf16: as bm_rms_norm with x, w, y bf16; sum of squares and scaling in float32.
//   bm_silu_mul_bf16: as bm_silu_mul with x, y bf16; computed in float32 (exp: an 8-wide polynomial).
//   bm_decode_attention_bf16[_avx2]: as bm_decode_attention with q, caches and out bf16; scores,
//               softmax and the weighted sum of values in float32. The plain entry takes q.k with
//               AVX512-BF16 where compiled for it and head_dim % 32 == 0.
#include <type_traits>

namespace {

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

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kHasDpbf16 = true;
inline __m512bh load32_bf16(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load32_bf16(const uint16_t* p, __mmask32 m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }

// R x O dot products of length k with AVX512-BF16: 32 bf16 pairs per instruction into 16 float lanes.
template <int R, int O>
inline void dot_tile_dp(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k, float s[R][O], bool prefetch) {
  __m512 acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = _mm512_setzero_ps();
  int64_t kk = 0;
  for (; kk + 32 <= k; kk += 32) {
    __m512bh wv[O];
    for (int o = 0; o < O; ++o) wv[o] = load32_bf16(w + o * k + kk);
    if (prefetch)
      for (int o = 0; o < O; ++o) _mm_prefetch((const char*)(w + (O + o) * k + kk), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      __m512bh xv = load32_bf16(x + r * ldx + kk);
      for (int o = 0; o < O; ++o) acc[r][o] = _mm512_dpbf16_ps(acc[r][o], xv, wv[o]);
    }
  }
  if (kk < k) {
    const __mmask32 m = _cvtu32_mask32((1u << (k - kk)) - 1u);
    __m512bh wv[O];
    for (int o = 0; o < O; ++o) wv[o] = load32_bf16(w + o * k + kk, m);
    for (int r = 0; r < R; ++r) {
      __m512bh xv = load32_bf16(x + r * ldx + kk, m);
      for (int o = 0; o < O; ++o) acc[r][o] = _mm512_dpbf16_ps(acc[r][o], xv, wv[o]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) s[r][o] = _mm512_reduce_add_ps(acc[r][o]);
}
#else
constexpr bool kHasDpbf16 = false;
#endif

// R x O dot products of length k, bf16 weights widened by a 16-bit shift, 8-wide FMA (AVX2).
template <typename X, int R, int O>
inline void dot_tile_avx2(const X* x, int64_t ldx, const uint16_t* w, int64_t k, float s[R][O], bool prefetch) {
  __m256 acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = _mm256_setzero_ps();
  int64_t kk = 0;
  for (; kk + 8 <= k; kk += 8) {
    __m256 wv[O];
    for (int o = 0; o < O; ++o) wv[o] = load8_f32(w + o * k + kk);
    if (prefetch && (kk & 31) == 0)
      for (int o = 0; o < O; ++o) _mm_prefetch((const char*)(w + (O + o) * k + kk), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      __m256 xv = load8_f32(x + r * ldx + kk);
      for (int o = 0; o < O; ++o) acc[r][o] = _mm256_fmadd_ps(xv, wv[o], acc[r][o]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) {
      float t = hsum8(acc[r][o]);
      for (int64_t j = kk; j < k; ++j) t += load1_f32(x + r * ldx + j) * bf16_to_f32(w[o * k + j]);
      s[r][o] = t;
    }
}

struct Bf16LinearArgs {
  const void* x;
  bool x_bf16;
  int64_t rows, ldx;
  const uint16_t* w;
  int64_t n, k;
  const float* bias;
  void* y;
  bool y_bf16;
  int64_t ldy;
  int accumulate;
};

template <bool kDp, int R, int O>
inline void linear_bf16_tile(const Bf16LinearArgs& a, int64_t r0, int64_t o0, bool prefetch) {
  float s[R][O];
  const uint16_t* w = a.w + o0 * a.k;
  if constexpr (kDp && kHasDpbf16) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    dot_tile_dp<R, O>(static_cast<const uint16_t*>(a.x) + r0 * a.ldx, a.ldx, w, a.k, s, prefetch);
#endif
  } else if (a.x_bf16) {
    dot_tile_avx2<uint16_t, R, O>(static_cast<const uint16_t*>(a.x) + r0 * a.ldx, a.ldx, w, a.k, s, prefetch);
  } else {
    dot_tile_avx2<float, R, O>(static_cast<const float*>(a.x) + r0 * a.ldx, a.ldx, w, a.k, s, prefetch);
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) {
      float v = s[r][o] + (a.bias ? a.bias[o0 + o] : 0.f);
      const int64_t at = (r0 + r) * a.ldy + o0 + o;
      if (a.y_bf16) {
        uint16_t* dst = static_cast<uint16_t*>(a.y) + at;
        *dst = f32_to_bf16(a.accumulate ? bf16_to_f32(*dst) + v : v);
      } else {
        float* dst = static_cast<float*>(a.y) + at;
        *dst = a.accumulate ? *dst + v : v;
      }
    }
}

// Outputs [o0, o0 + O) for every row, row tiles of 4 then the rest (as linear_outputs).
template <bool kDp, int O>
void linear_bf16_outputs(const Bf16LinearArgs& a, int64_t o0, bool prefetch) {
  int64_t r = 0;
  for (; r + 4 <= a.rows; r += 4) linear_bf16_tile<kDp, 4, O>(a, r, o0, prefetch && r == 0);
  switch (a.rows - r) {
    case 3: linear_bf16_tile<kDp, 3, O>(a, r, o0, prefetch && r == 0); break;
    case 2: linear_bf16_tile<kDp, 2, O>(a, r, o0, prefetch && r == 0); break;
    case 1: linear_bf16_tile<kDp, 1, O>(a, r, o0, prefetch && r == 0); break;
    default: break;
  }
}

template <bool kDp, int O>
void linear_bf16_range(const Bf16LinearArgs& a, int64_t n0, int64_t n1) {
  int64_t o = n0;
  for (; o + O <= n1; o += O) linear_bf16_outputs<kDp, O>(a, o, o + 2 * O <= n1);
  for (; o < n1; ++o) linear_bf16_outputs<kDp, 1>(a, o, false);
}

template <bool kDp>
void linear_bf16(const Bf16LinearArgs& a, int num_threads) {
  const int64_t units = (a.n + kOutputsPerUnit - 1) / kOutputsPerUnit;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t n0 = u * kOutputsPerUnit, n1 = std::min(a.n, n0 + kOutputsPerUnit);
    switch (a.rows) {
      case 1: linear_bf16_range<kDp, 8>(a, n0, n1); break;
      case 2: linear_bf16_range<kDp, 4>(a, n0, n1); break;
      default:
        if (kDp) linear_bf16_range<kDp, 4>(a, n0, n1);  // 16 accumulators of 32 zmm registers
        else linear_bf16_range<kDp, 3>(a, n0, n1);
        break;
    }
  }
}

// q.k over head_dim: AVX512-BF16 pairs (kDp, d % 32 == 0) or widened floats.
template <bool kDp>
inline float qk_dot(const uint16_t* q, const float* qf, const uint16_t* k, int64_t d) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (kDp && d % 32 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 32) acc = _mm512_dpbf16_ps(acc, load32_bf16(q + i), load32_bf16(k + i));
    return _mm512_reduce_add_ps(acc);
  }
#endif
  (void)q;
  float dot = 0.f;
#pragma omp simd reduction(+ : dot)
  for (int64_t i = 0; i < d; ++i) dot += qf[i] * bf16_to_f32(k[i]);
  return dot;
}

template <bool kDp>
void decode_attention_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                           const int32_t* block_tables, int64_t bt_stride, const int64_t* seq_lens, int64_t batch,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t tokens_per_block,
                           float scale, int64_t window, int64_t sink, uint16_t* out, int num_threads) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores, qf, acc;  // [group, keys], [group, D] queries and outputs in float32
    std::vector<int64_t> keys;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < batch * num_kv_heads; ++task) {
      const int64_t b = task / num_kv_heads, kvh = task % num_kv_heads;
      visible_keys(seq_lens[b], window, sink, keys);
      const int64_t n = (int64_t)keys.size();
      scores.resize(group * n);
      qf.resize(group * head_dim);
      acc.assign(group * head_dim, 0.f);
      const int32_t* table = block_tables + b * bt_stride;
      const uint16_t* qh = q + (b * num_heads + kvh * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = bf16_to_f32(qh[i]);
      auto token = [&](const uint16_t* cache, int64_t j) {
        return cache + ((int64_t)table[j / tokens_per_block] * tokens_per_block + j % tokens_per_block) * token_stride
               + kvh * head_dim;
      };
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t* kv = token(k_cache, keys[i]);
        for (int64_t g = 0; g < group; ++g)
          scores[g * n + i] = qk_dot<kDp>(qh + g * head_dim, qf.data() + g * head_dim, kv, head_dim) * scale;
      }
      softmax_rows(scores.data(), group, n);
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t* vv = token(v_cache, keys[i]);
        for (int64_t g = 0; g < group; ++g) {
          float* o = acc.data() + g * head_dim;
          const float p = scores[g * n + i];
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) o[d] += p * bf16_to_f32(vv[d]);
        }
      }
      uint16_t* o = out + (b * num_heads + kvh * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) o[i] = f32_to_bf16(acc[i]);
    }
  }
}

}  // namespace

extern "C" int bm_bf16_has_dot_product() { return kHasDpbf16 ? 1 : 0; }

#define BM_LINEAR_BF16_ARGS                                                                                 \
  const void *x, int x_bf16, int64_t rows, int64_t ldx, const uint16_t *w, int64_t n, int64_t k,           \
      const float *bias, void *y, int y_bf16, int64_t ldy, int accumulate, int num_threads
#define BM_LINEAR_BF16_STRUCT {x, x_bf16 != 0, rows, ldx, w, n, k, bias, y, y_bf16 != 0, ldy, accumulate}

extern "C" void bm_linear_bf16(BM_LINEAR_BF16_ARGS) {
  const Bf16LinearArgs a BM_LINEAR_BF16_STRUCT;
  if (kHasDpbf16 && a.x_bf16) linear_bf16<true>(a, num_threads);
  else linear_bf16<false>(a, num_threads);
}

extern "C" void bm_linear_bf16_avx2(BM_LINEAR_BF16_ARGS) {
  const Bf16LinearArgs a BM_LINEAR_BF16_STRUCT;
  linear_bf16<false>(a, num_threads);
}

extern "C" void bm_rms_norm_bf16(const uint16_t* x, int64_t rows, int64_t ldx, int64_t h, const uint16_t* w,
                                 float eps, uint16_t* y, int64_t ldy, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * h >= 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* xr = x + r * ldx;
    uint16_t* yr = y + r * ldy;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < h; ++i) sum += bf16_to_f32(xr[i]) * bf16_to_f32(xr[i]);
    const float inv = 1.f / sqrtf(sum / (float)h + eps);
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) yr[i] = f32_to_bf16(bf16_to_f32(xr[i]) * inv * bf16_to_f32(w[i]));
  }
}

namespace {

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

}  // namespace

extern "C" void bm_silu_mul_bf16(const uint16_t* x, int64_t rows, int64_t ldx, int64_t n, uint16_t* y,
                                 int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * n >= 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* gate = x + r * ldx;
    const uint16_t* up = gate + n;
    uint16_t* yr = y + r * n;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 g = load8_f32(gate + i);
      const __m256 exp_neg = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
      const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp_neg));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(yr + i), bf16x8(_mm256_mul_ps(silu, load8_f32(up + i))));
    }
    for (; i < n; ++i) {
      const float g = bf16_to_f32(gate[i]);
      yr[i] = f32_to_bf16(g / (1.f + expf(-g)) * bf16_to_f32(up[i]));
    }
  }
}

#define BM_DECODE_BF16_ARGS                                                                                 \
  const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *block_tables,        \
      int64_t bt_stride, const int64_t *seq_lens, int64_t batch, int64_t num_heads, int64_t num_kv_heads,   \
      int64_t head_dim, int64_t tokens_per_block, float scale, int64_t window, int64_t sink, uint16_t *out, \
      int num_threads
#define BM_DECODE_BF16_CALL                                                                                  \
  (q, k_cache, v_cache, block_tables, bt_stride, seq_lens, batch, num_heads, num_kv_heads, head_dim,        \
   tokens_per_block, scale, window, sink, out, num_threads)

extern "C" void bm_decode_attention_bf16(BM_DECODE_BF16_ARGS) { decode_attention_bf16<true> BM_DECODE_BF16_CALL; }
extern "C" void bm_decode_attention_bf16_avx2(BM_DECODE_BF16_ARGS) { decode_attention_bf16<false> BM_DECODE_BF16_CALL; }
