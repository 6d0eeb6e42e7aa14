// The generation step of a LLaMA-family model as one native call (cpu_decode_step.py binds it),
// over the op families' functions that the per-op entry points (ops.cpp) call too: the linear
// ranges (linear_float.h, linear_weight_only.h, linear_act_quant.h), rms_norm_row and
// silu_mul_range (norm_activation.h), the KV rows, attend_chunk and combine_chunks (attention.h). One OpenMP
// parallel region runs every layer:
//
//   per layer:  RMSNorm (each thread its own copy: no barrier) -> QKV GEMV (outputs in chunks that
//               the threads claim as they go: Chunks) | barrier | per (sequence, chunk of its
//               keys) for every head (attend; each thread its share: ChunkPlan::thread_tasks): the
//               q / k RMSNorm (Qwen3), rotary, the KV-cache write, paged decode attention, the last
//               chunk combining | barrier |
//               out-projection GEMV added into the residual | barrier | RMSNorm -> gate and up GEMV
//               over the same outputs, silu(gate) * up | barrier | down GEMV added into the residual
//               | barrier
//   then:       final RMSNorm -> lm_head GEMV -> logits
//
// so a step costs 5 barriers per layer instead of ~15 Python-dispatched ops: one per dependency
// of every row on every thread's outputs (the GEMVs split their outputs, the next op reads whole
// rows), the fewest this split allows. Activations stay
// float32 throughout (the weight-only kernels' contract); bf16 weights are read by the bf16 kernel
// (with AVX512-BF16 the inputs are rounded to bf16 first, as the eager bf16 model's are).
//
// Contracts:
//   x: float32 [rows, hidden], the embeddings in, the last layer's residual stream out.
//   positions, slots, seq_lens int64 [rows]: each sequence's one new token's position, its cache
//       slot (block * tokens_per_block + offset) and the cached tokens including it.
//   block_tables int32 [rows, bt_stride]; entries of blocks holding no visible key may be < 0.
//   logits float32 [rows, vocab].
//   Weight formats (Linear.format) and input types (Linear.input): formats.h's codes. float32 [n, k]
//       and bf16 [n, k] take float32 inputs (bf16-rounded for AVX512-BF16's dot product); int8
//       [n, k] + scale [n] and int4 packed [n, k / 2] + scale, min float16 [n, k / gs] take float32
//       inputs (linear_weight_only.h's layouts), or q8x32 inputs (int8 activations: the input
//       quantized per block of 32 columns) over linear_act_quant.h's repacked layout. Block
//       weights (llama.cpp's q8_0 ... q6_k): Linear.segments, runs of output rows each in its own
//       format, by the format table's kernels (format_table.h) over the q8x32 or q8k input their
//       format takes. The out and down projections' inputs are quantized once, by the threads
//       that produce their rows (SharedInput); the RMSNorm outputs once per thread (InputScratch).
//   KV formats (Model.kv_format): attention.h's KvFormat (0 float32, 1 bf16, 2 int8 with float32
//       scales per (slot, head)).
//   rope_cos, rope_sin: float32 [rope_positions, rotary_dim / 2] (neox pairing: dim i with
//       i + rotary_dim / 2); positions must be below rope_positions (the caller checks).
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <memory>
#include <vector>

#include "attention.h"
#include "format_table.h"
#include "formats.h"
#include "isa.h"
#include "linear_act_quant.h"
#include "linear_float.h"
#include "linear_weight_only.h"
#include "norm_activation.h"
#include "vec.h"

namespace {

// A run of output rows [first, last) of a block-format weight (llama.cpp's blocks, format_table.h):
// uint8 [last - first, row_bytes] at w, in ggml's layout or (x8) the 8-row interleaved one.
struct Segment {
  int32_t format, x8;  // bm::WeightFormat (a block format); 1: the 8-row interleaved layout
  const uint8_t* w;
  int64_t first, last, row_bytes;
};

struct Linear {
  int32_t format, input;  // bm::WeightFormat, bm::InputType (formats.h); block weights: their segments'
  const void* w;
  const void* scale;  // int8: float32 [n]; int4: float16 bits [n, k / gs] (repacked for q8x32 inputs: [units, k / gs, 16])
  const void* min;
  const float* bias;  // float32 [n] or null
  int64_t n, k, gs;
  const Segment* segments;  // block weights (one format per run of rows; Q4_K_M mixes two), else null
  int64_t num_segments;
};

struct Layer {
  const float* input_norm;  // float32 [hidden]
  const float* post_norm;
  Linear qkv, out, mlp_in, mlp_out;  // mlp_in: [gate; up], 2 * intermediate outputs
  void* k_cache;                     // [num_blocks, tpb, kv_heads, head_dim] of kv_format
  void* v_cache;
  float* k_scales;                   // int8 only: float32 [num_blocks, tpb, kv_heads]
  float* v_scales;
  const float* q_norm;               // float32 [head_dim] or null: every query head's RMSNorm (Qwen3)
  const float* k_norm;               // float32 [head_dim] or null: every key head's
};

struct Model {
  int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab, rotary_dim;
  int64_t tokens_per_block, window, sink, rope_positions;
  float eps, attention_scale;
  int32_t kv_format, isa;  // isa: the bm::Isa cap every family runs under (isa.h)
  int32_t matmuls_only, pad;  // benchmarks: 1 the GEMVs alone (same inputs, barriers and split), 2 all but attention
  const float* rope_cos;
  const float* rope_sin;
  const float* final_norm;
  const Layer* layers;
  Linear lm_head;
};

constexpr int64_t kUnit = 32;  // outputs per unit of thread work (a multiple of every tile's O and of kActUnit)
static_assert(kUnit % bm_aq::kActUnit == 0, "thread ranges must start on act-quant units");

// 2 chunks per thread: in-process A/B of the step (SmolLM2 Q4_0 blocks, AMD Zen 4, 2 threads), each
// chunk start costing a stream's ramp-up: 4 -> 8 or 16 per thread ran 0.90-0.98x; 4 -> 2 or 1
// 1.02-1.05x, and with the next chunk's start prefetched (below) 2 ran best.
constexpr int64_t kChunksPerThread = 2;

// One GEMV's outputs handed out in chunks of whole units to whichever thread asks next (ggml's
// chunked matmul): a thread slowed by another process or by a slower share of the kernels does not
// hold the others at the next barrier. `next` is this GEMV's own counter, zero before the region.
// A thread claims its next chunk when it starts one, and the caller requests the next chunk's first
// weight bytes (prefetch_outputs): a chunk's stream then starts with its lines in flight rather
// than with demand misses while the hardware prefetcher ramps up.
struct Chunks {
  std::atomic<int64_t>* next;
  int64_t n, chunk, ahead0 = -1, ahead1 = 0;

  // unit: a multiple of kUnit every chunk but the last is made of (a q8k input's producer: 256)
  Chunks(std::atomic<int64_t>* counter, int64_t outputs, int nt, int64_t unit = kUnit) : next(counter), n(outputs) {
    const int64_t units = (n + unit - 1) / unit;
    chunk = std::max<int64_t>(1, (units + nt * kChunksPerThread - 1) / (nt * kChunksPerThread)) * unit;
  }
  // The next chunk [n0, n1) (false when none is left); starting(first output) runs for the chunk
  // claimed after it, if any.
  template <class Starting>
  bool claim(int64_t& n0, int64_t& n1, Starting starting) {
    if (ahead0 < 0) take(ahead0, ahead1);
    n0 = ahead0, n1 = ahead1;
    if (n0 >= n) return false;
    take(ahead0, ahead1);
    if (ahead0 < n) starting(ahead0);
    return true;
  }

 private:
  void take(int64_t& n0, int64_t& n1) {
    n0 = next->fetch_add(1, std::memory_order_relaxed) * chunk;
    n1 = std::min(n, n0 + chunk);
  }
};

inline void rms_norm_rows(const float* x, int64_t rows, int64_t h, const float* w, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) bm::rms_norm_row(x + r * h, h, w, eps, y + r * h);
}

// A GEMV's input as each weight format reads it: float32 rows, their bf16 copy (AVX512-BF16) and
// their q8x32 / q8k quantization, prepared once per input by each thread for itself (or shared).
struct Input {
  const float* x;
  const uint16_t* x_bf16;  // null unless a bf16 weight reads it with the dot-product instruction
  int64_t rows, k;
  const int8_t* q;         // q8x32 inputs (int8-activation and 32-element block weights): x quantized
  const float* d;          // per block of 32 (bm_blk::quantize_q8x32)
  const int32_t* s;
  const int8_t* kq;        // q8k inputs (the K block formats): blocks of 256 (bm_blk::quantize_q8k)
  const float* kd;
  const int16_t* kbsums;
};

void weight_only_range(const Linear& L, const Input& in, float* y, int64_t ldy, int accumulate, int64_t n0,
                       int64_t n1, int isa) {
  if (L.format == bm::kWeightInt8) {
    const bm_wo::Int8Args a{in.x, in.k, (const int8_t*)L.w, (const float*)L.scale, L.n, L.k, L.bias, y, ldy,
                            accumulate};
    bm_wo::tier_range<bm_wo::Int8Args, bm_wo::Int8K>(a, in.rows, n0, n1, isa);
  } else {
    const bm_wo::Int4Args a{in.x, in.k, (const uint8_t*)L.w, (const uint16_t*)L.scale, (const uint16_t*)L.min,
                            L.n, L.k, L.gs, L.bias, y, ldy, accumulate};
    bm_wo::tier_range<bm_wo::Int4Args, bm_wo::Int4K>(a, in.rows, n0, n1, isa);
  }
}

// A block weight's outputs [n0, n1): each segment's share by its format table row's kernel (the
// same kernels as bm_blk_linear; an x8 segment's local start is a multiple of 8: cpu_decode_step.py
// binds only segments starting at a multiple of kUnit).
void block_range(const Linear& L, const Input& in, float* y, int64_t ldy, int accumulate, int64_t n0, int64_t n1,
                 int isa) {
  for (int64_t i = 0; i < L.num_segments; ++i) {
    const Segment& seg = L.segments[i];
    const int64_t o0 = std::max(n0, seg.first), o1 = std::min(n1, seg.last);
    if (o0 >= o1) continue;
    const bm::FormatTraits& t = *bm::format_traits(seg.format);
    const bool is_k = t.input == bm::kInputQ8K;
    const bm_blk::QInput x = is_k ? bm_blk::QInput{in.kq, in.kd, nullptr, in.kbsums, in.k, in.k / bm_blk::kQK}
                                  : bm_blk::QInput{in.q, in.d, in.s, nullptr, in.k, in.k / bm_blk::kQ};
    const bm_blk::LinearArgs a{seg.w, seg.row_bytes, seg.last - seg.first, in.k, x, in.rows,
                               L.bias ? L.bias + seg.first : nullptr, y + seg.first, ldy, accumulate};
    bm::linear_kernel(t, isa, seg.x8)(a, o0 - seg.first, o1 - seg.first);
  }
}

// y[r, o] (+)= sum_k in.x[r, k] W[o, k] (+ bias[o]) for the outputs o in [n0, n1).
void linear_range(const Linear& L, const Input& in, float* y, int64_t ldy, int accumulate, int64_t n0, int64_t n1,
                  int isa) {
  if (n0 >= n1) return;
  const int64_t rows = in.rows;
  if (L.segments) return block_range(L, in, y, ldy, accumulate, n0, n1, isa);
  switch (L.format) {
    case bm::kWeightFloat32:
      bm_float::linear_rows_range(in.x, rows, in.k, (const float*)L.w, n0, n1, L.k, L.bias, y, ldy, accumulate);
      return;
    case bm::kWeightBf16: {
      const bool dp = in.x_bf16 != nullptr;
      const bm_float::Bf16LinearArgs a{dp ? (const void*)in.x_bf16 : (const void*)in.x, dp, rows, in.k,
                                       (const uint16_t*)L.w, L.n, L.k, L.bias, y, false, ldy, accumulate};
      if (dp) bm_float::linear_bf16_rows_range<true>(a, n0, n1);
      else bm_float::linear_bf16_rows_range<false>(a, n0, n1);
      return;
    }
    default:   // kWeightInt8, kWeightInt4
      if (L.input == bm::kInputQ8x32) {
        const bm_aq::ActLinear a{L.format, 0, L.w, L.scale, (const uint16_t*)L.min, L.bias, L.n, L.k, L.gs};
        bm_aq::act_linear_range(a, in.q, in.d, in.s, rows, in.k, y, ldy, accumulate, n0, n1, isa);
      } else {
        weight_only_range(L, in, y, ldy, accumulate, n0, n1, isa);
      }
  }
}

// The first kStartBytes of the weights of L's outputs from o on, toward L1 (Chunks). Every layout
// holds an output's weights in o's order (a block segment's x8 groups, the int8-activation units of
// 16 outputs: chunks start on kUnit multiples), so output o's start is o times its bytes.
constexpr int64_t kStartBytes = 8192;

inline void prefetch_outputs(const Linear& L, int64_t o) {
  const char* p = nullptr;
  if (L.segments) {
    for (int64_t i = 0; i < L.num_segments; ++i)
      if (o >= L.segments[i].first && o < L.segments[i].last)
        p = (const char*)L.segments[i].w + (o - L.segments[i].first) * L.segments[i].row_bytes;
  } else {
    const int64_t bytes = L.format == bm::kWeightFloat32 ? 4 * L.k : L.format == bm::kWeightBf16 ? 2 * L.k
                          : L.format == bm::kWeightInt8 ? L.k : L.k / 2;
    p = (const char*)L.w + o * bytes;
  }
  if (p != nullptr)
    for (int64_t b = 0; b < kStartBytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

// Rows of a GEMV input quantized in the input types its weights take: q8x32 (q, d, s) and q8k (kq,
// kd, kbsums), each laid out as bm_blk::quantize_q8x32 / quantize_q8k lay out rows of width k.
struct QuantizedRows {
  int64_t k = 0;
  std::vector<int8_t> q, kq;
  std::vector<float> d, kd;
  std::vector<int32_t> s;
  std::vector<int16_t> kbsums;

  // Room for `rows` rows of `width` in the types asked (new room zeroed: the quantized zero rows).
  void reset(int64_t rows, int64_t width, bool q8x32, bool q8k) {
    k = width;
    if (q8x32) q.resize(rows * k), d.resize(rows * k / bm_blk::kQ), s.resize(rows * k / bm_blk::kQ);
    if (q8k) kq.resize(rows * k), kd.resize(rows * k / bm_blk::kQK), kbsums.resize(rows * k / 16);
  }

  // Row r's columns [c0, c1) of x (row stride ldx) in the types asked: c0 and c1 whole blocks of
  // each (or c1 = k).
  void quantize(bool q8x32, bool q8k, const float* x, int64_t ldx, int64_t r, int64_t c0, int64_t c1) {
    const float* row = x + r * ldx + c0;
    if (q8x32) {
      const int64_t b = (r * k + c0) / bm_blk::kQ;
      bm_blk::quantize_q8x32(row, 1, ldx, c1 - c0, q.data() + r * k + c0, d.data() + b, s.data() + b);
    }
    if (q8k)
      bm_blk::quantize_q8k(row, 1, ldx, c1 - c0, kq.data() + r * k + c0, kd.data() + (r * k + c0) / bm_blk::kQK,
                           kbsums.data() + (r * k + c0) / 16);
  }

  // `in` reads the types asked of those held here.
  void point(Input& in, bool q8x32 = true, bool q8k = true) const {
    if (q8x32 && !q.empty()) in.q = q.data(), in.d = d.data(), in.s = s.data();
    if (q8k && !kq.empty()) in.kq = kq.data(), in.kd = kd.data(), in.kbsums = kbsums.data();
  }
};

// The q8x32 / q8k input types a linear's kernels take: its own, or its segments'.
inline bool takes(const Linear& L, bm::InputType type) {
  if (!L.segments) return L.input == type;
  for (int64_t i = 0; i < L.num_segments; ++i)
    if (bm::format_traits(L.segments[i].format)->input == type) return true;
  return false;
}

// A GEMV input quantized once for all the threads by whoever writes its rows: the out-projection's
// input by the attention task that combines a sequence's row, the down projection's by the thread
// of each gate / up chunk (whole 32-column blocks; 256 for a q8k input, whose producer's chunks are
// then multiples of 256 outputs). So neither input is quantized once per thread, and no barrier is
// added: the barrier that publishes the rows publishes their quantized copy. Zero until written
// (the quantized zero rows of an input a benchmark mode skips). The RMSNorm outputs (the QKV and
// gate / up inputs) stay per thread: each thread normalises the rows for itself, as sharing them
// would cost a barrier, and quantizes its copy (InputScratch).
struct SharedInput : QuantizedRows {
  // Buffers for the input types some layer's consumer takes.
  SharedInput(int64_t rows, int64_t width, bool q8x32, bool q8k) { reset(rows, width, q8x32, q8k); }

  // Row r's columns [c0, c1) of x in the types `consumer` takes.
  void quantize_for(const Linear& consumer, const float* x, int64_t ldx, int64_t r, int64_t c0, int64_t c1) {
    quantize(takes(consumer, bm::kInputQ8x32), takes(consumer, bm::kInputQ8K), x, ldx, r, c0, c1);
  }
};

// A thread's private buffers for one GEMV input: the rows quantized and their bf16 copy, as the
// weights `uses` need them.
struct InputScratch {
  QuantizedRows quantized;
  std::vector<uint16_t> bf16;

  // `shared`: the q8x32 / q8k input its producers quantized, used instead of quantizing x here.
  Input prepare(const float* x, int64_t rows, int64_t k, int isa, std::initializer_list<const Linear*> uses,
                const SharedInput* shared = nullptr) {
    Input in{x, nullptr, rows, k, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
    bool q8x32 = false, q8k = false;
    for (const Linear* L : uses) q8x32 |= takes(*L, bm::kInputQ8x32), q8k |= takes(*L, bm::kInputQ8K);
    if (shared != nullptr) {
      shared->point(in);
      q8x32 &= in.q == nullptr, q8k &= in.kq == nullptr;
    }
    if (q8x32 || q8k) {
      quantized.reset(rows, k, q8x32, q8k);
      for (int64_t r = 0; r < rows; ++r) quantized.quantize(q8x32, q8k, x, k, r, 0, k);
      quantized.point(in, q8x32, q8k);
    }
    for (const Linear* L : uses) {
      const bool dot_product = bm_float::kHasDpbf16 && isa >= bm::kAvx512Bf16 && k % 32 == 0;
      if (L->format == bm::kWeightBf16 && dot_product && in.x_bf16 == nullptr) {
        bf16.resize(rows * k);
        for (int64_t i = 0; i < rows * k; ++i) bf16[i] = bm::f32_to_bf16(x[i]);
        in.x_bf16 = bf16.data();
      }
    }
    return in;
  }
};

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

// Attention task `task` of the plan: one chunk of sequence b's visible keys for all its query heads.
// The query heads are RMS-normalised (Layer.q_norm, where set) and rotated by every chunk's task for
// itself; the task of the last chunk, which holds the newest key, first writes the new keys
// (normalised by k_norm where set, rotated) and values of every KV head into the cache. The last
// task of the sequence to finish combines the chunks' partial results into out [num_heads * head_dim]
// of the sequence's row (and returns true). Chunks depend on the number of visible keys only
// (attention.h), so any number of threads computes the same numbers.
bool attend(const Model& m, const Layer& L, const float* qkv, bm::ChunkPlan& plan, int64_t task,
            const int64_t* positions, const int64_t* slots, const int32_t* block_tables, int64_t bt_stride,
            const int64_t* seq_lens, float* partials, float* out, bm::AttentionScratch& s) {
  const int64_t d = m.head_dim, kv_heads = m.num_kv_heads, q_size = m.num_heads * d, kv_size = kv_heads * d;
  const int64_t size = bm::partial_size(m.num_heads, d), b = plan.task_sequence[task];
  const bm::KvRows k{m.kv_format, L.k_cache, L.k_scales, d}, v{m.kv_format, L.v_cache, L.v_scales, d};
  const float* row = qkv + b * (q_size + 2 * kv_size);
  bm::KeySpans spans;
  int64_t from, to;
  plan.keys(task, seq_lens, m.window, m.sink, spans, from, to);
  if (to == spans.count()) {
    s.k_new.assign(row + q_size, row + q_size + kv_size);
    for (int64_t h = 0; h < kv_heads; ++h) {
      float* key = s.k_new.data() + h * d;
      if (L.k_norm != nullptr) bm::rms_norm_row(key, d, L.k_norm, m.eps, key);   // before rotary, as _qk_norm
      rotate(m, key, positions[b]);
      k.write(slots[b] * kv_heads + h, key);
      v.write(slots[b] * kv_heads + h, row + q_size + kv_size + h * d);
    }
  }
  s.q.assign(row, row + q_size);
  for (int64_t h = 0; h < m.num_heads; ++h) {
    float* query = s.q.data() + h * d;
    if (L.q_norm != nullptr) bm::rms_norm_row(query, d, L.q_norm, m.eps, query);
    rotate(m, query, positions[b]);
  }
  bm::visible_slots(spans, from, to, block_tables + b * bt_stride, m.tokens_per_block, s.slots);
  bm::attend_chunk(s.q.data(), m.num_heads, kv_heads, d, k, v, s.slots.data(), to - from, m.attention_scale, s,
                   partials + task * size);
  if (!plan.finish(task)) return false;
  bm::combine_chunks(partials + plan.first_task[b] * size, plan.first_task[b + 1] - plan.first_task[b], m.num_heads,
                     d, out + b * q_size);
  return true;
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
  // one chunk counter per GEMV of the step: 4 per layer and the lm_head
  const int64_t num_gemvs = 4 * m.num_layers + 1;
  std::unique_ptr<std::atomic<int64_t>[]> counters(new std::atomic<int64_t>[num_gemvs]);
  for (int64_t i = 0; i < num_gemvs; ++i) counters[i].store(0, std::memory_order_relaxed);
  // Attention tasks: (sequence, chunk of its visible keys) with every head (attention.h's ChunkPlan).
  bm::ChunkPlan plan(seq_lens, rows, m.window, m.sink);
  std::vector<float> partials(plan.num_tasks() * bm::partial_size(m.num_heads, d));
  // The out-projection's and the down projection's inputs, quantized by their producers.
  bool consumed[2][2] = {{false, false}, {false, false}};   // [out, mlp_out][q8x32, q8k]
  for (int64_t i = 0; i < m.num_layers; ++i)
    for (int j = 0; j < 2; ++j) {
      const Linear& consumer = j == 0 ? m.layers[i].out : m.layers[i].mlp_out;
      consumed[j][0] |= takes(consumer, bm::kInputQ8x32);
      consumed[j][1] |= takes(consumer, bm::kInputQ8K);
    }
  SharedInput attn_q(rows, q_size, consumed[0][0], consumed[0][1]), act_q(rows, inter, consumed[1][0], consumed[1][1]);
#pragma omp parallel num_threads(num_threads)
  {
    const int nt = omp_get_num_threads();
    std::vector<float> normed(rows * h, 0.f);
    InputScratch input_scratch;
    bm::AttentionScratch attention_scratch;
    int64_t n0, n1, first_task, end_task;   // this thread's attention tasks, the same in every layer
    plan.thread_tasks(omp_get_thread_num(), nt, first_task, end_task);
    for (int64_t layer = 0; layer < m.num_layers; ++layer) {
      const Layer& L = m.layers[layer];
      std::atomic<int64_t>* counter = &counters[4 * layer];
      if (m.matmuls_only != 1) rms_norm_rows(x, rows, h, L.input_norm, m.eps, normed.data());
      Input in = input_scratch.prepare(normed.data(), rows, h, m.isa, {&L.qkv});
      for (Chunks c(counter, L.qkv.n, nt); c.claim(n0, n1, [&](int64_t o) { prefetch_outputs(L.qkv, o); });)
        linear_range(L.qkv, in, qkv.data(), qkv_width, 0, n0, n1, m.isa);
#pragma omp barrier
      for (int64_t task = first_task; task < end_task; ++task) {
        if (m.matmuls_only == 0 && attend(m, L, qkv.data(), plan, task, positions, slots, block_tables, bt_stride,
                                          seq_lens, partials.data(), attn.data(), attention_scratch))
          attn_q.quantize_for(L.out, attn.data(), q_size, plan.task_sequence[task], 0, q_size);
      }
#pragma omp barrier
      // (every chunk finished; the next layer's tasks start 4 barriers on)
      if (omp_get_thread_num() == 0) plan.reset();
      in = input_scratch.prepare(attn.data(), rows, q_size, m.isa, {&L.out}, &attn_q);
      for (Chunks c(counter + 1, L.out.n, nt); c.claim(n0, n1, [&](int64_t o) { prefetch_outputs(L.out, o); });)
        linear_range(L.out, in, x, h, 1, n0, n1, m.isa);
#pragma omp barrier
      if (m.matmuls_only != 1) rms_norm_rows(x, rows, h, L.post_norm, m.eps, normed.data());
      in = input_scratch.prepare(normed.data(), rows, h, m.isa, {&L.mlp_in});
      const int64_t act_unit = takes(L.mlp_out, bm::kInputQ8K) ? bm_blk::kQK : kUnit;
      const auto gate_up_start = [&](int64_t o) {
        prefetch_outputs(L.mlp_in, o);
        prefetch_outputs(L.mlp_in, inter + o);
      };
      // gate [n0, n1) and the same up outputs
      for (Chunks c(counter + 2, inter, nt, act_unit); c.claim(n0, n1, gate_up_start);) {
        linear_range(L.mlp_in, in, gate_up.data(), 2 * inter, 0, n0, n1, m.isa);
        linear_range(L.mlp_in, in, gate_up.data(), 2 * inter, 0, inter + n0, inter + n1, m.isa);
        for (int64_t r = 0; r < rows && m.matmuls_only != 1; ++r) {
          bm::silu_mul_range(gate_up.data() + r * 2 * inter, gate_up.data() + r * 2 * inter + inter,
                             act.data() + r * inter, n0, n1);
          act_q.quantize_for(L.mlp_out, act.data(), inter, r, n0, n1);
        }
      }
#pragma omp barrier
      in = input_scratch.prepare(act.data(), rows, inter, m.isa, {&L.mlp_out}, &act_q);
      for (Chunks c(counter + 3, L.mlp_out.n, nt); c.claim(n0, n1, [&](int64_t o) { prefetch_outputs(L.mlp_out, o); });)
        linear_range(L.mlp_out, in, x, h, 1, n0, n1, m.isa);
#pragma omp barrier
    }
    if (m.matmuls_only != 1) rms_norm_rows(x, rows, h, m.final_norm, m.eps, normed.data());
    Input in = input_scratch.prepare(normed.data(), rows, h, m.isa, {&m.lm_head});
    const auto head_start = [&](int64_t o) { prefetch_outputs(m.lm_head, o); };
    for (Chunks c(&counters[4 * m.num_layers], m.vocab, nt); c.claim(n0, n1, head_start);)
      linear_range(m.lm_head, in, logits, m.vocab, 0, n0, n1, m.isa);
  }
}
