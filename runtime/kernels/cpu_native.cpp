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
      const int64_t len = seq_lens[b], qpos = len - 1;
      keys.clear();
      for (int64_t j = 0; j < len; ++j)
        if (window < 0 || j > qpos - window || j < sink) keys.push_back(j);
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
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * n;
        float m = -INFINITY, total = 0.f;
        for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
        for (int64_t i = 0; i < n; ++i) total += (s[i] = expf(s[i] - m));
        const float inv = 1.f / total;
        for (int64_t i = 0; i < n; ++i) s[i] *= inv;
        float* o = out + (b * num_heads + kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = 0.f;
      }
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
