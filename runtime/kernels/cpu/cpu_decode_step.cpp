// The generation step of a LLaMA-family model as one native call (cpu_decode_step.py builds it,
// compiled as one translation unit after cpu_native.cpp, cpu_weight_only.cpp and cpu_act_quant.cpp,
// whose kernels it calls from the namespaces bm_native, bm_wo and bm_aq). One OpenMP parallel region runs every layer:
//
//   per layer:  RMSNorm (each thread its own copy: no barrier) -> QKV GEMV (outputs split over
//               threads) | barrier | per (sequence, KV head): rotary, the KV-cache write, paged
//               decode attention | barrier | out-projection GEMV added into the residual |
//               barrier | RMSNorm -> gate and up GEMV over the same outputs, silu(gate) * up |
//               barrier | down GEMV added into the residual | barrier
//   then:       final RMSNorm -> lm_head GEMV -> logits
//
// so a step costs 5 barriers per layer instead of ~15 Python-dispatched ops. Activations stay
// float32 throughout (the weight-only kernels' contract); bf16 weights are read by the bf16 kernel
// (with AVX512-BF16 the inputs are rounded to bf16 first, as the eager bf16 model's are).
//
// Contracts:
//   x: float32 [rows, hidden], the embeddings in, the last layer's residual stream out.
//   positions, slots, seq_lens int64 [rows]: each sequence's one new token's position, its cache
//       slot (block * tokens_per_block + offset) and the cached tokens including it.
//   block_tables int32 [rows, bt_stride]; entries of blocks holding no visible key may be < 0.
//   logits float32 [rows, vocab].
//   Weight formats (Linear.format): 0 float32 [n, k]; 1 bf16 [n, k]; 2 int8 [n, k] + scale [n];
//       3 int4 packed [n, k / 2] + scale, min float16 [n, k / gs] (cpu_weight_only.cpp's layouts);
//       4, 5: int8 / int4 in cpu_act_quant.cpp's repacked layout, with int8 activations (the input
//       quantized per block of 32 columns, once per input by each thread).
//   KV formats (Model.kv_format): 0 float32, 1 bf16, 2 int8 with float32 scales per (slot, head)
//       (kv_quant.py: scale = max|x| / 127, q = round-half-even(x / scale)).
//   rope_cos, rope_sin: float32 [rope_positions, rotary_dim / 2] (neox pairing: dim i with
//       i + rotary_dim / 2); positions must be below rope_positions (the caller checks).

namespace {

struct Linear {
  int32_t format, act_isa;  // act_isa: formats 4, 5: the act-quant tier (act_quant.ISAS)
  const void* w;
  const void* scale;  // formats 2, 4, 5: float32; 3: float16 (uint16_t bits)
  const void* min;
  const float* bias;  // float32 [n] or null
  int64_t n, k, gs;
};

struct Layer {
  const float* input_norm;  // float32 [hidden]
  const float* post_norm;
  Linear qkv, out, mlp_in, mlp_out;  // mlp_in: [gate; up], 2 * intermediate outputs
  void* k_cache;                     // [num_blocks, tpb, kv_heads, head_dim] of kv_format
  void* v_cache;
  float* k_scales;                   // int8 only: float32 [num_blocks, tpb, kv_heads]
  float* v_scales;
};

struct Model {
  int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab, rotary_dim;
  int64_t tokens_per_block, window, sink, rope_positions;
  float eps, attention_scale;
  int32_t kv_format, isa;
  int32_t matmuls_only, pad;  // benchmarks: 1 the GEMVs alone (same inputs, barriers and split), 2 all but attention
  const float* rope_cos;
  const float* rope_sin;
  const float* final_norm;
  const Layer* layers;
  Linear lm_head;
};

constexpr int64_t kUnit = 32;  // outputs per unit of thread work (a multiple of every tile's O and of kActUnit)
static_assert(kUnit % bm_aq::kActUnit == 0, "thread ranges must start on act-quant units");

// The outputs [n0, n1) of thread t of nt over n outputs: contiguous runs of whole units.
inline void thread_range(int64_t n, int t, int nt, int64_t& n0, int64_t& n1) {
  const int64_t units = (n + kUnit - 1) / kUnit;
  n0 = std::min(n, units * t / nt * kUnit);
  n1 = std::min(n, units * (t + 1) / nt * kUnit);
}

inline void rms_norm_rows(const float* x, int64_t rows, int64_t h, const float* w, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * h;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < h; ++i) sum += xr[i] * xr[i];
    const float inv = 1.f / sqrtf(sum / (float)h + eps);
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) y[r * h + i] = xr[i] * inv * w[i];
  }
}

// A GEMV's input as each weight format reads it: float32 rows, their bf16 copy (AVX512-BF16) and
// the int4 group sums, prepared once per input by each thread for itself.
struct Input {
  const float* x;
  const uint16_t* x_bf16;  // null unless a bf16 weight reads it with the dot-product instruction
  const float* xsum;       // [rows, k / gs] for int4 weights, else null
  int64_t rows, k;
  const int8_t* q;         // int8-activation weights: x quantized per block of 32 (bm_aq::quantize_rows)
  const float* d;
  const int32_t* s;
};

template <class V>
void weight_only_range(const Linear& L, const Input& in, float* y, int64_t ldy, int accumulate, int64_t n0,
                       int64_t n1) {
  if (L.format == 2) {
    const bm_wo::Int8Args a{in.x, in.k, (const int8_t*)L.w, (const float*)L.scale, L.n, L.k, L.bias, y, ldy,
                            accumulate};
    bm_wo::run_range<V, bm_wo::Int8Args, bm_wo::Int8K>(a, in.rows, n0, n1);
  } else {
    const bm_wo::Int4Args a{in.x, in.k, (const uint8_t*)L.w, (const uint16_t*)L.scale, (const uint16_t*)L.min,
                            L.n, L.k, L.gs, L.bias, y, ldy, accumulate, in.xsum};
    bm_wo::run_range<V, bm_wo::Int4Args, bm_wo::Int4K>(a, in.rows, n0, n1);
  }
}

// y[r, o] (+)= sum_k in.x[r, k] W[o, k] (+ bias[o]) for the outputs o in [n0, n1).
void linear_range(const Linear& L, const Input& in, float* y, int64_t ldy, int accumulate, int64_t n0, int64_t n1,
                  int isa) {
  if (n0 >= n1) return;
  const int64_t rows = in.rows;
  switch (L.format) {
    case 0:
      if (rows == 1) bm_native::linear_range<8>(in.x, rows, in.k, (const float*)L.w, n0, n1, L.k, L.bias, y, ldy, accumulate);
      else if (rows == 2) bm_native::linear_range<4>(in.x, rows, in.k, (const float*)L.w, n0, n1, L.k, L.bias, y, ldy, accumulate);
      else bm_native::linear_range<3>(in.x, rows, in.k, (const float*)L.w, n0, n1, L.k, L.bias, y, ldy, accumulate);
      return;
    case 1: {
      const bool dp = in.x_bf16 != nullptr;
      const bm_native::Bf16LinearArgs a{dp ? (const void*)in.x_bf16 : (const void*)in.x, dp, rows, in.k,
                                        (const uint16_t*)L.w, L.n, L.k, L.bias, y, false, ldy, accumulate};
      if (dp) {
        if (rows == 1) bm_native::linear_bf16_range<true, 8>(a, n0, n1);
        else if (rows == 2) bm_native::linear_bf16_range<true, 4>(a, n0, n1);
        else bm_native::linear_bf16_range<true, 4>(a, n0, n1);
      } else {
        if (rows == 1) bm_native::linear_bf16_range<false, 8>(a, n0, n1);
        else if (rows == 2) bm_native::linear_bf16_range<false, 4>(a, n0, n1);
        else bm_native::linear_bf16_range<false, 3>(a, n0, n1);
      }
      return;
    }
    case 4:
    case 5: {
      const bm_aq::ActLinear a{L.format - 2, 0, L.w, (const float*)L.scale, (const float*)L.min, L.bias, L.n, L.k,
                               L.gs};
      bm_aq::act_linear_range(a, in.q, in.d, in.s, rows, in.k, y, ldy, accumulate, n0, n1, L.act_isa);
      return;
    }
    default:
#ifdef __AVX512F__
      if (isa >= 2) { weight_only_range<bm_wo::Avx512>(L, in, y, ldy, accumulate, n0, n1); return; }
#endif
      if (isa >= 1) weight_only_range<bm_wo::Avx2>(L, in, y, ldy, accumulate, n0, n1);
      else weight_only_range<bm_wo::Scalar>(L, in, y, ldy, accumulate, n0, n1);
  }
}

// A thread's private buffers for one GEMV input: the rows' bf16 copy and int4 group sums as the
// weights `uses` need them.
struct InputScratch {
  std::vector<uint16_t> bf16;
  std::vector<float> xsum, d;
  std::vector<int8_t> q;
  std::vector<int32_t> s;

  Input prepare(const float* x, int64_t rows, int64_t k, std::initializer_list<const Linear*> uses) {
    Input in{x, nullptr, nullptr, rows, k, nullptr, nullptr, nullptr};
    for (const Linear* L : uses) {
      if ((L->format == 4 || L->format == 5) && in.q == nullptr) {
        q.resize(rows * k);
        d.resize(rows * k / 32);
        s.resize(rows * k / 32);
        bm_aq::quantize_rows(x, rows, k, q.data(), d.data(), s.data());
        in.q = q.data(), in.d = d.data(), in.s = s.data();
      }
      if (L->format == 1 && bm_native::kHasDpbf16 && k % 32 == 0 && in.x_bf16 == nullptr) {
        bf16.resize(rows * k);
        for (int64_t i = 0; i < rows * k; ++i) bf16[i] = bm_native::f32_to_bf16(x[i]);
        in.x_bf16 = bf16.data();
      }
      if (L->format == 3 && in.xsum == nullptr) {
        const int64_t groups = k / L->gs;
        xsum.resize(rows * groups);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t g = 0; g < groups; ++g) {
            float s = 0.f;
            for (int64_t t = 0; t < L->gs; ++t) s += x[r * k + g * L->gs + t];
            xsum[r * groups + g] = s;
          }
        in.xsum = xsum.data();
      }
    }
    return in;
  }
};

// One K or V row of the cache (slot, head) as float32.
inline void read_kv_row(const Model& m, const void* cache, const float* scales, int64_t row, float* out) {
  const int64_t d = m.head_dim;
  if (m.kv_format == 0) {
    const float* p = (const float*)cache + row * d;
    std::copy(p, p + d, out);
  } else if (m.kv_format == 1) {
    const uint16_t* p = (const uint16_t*)cache + row * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) out[i] = bm_native::bf16_to_f32(p[i]);
  } else {
    const int8_t* p = (const int8_t*)cache + row * d;
    const float s = scales[row];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) out[i] = (float)p[i] * s;
  }
}

inline void write_kv_row(const Model& m, void* cache, float* scales, int64_t row, const float* x) {
  const int64_t d = m.head_dim;
  if (m.kv_format == 0) {
    std::copy(x, x + d, (float*)cache + row * d);
  } else if (m.kv_format == 1) {
    uint16_t* p = (uint16_t*)cache + row * d;
    for (int64_t i = 0; i < d; ++i) p[i] = bm_native::f32_to_bf16(x[i]);
  } else {
    float amax = 0.f;
    for (int64_t i = 0; i < d; ++i) amax = std::max(amax, fabsf(x[i]));
    const float scale = amax / 127.f, safe = scale > 0.f ? scale : 1.f;
    int8_t* p = (int8_t*)cache + row * d;
    for (int64_t i = 0; i < d; ++i) p[i] = (int8_t)nearbyintf(std::min(127.f, std::max(-127.f, x[i] / safe)));
    scales[row] = scale;
  }
}

// Rotary (neox pairing) of one head in place over its first rotary_dim dims, rounded as the eager
// model's torch ops round it (two products, then their sum: no fused multiply-add), so a key lands
// on the same side of an int8 cache's rounding boundary.
__attribute__((optimize("fp-contract=off"))) inline void rotate(const Model& m, float* head, int64_t position) {
  const int64_t half = m.rotary_dim / 2;
  const float* c = m.rope_cos + position * half;
  const float* s = m.rope_sin + position * half;
  for (int64_t i = 0; i < half; ++i) {
    const float a = head[i], b = head[i + half];
    head[i] = a * c[i] - b * s[i];
    head[i + half] = b * c[i] + a * s[i];
  }
}

struct AttentionScratch {
  std::vector<float> q, acc, row, scores;
  std::vector<int64_t> keys;
};

// A cached K or V row as float32: the cache's own row (float32 cache) or `buffer` holding it converted.
inline const float* kv_row(const Model& m, const void* cache, const float* scales, int64_t row, float* buffer) {
  if (m.kv_format == 0) return (const float*)cache + row * m.head_dim;
  read_kv_row(m, cache, scales, row, buffer);
  return buffer;
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < d; ++t) sum += a[t] * b[t];
  return sum;
}

// Softmax in place of n scores, exp 8 at a time (cpu_native.cpp's polynomial exp: libm's expf per
// score was a visible share of a many-row step).
inline void softmax(float* scores, int64_t n) {
  float top = -INFINITY;
  for (int64_t i = 0; i < n; ++i) top = std::max(top, scores[i]);
  const __m256 shift = _mm256_set1_ps(top);
  __m256 sums = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = bm_native::exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + i), shift));
    _mm256_storeu_ps(scores + i, e);
    sums = _mm256_add_ps(sums, e);
  }
  float total = bm_native::hsum8(sums);
  for (; i < n; ++i) total += (scores[i] = expf(scores[i] - top));
  const float inv = 1.f / total;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) scores[j] *= inv;
}

// Sequence b, KV head kvh: rotate its query heads and key, write the key and value into the
// cache, attend over the visible keys; out [num_heads * head_dim] of the sequence's row.
void attend(const Model& m, const Layer& L, const float* qkv, int64_t b, int64_t kvh, const int64_t* positions,
            const int64_t* slots, const int32_t* block_tables, int64_t bt_stride, const int64_t* seq_lens,
            float* out, AttentionScratch& s) {
  const int64_t d = m.head_dim, group = m.num_heads / m.num_kv_heads, tpb = m.tokens_per_block;
  const int64_t q_size = m.num_heads * d, kv_size = m.num_kv_heads * d;
  const float* row = qkv + b * (q_size + 2 * kv_size);
  s.q.assign(row + kvh * group * d, row + (kvh + 1) * group * d);
  s.row.assign(row + q_size + kvh * d, row + q_size + (kvh + 1) * d);
  for (int64_t g = 0; g < group; ++g) rotate(m, s.q.data() + g * d, positions[b]);
  rotate(m, s.row.data(), positions[b]);
  const int64_t new_row = slots[b] * m.num_kv_heads + kvh;
  write_kv_row(m, L.k_cache, L.k_scales, new_row, s.row.data());
  write_kv_row(m, L.v_cache, L.v_scales, new_row, row + q_size + kv_size + kvh * d);

  bm_native::visible_keys(seq_lens[b], m.window, m.sink, s.keys);
  const int64_t n = (int64_t)s.keys.size();
  const int32_t* table = block_tables + b * bt_stride;
  for (int64_t& j : s.keys) j = ((int64_t)table[j / tpb] * tpb + j % tpb) * m.num_kv_heads + kvh;
  s.scores.resize(group * n);
  const float* q = s.q.data();
  float* scores = s.scores.data();
  for (int64_t i = 0; i < n; ++i) {
    const float* k = kv_row(m, L.k_cache, L.k_scales, s.keys[i], s.row.data());
    for (int64_t g = 0; g < group; ++g) scores[g * n + i] = dot(q + g * d, k, d) * m.attention_scale;
  }
  for (int64_t g = 0; g < group; ++g) softmax(scores + g * n, n);
  float* acc = out + b * q_size + kvh * group * d;   // this task's [group, d] of the output
  std::fill_n(acc, group * d, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    const float* v = kv_row(m, L.v_cache, L.v_scales, s.keys[i], s.row.data());
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * n + i];
      float* __restrict o = acc + g * d;
#pragma omp simd
      for (int64_t t = 0; t < d; ++t) o[t] += p * v[t];
    }
  }
}

// act[i] = silu(gate[i]) * up[i] for i in [n0, n1): 8 at a time with cpu_native.cpp's polynomial
// exp (relative error ~1e-7; libm's expf, one call per element, cost ~1.5 ms per step at 4 rows).
inline void silu_mul_range(const float* gate, const float* up, float* act, int64_t n0, int64_t n1) {
  int64_t i = n0;
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n1; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = bm_native::exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
  for (; i < n1; ++i) act[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
}

}  // namespace

extern "C" void bm_decode_step(const Model* model, int64_t rows, float* x, const int64_t* positions,
                               const int64_t* slots, const int32_t* block_tables, int64_t bt_stride,
                               const int64_t* seq_lens, float* logits, int num_threads) {
  const Model& m = *model;
  const int64_t h = m.hidden, inter = m.intermediate, d = m.head_dim;
  const int64_t qkv_width = (m.num_heads + 2 * m.num_kv_heads) * d, q_size = m.num_heads * d;
  // shared between the threads, each written by one thread per phase
  std::vector<float> qkv(rows * qkv_width), attn(rows * q_size, 0.f), gate_up(rows * 2 * inter), act(rows * inter, 0.f);
#pragma omp parallel num_threads(num_threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    std::vector<float> normed(rows * h, 0.f);
    InputScratch input_scratch;
    AttentionScratch attention_scratch;
    int64_t n0, n1;
    for (int64_t layer = 0; layer < m.num_layers; ++layer) {
      const Layer& L = m.layers[layer];
      if (m.matmuls_only != 1) rms_norm_rows(x, rows, h, L.input_norm, m.eps, normed.data());
      Input in = input_scratch.prepare(normed.data(), rows, h, {&L.qkv});
      thread_range(L.qkv.n, t, nt, n0, n1);
      linear_range(L.qkv, in, qkv.data(), qkv_width, 0, n0, n1, m.isa);
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < rows * m.num_kv_heads; ++task)
        if (m.matmuls_only == 0) attend(m, L, qkv.data(), task / m.num_kv_heads, task % m.num_kv_heads, positions, slots, block_tables,
               bt_stride, seq_lens, attn.data(), attention_scratch);
      // (the for's implied barrier)
      in = input_scratch.prepare(attn.data(), rows, q_size, {&L.out});
      thread_range(L.out.n, t, nt, n0, n1);
      linear_range(L.out, in, x, h, 1, n0, n1, m.isa);
#pragma omp barrier
      if (m.matmuls_only != 1) rms_norm_rows(x, rows, h, L.post_norm, m.eps, normed.data());
      in = input_scratch.prepare(normed.data(), rows, h, {&L.mlp_in});
      thread_range(inter, t, nt, n0, n1);   // gate outputs [n0, n1) and the same up outputs
      linear_range(L.mlp_in, in, gate_up.data(), 2 * inter, 0, n0, n1, m.isa);
      linear_range(L.mlp_in, in, gate_up.data(), 2 * inter, 0, inter + n0, inter + n1, m.isa);
      for (int64_t r = 0; r < rows && m.matmuls_only != 1; ++r)
        silu_mul_range(gate_up.data() + r * 2 * inter, gate_up.data() + r * 2 * inter + inter,
                       act.data() + r * inter, n0, n1);
#pragma omp barrier
      in = input_scratch.prepare(act.data(), rows, inter, {&L.mlp_out});
      thread_range(L.mlp_out.n, t, nt, n0, n1);
      linear_range(L.mlp_out, in, x, h, 1, n0, n1, m.isa);
#pragma omp barrier
    }
    if (m.matmuls_only != 1) rms_norm_rows(x, rows, h, m.final_norm, m.eps, normed.data());
    Input in = input_scratch.prepare(normed.data(), rows, h, {&m.lm_head});
    thread_range(m.vocab, t, nt, n0, n1);
    linear_range(m.lm_head, in, logits, m.vocab, 0, n0, n1, m.isa);
  }
}
