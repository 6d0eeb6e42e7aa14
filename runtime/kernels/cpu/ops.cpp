// The per-op entry points of the native CPU layer (the eager path's ctypes calls: cpu_native.py,
// cpu_native_bf16.py, cpu_weight_only.py, act_quant.py), each a thin parallel driver over the op
// families' functions that the fused step (decode_step.cpp) calls too. OpenMP regions run on the
// process's OpenMP runtime: loaded after torch, `libgomp.so.1` resolves to the copy torch already
// loaded, so these kernels share torch's thread pool instead of adding a second one on the same cores.
//
// Contracts (every pointer float32 unless noted; rows are contiguous along their last dimension;
// bf16 pointers are uint16_t, the upper half of a float32's bits):
//   bm_linear:  y[r, o] (+)= sum_k x[r, k] * w[o, k] (+ bias[o]);  x [rows, k] row stride ldx,
//               w [n, k] contiguous (the checkpoint's own layout), y [rows, n] row stride ldy.
//   bm_linear_bf16[_avx2]: as bm_linear with w bf16 [n, k] contiguous; x float32 or bf16 (x_bf16),
//               y float32 or bf16 (y_bf16), bias float32 [n] or null (linear_float.h). `_avx2`
//               always widens by shifting; the plain entry uses AVX512-BF16's dot product where
//               compiled for it (x bf16).
//   bm_rms_norm[_bf16]: y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w;  x, y [rows, h]
//               strides ldx, ldy (norm_activation.h's rms_norm_row).
//   bm_silu_mul[_bf16]: y[r, i] = silu(x[r, i]) * x[r, n + i] for i < n;  x [rows, 2n] stride ldx,
//               y [rows, n] contiguous (silu_mul_range).
//   bm_decode_attention[_int8, _bf16]: one query per sequence over the paged cache, as
//               interface.KernelBackend.decode_attention: q, out [B, H, D] contiguous (bf16 for
//               _bf16); k_cache, v_cache [num_blocks, tpb, kvH, D] contiguous in the KV format
//               (attention.h); _int8: k_scales, v_scales float32 [num_blocks, tpb, kvH];
//               block_tables int32 [B, bt_stride]; seq_lens int64 [B]; window < 0 means none.
//   bm_dense_attention: causal attention of a context step over contiguous keys and values
//               (attention_dense.h): q [n, H, D] token stride ldq, k and v [total, kvH, D] strides
//               ldk and ldv, out [n, H, D] stride ldo; query i at position past + i = total - n + i.
//   bm_token_bitmask: logits[rows[i], v] = -inf where bit v % 32 of bitmask[i, v / 32] is clear.
//   bm_greedy: interface.KernelBackend.greedy over logits [rows, vocab] row stride ld: tokens int64
//               [rows], log_probs [rows] (torch_decoder.greedy is the reference).
//   bm_wo_*: the weight-only linears: the GEMV ranges (linear_weight_only.h) below
//               bm_wo::kGemmMinRows rows, the fused de-quantize-and-multiply GEMM
//               (linear_weight_only_gemm.h) from there.
//   bm_aq_*: the int8-activation linears (linear_act_quant.h).
//   isa arguments: a bm::Isa cap (isa.h); each family runs its best tier at or below it.
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "attention.h"
#include "attention_dense.h"
#include "isa.h"
#include "linear_act_quant.h"
#include "linear_float.h"
#include "linear_weight_only.h"
#include "linear_weight_only_gemm.h"
#include "norm_activation.h"
#include "vec.h"

// The tiers compiled in and supported here (isa.h; isa.py reads it).
extern "C" int bm_isa_mask() { return bm::isa_mask(); }

// ---- float32 and bf16: linear, RMSNorm, silu * up, decode attention ----

extern "C" void bm_linear(const float* x, int64_t rows, int64_t ldx, const float* w, int64_t n, int64_t k,
                          const float* bias, float* y, int64_t ldy, int accumulate, int num_threads) {
  using bm_float::kOutputsPerUnit;
  const int64_t units = (n + kOutputsPerUnit - 1) / kOutputsPerUnit;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t u = 0; u < units; ++u)
    bm_float::linear_rows_range(x, rows, ldx, w, u * kOutputsPerUnit, std::min(n, (u + 1) * kOutputsPerUnit), k,
                                bias, y, ldy, accumulate);
}

extern "C" int bm_bf16_has_dot_product() { return bm_float::kHasDpbf16 ? 1 : 0; }

#define BM_LINEAR_BF16_ARGS                                                                                 \
  const void *x, int x_bf16, int64_t rows, int64_t ldx, const uint16_t *w, int64_t n, int64_t k,           \
      const float *bias, void *y, int y_bf16, int64_t ldy, int accumulate, int num_threads
#define BM_LINEAR_BF16_STRUCT {x, x_bf16 != 0, rows, ldx, w, n, k, bias, y, y_bf16 != 0, ldy, accumulate}

extern "C" void bm_linear_bf16(BM_LINEAR_BF16_ARGS) {
  const bm_float::Bf16LinearArgs a BM_LINEAR_BF16_STRUCT;
  if (bm_float::kHasDpbf16 && a.x_bf16) bm_float::linear_bf16<true>(a, num_threads);
  else bm_float::linear_bf16<false>(a, num_threads);
}

extern "C" void bm_linear_bf16_avx2(BM_LINEAR_BF16_ARGS) {
  const bm_float::Bf16LinearArgs a BM_LINEAR_BF16_STRUCT;
  bm_float::linear_bf16<false>(a, num_threads);
}

template <class T>
static void rms_norm(const T* x, int64_t rows, int64_t ldx, int64_t h, const T* w, float eps, T* y, int64_t ldy,
                     int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * h >= 65536)
  for (int64_t r = 0; r < rows; ++r) bm::rms_norm_row(x + r * ldx, h, w, eps, y + r * ldy);
}

template <class T>
static void silu_mul(const T* x, int64_t rows, int64_t ldx, int64_t n, T* y, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * n >= 65536)
  for (int64_t r = 0; r < rows; ++r) bm::silu_mul_range(x + r * ldx, x + r * ldx + n, y + r * n, 0, n);
}

extern "C" void bm_rms_norm(const float* x, int64_t rows, int64_t ldx, int64_t h, const float* w, float eps,
                            float* y, int64_t ldy, int num_threads) {
  rms_norm(x, rows, ldx, h, w, eps, y, ldy, num_threads);
}

extern "C" void bm_rms_norm_bf16(const uint16_t* x, int64_t rows, int64_t ldx, int64_t h, const uint16_t* w,
                                 float eps, uint16_t* y, int64_t ldy, int num_threads) {
  rms_norm(x, rows, ldx, h, w, eps, y, ldy, num_threads);
}

extern "C" void bm_silu_mul(const float* x, int64_t rows, int64_t ldx, int64_t n, float* y, int num_threads) {
  silu_mul(x, rows, ldx, n, y, num_threads);
}

extern "C" void bm_silu_mul_bf16(const uint16_t* x, int64_t rows, int64_t ldx, int64_t n, uint16_t* y,
                                 int num_threads) {
  silu_mul(x, rows, ldx, n, y, num_threads);
}

#define BM_DECODE_TAIL                                                                                       \
  const int32_t *block_tables, int64_t bt_stride, const int64_t *seq_lens, int64_t batch, int64_t num_heads, \
      int64_t num_kv_heads, int64_t head_dim, int64_t tokens_per_block, float scale, int64_t window,         \
      int64_t sink
#define BM_DECODE_CALL                                                                                        \
  block_tables, bt_stride, seq_lens, batch, num_heads, num_kv_heads, head_dim, tokens_per_block, scale, window, \
      sink

extern "C" void bm_decode_attention(const float* q, const float* k_cache, const float* v_cache, BM_DECODE_TAIL,
                                    float* out, int num_threads) {
  const bm::KvRows k{bm::kKvFloat32, (void*)k_cache, nullptr, head_dim}, v{bm::kKvFloat32, (void*)v_cache, nullptr,
                                                                            head_dim};
  bm::decode_attention(q, k, v, BM_DECODE_CALL, out, num_threads);
}

extern "C" void bm_decode_attention_int8(const float* q, const int8_t* k_cache, const int8_t* v_cache,
                                         const float* k_scales, const float* v_scales, BM_DECODE_TAIL, float* out,
                                         int num_threads) {
  const bm::KvRows k{bm::kKvInt8, (void*)k_cache, (float*)k_scales, head_dim};
  const bm::KvRows v{bm::kKvInt8, (void*)v_cache, (float*)v_scales, head_dim};
  bm::decode_attention(q, k, v, BM_DECODE_CALL, out, num_threads);
}

extern "C" void bm_decode_attention_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                                         BM_DECODE_TAIL, uint16_t* out, int num_threads) {
  const bm::KvRows k{bm::kKvBf16, (void*)k_cache, nullptr, head_dim}, v{bm::kKvBf16, (void*)v_cache, nullptr,
                                                                         head_dim};
  bm::decode_attention(q, k, v, BM_DECODE_CALL, out, num_threads);
}

extern "C" void bm_dense_attention(const float* q, int64_t ldq, const float* k, int64_t ldk, const float* v,
                                   int64_t ldv, float* out, int64_t ldo, int64_t n, int64_t total, int64_t heads,
                                   int64_t kv_heads, int64_t head_dim, float scale, int num_threads) {
  bm::dense_attention({q, ldq, k, ldk, v, ldv, out, ldo, n, total, total - n, heads, kv_heads, head_dim, scale},
                      num_threads);
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

// Greedy selection, torch_decoder.greedy's semantics in two passes over a row: the token is the first
// maximum (a row holding a NaN: its first NaN, as torch.argmax; +inf: its first +inf), its log
// probability x[t] - (log(sum_v exp(x[v] - max)) + max) (torch.logsumexp's order; NaN where the row
// holds a NaN or +inf); a row with no logit above -inf (all -inf or NaN): no_token, -inf. The exp is
// vec.h's exp8, summed in double (torch's exp and float sum differ in the last bits: log probs
// agree to ~1e-6, tokens exactly).
extern "C" void bm_greedy(const float* logits, int64_t rows, int64_t vocab, int64_t ld, int64_t no_token,
                          int64_t* tokens, float* log_probs, int num_threads) {
  const float inf = __builtin_inff();
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 8)
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits + r * ld;
    __m256 top8 = _mm256_set1_ps(-inf), nan8 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= vocab; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      top8 = _mm256_max_ps(v, top8);   // a NaN v gives the second operand: NaNs never enter the max
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, top8);
    float top = *std::max_element(lanes, lanes + 8);
    bool has_nan = _mm256_movemask_ps(nan8) != 0;
    for (; i < vocab; ++i) {
      if (x[i] != x[i]) has_nan = true;
      else top = std::max(top, x[i]);
    }
    if (!(top > -inf)) {
      tokens[r] = no_token, log_probs[r] = -inf;
      continue;
    }
    if (has_nan || top == inf) {
      int64_t token = 0;
      if (has_nan) while (x[token] == x[token]) ++token;
      else while (x[token] != inf) ++token;
      tokens[r] = token, log_probs[r] = __builtin_nanf("");
      continue;
    }
    const __m256 shift = _mm256_set1_ps(top), floor = _mm256_set1_ps(-88.3762626647949f);
    __m256d sum4 = _mm256_setzero_pd();   // double: a float32 sum of 49152 terms would lose ~1e-5
    for (i = 0; i + 8 <= vocab; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i), d = _mm256_sub_ps(v, shift);
      const __m256 e = _mm256_and_ps(bm::exp8(d), _mm256_cmp_ps(d, floor, _CMP_GE_OQ));
      sum4 = _mm256_add_pd(sum4, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(e)),
                                               _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1))));
    }
    double parts[4];
    _mm256_storeu_pd(parts, sum4);
    double total = (parts[0] + parts[1]) + (parts[2] + parts[3]);
    for (; i < vocab; ++i) total += expf(x[i] - top);
    const float sum = (float)total;
    for (i = 0; i + 8 <= vocab; i += 8) {
      const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), shift, _CMP_EQ_OQ));
      if (mask) break;
    }
    while (x[i] != top) ++i;
    tokens[r] = i, log_probs[r] = x[i] - (logf(sum) + top);
  }
}

// ---- weight-only int8 / int4 ----

extern "C" void bm_wo_int8_linear(const float* x, int64_t rows, int64_t ldx, const int8_t* w, const float* scale,
                                  int64_t n, int64_t k, const float* bias, float* y, int64_t ldy, int accumulate,
                                  int num_threads, int isa) {
  const bm_wo::Int8Args a{x, ldx, w, scale, n, k, bias, y, ldy, accumulate};
  if (rows >= bm_wo::kGemmMinRows) bm_wo::gemm(a, rows, isa, num_threads);
  else bm_wo::parallel_linear<bm_wo::Int8Args, bm_wo::Int8K>(a, rows, isa, num_threads);
}

extern "C" void bm_wo_int4_linear(const float* x, int64_t rows, int64_t ldx, const uint8_t* w, const uint16_t* scale,
                                  const uint16_t* min, int64_t n, int64_t k, int64_t gs, const float* bias, float* y,
                                  int64_t ldy, int accumulate, int num_threads, int isa) {
  const bm_wo::Int4Args a{x, ldx, w, scale, min, n, k, gs, bias, y, ldy, accumulate};
  if (rows >= bm_wo::kGemmMinRows) bm_wo::gemm(a, rows, isa, num_threads);
  else bm_wo::parallel_linear<bm_wo::Int4Args, bm_wo::Int4K>(a, rows, isa, num_threads);
}

// ---- int8 activations ----

extern "C" void bm_aq_quantize(const float* x, int64_t rows, int64_t k, int8_t* q, float* d, int32_t* s) {
  bm_aq::quantize_rows(x, rows, k, q, d, s);
}

// x float32 [rows, k] contiguous -> y (row stride ldy); each thread a contiguous range of units.
extern "C" void bm_aq_linear(const bm_aq::ActLinear* w, const float* x, int64_t rows, float* y, int64_t ldy,
                             int accumulate, int num_threads, int isa) {
  const int64_t k = w->k, blocks = k / bm_aq::kBlock, units = (w->n + bm_aq::kActUnit - 1) / bm_aq::kActUnit;
  std::vector<int8_t> q(rows * k);
  std::vector<float> d(rows * blocks);
  std::vector<int32_t> s(rows * blocks);
  const bool by_threads = bm_blk::quantize_by_threads(rows, k);
  if (!by_threads) bm_aq::quantize_rows(x, rows, k, q.data(), d.data(), s.data());
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>(num_threads, units));
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    if (by_threads) {   // the same branch on every thread
      bm_blk::quantize_share(bm::kInputQ8x32, x, rows, k, k, q.data(), d.data(), s.data(), t, nt);
#pragma omp barrier
    }
    const int64_t u0 = units * t / nt, u1 = units * (t + 1) / nt;
    if (u0 < u1)
      bm_aq::act_linear_range(*w, q.data(), d.data(), s.data(), rows, k, y, ldy, accumulate, u0 * bm_aq::kActUnit,
                              std::min(w->n, u1 * bm_aq::kActUnit), isa);
  }
}
