// Norm and activation family of the native CPU layer: the one RMSNorm, the one silu(gate) * up
// (each written once for float32 and bf16 rows) and the one softmax of a row (T: float or uint16_t bf16 bits; arithmetic in
// float32). The per-op entry points (ops.cpp) and the fused step (decode_step.cpp)
// call these same functions, so the eager native path and the fused step compute the same numbers.
// NOTE: functions with a `#pragma omp simd` reduction are BM_ONE_COPY: one out-of-line copy in the
// library, so the compiler cannot vectorise (and so sum) them differently at two call sites.
#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <algorithm>

#include "vec.h"

namespace bm {

// y = x * rsqrt(mean(x^2) + eps) * w over one row of h values (sum of squares and scaling in float32,
// one rounding when y is bf16).
template <class T, class W>
BM_ONE_COPY void rms_norm_row(const T* x, int64_t h, const W* w, float eps, T* y) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < h; ++i) sum += load1_f32(x + i) * load1_f32(x + i);
  const float inv = 1.f / sqrtf(sum / (float)h + eps);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) store1(y + i, load1_f32(x + i) * inv * load1_f32(w + i));
}

// out[i] = silu(gate[i]) * up[i] for i in [n0, n1): 8 at a time with the polynomial exp8 (relative
// error ~1e-7; libm's expf, one call per element, cost ~1.5 ms per fused step at 4 rows).
template <class T>
inline void silu_mul_range(const T* gate, const T* up, T* out, int64_t n0, int64_t n1) {
  int64_t i = n0;
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n1; i += 8) {
    const __m256 g = load8_f32(gate + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    store8(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), load8_f32(up + i)));
  }
  for (; i < n1; ++i) {
    const float g = load1_f32(gate + i);
    store1(out + i, g / (1.f + expf(-g)) * load1_f32(up + i));
  }
}

// Softmax weights of row s[0, visible) in place, not normalised: exp(s - the row's maximum), zeros
// in [visible, width); returns that maximum and the weights' sum (a vector sum of the whole 8-lane
// chunks, hsum8, then the tail's weights one by one). Decode attention's key chunks
// (attention.h) and the context step's rows (attention_dense.h) both take their weights here.
struct SoftmaxRow {
  float maximum, sum;
};

inline SoftmaxRow softmax_row(float* s, int64_t visible, int64_t width) {
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= visible; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
  float lanes[8];
  _mm256_storeu_ps(lanes, mv);
  float m = *std::max_element(lanes, lanes + 8);
  for (; j < visible; ++j) m = std::max(m, s[j]);
  const __m256 mb = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (j = 0; j + 8 <= visible; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mb));
    _mm256_storeu_ps(s + j, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = hsum8(sv);
  if (j < visible) {   // the tail through a masked vector: the same exp8 for every key
    float tail[8] = {};
    for (int64_t t = j; t < visible; ++t) tail[t - j] = s[t] - m;
    float e[8];
    _mm256_storeu_ps(e, exp8(_mm256_loadu_ps(tail)));
    for (int64_t t = j; t < visible; ++t) s[t] = e[t - j], sum += e[t - j];
  }
  std::fill(s + visible, s + width, 0.f);
  return {m, sum};
}

}  // namespace bm
