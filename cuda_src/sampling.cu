// Token selection from processed logits: greedy (first maximum), log-softmax, and top-k / top-p
// sampling by an inverse CDF in token-id order. Torch references: TorchKernels.greedy,
// TorchKernels.log_softmax, TorchKernels.sample (runtime/kernels/torch_kernels/torch_decoder.py documents the
// semantics). Stop criteria (end id, stop words, max length) are not here: the tokens go to the
// host for the responses anyway, and runtime/decoder.py checks them there.
//
// sample_tokens, per row (one CTA), with weights w = exp(x - max) in fixed point (w * 2^40 as
// uint64, so every sum is exact and order-independent: deterministic, no float atomics):
//   1. Order the tokens by (logit desc, token id asc). Top-k keeps the first k, top-p (p relative
//      to the top-k mass, or to the whole vocabulary when top_k is 0) the shortest prefix of those
//      whose mass reaches p. Both are prefixes of the one order, so the kept set is
//      {key > last_key} + the first `take` tokens (in id order) with key == last_key.
//   2. last_key comes from an MSD radix select over the order-preserving uint32 key of the float
//      (4 passes of 8 bits; each pass builds a count and a mass histogram of the next digit among
//      the tokens matching the prefix so far, in shared memory, and warp 0 finds the digit where
//      the descending cumulative count (top-k) or mass (top-p) reaches the target). No sort.
//   3. Ties at last_key: when only part of them is kept, an id-order scan finds the last kept id.
//   4. The draw: the first token in id order whose cumulative kept mass exceeds
//      floor(u * kept_mass), by a two-level scan (per-warp contiguous segment sums, then the one
//      warp whose segment holds the crossing rescans it with warp shuffles).
//   5. Log prob: x - max - log(kept mass) (normalised) or x - logsumexp(row).
//
// Launch contract (all three): grid (num_rows), block (any multiple of 32, <= 1024; launch bounds
// (1024, 1) keep every such block launchable), no dynamic shared memory.
// logits float32 [num_rows, row_stride] (unit column stride, vocab columns used).
//   greedy_tokens:  -> tokens int64 [num_rows], log_probs float32 [num_rows].
//   log_softmax_rows: -> out float32 [num_rows, vocab] (contiguous).
//   sample_tokens:  top_k int64, top_p float32, uniforms float32 in [0, 1), normalize uint8 (bool)
//                   [num_rows] -> tokens int64, log_probs float32 [num_rows]. Uniforms are read
//                   at the generator's 2^-24 resolution (Philox draws are exact multiples). Other
//                   rows must be NaN-free.
//   greedy_tokens and sample_tokens never choose a token whose logit is -inf: a row with no allowed
//   token (every logit -inf, or NaN) yields NO_TOKEN (-1) with log prob -inf, for the host to report.
//   dtypes: logits float32 whatever DTYPE says (the define is ignored).
#include "prelude.cuh"

#define FIXED_ONE 1099511627776.0f  // 2^40: weights exp(x - max) <= 1 in fixed point
#define LOG_FIXED_ONE 27.725887222397812f
#define RADIX_BITS 8
#define RADIX_BUCKETS 256
#define MAX_WARPS 32
#define NO_TOKEN (-1)  // a row with no allowed token (runtime/kernels/interface.py NO_TOKEN)

typedef unsigned long long u64;

// ---- building blocks ----------------------------------------------------------------------------
__device__ __forceinline__ float clean_zero(float x) { return x == 0.0f ? 0.0f : x; }  // -0 ties +0

// uint32 key whose unsigned order is the float order (for non-NaN values).
__device__ __forceinline__ unsigned int order_key(float x) {
  const unsigned int u = __float_as_uint(clean_zero(x));
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(unsigned int key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

__device__ __forceinline__ u64 fixed_weight(float x, float row_max) {
  return (u64)(expf(x - row_max) * FIXED_ONE);  // exp(-inf) = 0; truncation below 2^-40
}

__device__ __forceinline__ u64 warp_sum_u64(u64 v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
  return v;
}

template <class T>
__device__ __forceinline__ T warp_inclusive_scan(T v) {
  const int lane = threadIdx.x % BM_WARP_SIZE;
  for (int offset = 1; offset < BM_WARP_SIZE; offset <<= 1) {
    const T other = __shfl_up_sync(FULL_MASK, v, offset);
    if (lane >= offset) v += other;
  }
  return v;
}

// Every thread calls; `scratch` holds MAX_WARPS u64 of shared memory. Ends with a barrier.
__device__ __forceinline__ u64 block_sum_u64(u64 v, u64* scratch) {
  v = warp_sum_u64(v);
  if (threadIdx.x % BM_WARP_SIZE == 0) scratch[threadIdx.x / BM_WARP_SIZE] = v;
  __syncthreads();
  u64 total = 0;
  for (int w = 0; w < (int)blockDim.x / BM_WARP_SIZE; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

// The first index i in [0, n) with value(0) + ... + value(i) > target, to every thread; n if the
// total is <= target. value(i) >= 0. Every thread calls (block-uniform arguments). `warp_sums` may
// be reused right away; `result` (shared) only after a barrier, so consecutive calls take distinct ones.
template <class Value>
__device__ int first_crossing(int n, Value value, u64 target, u64* warp_sums, int* result) {
  const int lane = threadIdx.x % BM_WARP_SIZE, warp = threadIdx.x / BM_WARP_SIZE;
  const int num_warps = blockDim.x / BM_WARP_SIZE;
  const int segment = ((n + num_warps - 1) / num_warps + BM_WARP_SIZE - 1) / BM_WARP_SIZE * BM_WARP_SIZE;
  const int begin = min(warp * segment, n), end = min(begin + segment, n);
  u64 sum = 0;
  for (int i = begin + lane; i < end; i += BM_WARP_SIZE) sum += value(i);
  sum = warp_sum_u64(sum);
  if (lane == 0) warp_sums[warp] = sum;
  if (threadIdx.x == 0) *result = n;
  __syncthreads();
  u64 running = 0;
  for (int w = 0; w < warp; ++w) running += warp_sums[w];
  if (running <= target && target < running + sum) {  // warp-uniform: this warp holds the crossing
    for (int base = begin; base < end; base += BM_WARP_SIZE) {
      const int i = base + lane;
      const u64 v = i < end ? value(i) : 0;
      const u64 inclusive = running + warp_inclusive_scan(v);
      const bool hit = inclusive > target && inclusive - v <= target;
      if (hit) *result = i;
      if (__any_sync(FULL_MASK, hit)) break;
      running = __shfl_sync(FULL_MASK, inclusive, BM_WARP_SIZE - 1);
    }
  }
  __syncthreads();
  return *result;
}

struct Selection {
  unsigned int key;   // the selected key
  u64 count_above;    // tokens with a larger key
  u64 mass_above;     // their fixed-point mass
  u64 count_equal;    // tokens with this key
};

struct RadixShared {
  unsigned int count[RADIX_BUCKETS];
  u64 mass[RADIX_BUCKETS];
  u64 bcast[4];
};

// MSD radix select over order_key(x): the key at which the descending cumulative count
// (by_mass false) or mass (true) of the row first reaches target (>= 1; at most the row's total).
__device__ Selection radix_select(const float* x, int vocab, float row_max, bool by_mass, u64 target,
                                  RadixShared* s) {
  const int lane = threadIdx.x % BM_WARP_SIZE;
  unsigned int prefix = 0, mask = 0;
  u64 count_above = 0, mass_above = 0, count_equal = 0;
  for (int shift = 32 - RADIX_BITS; shift >= 0; shift -= RADIX_BITS) {
    for (int b = threadIdx.x; b < RADIX_BUCKETS; b += blockDim.x) {
      s->count[b] = 0;
      s->mass[b] = 0;
    }
    __syncthreads();
    for (int v = threadIdx.x; v < vocab; v += blockDim.x) {
      const float value = x[v];
      const unsigned int key = order_key(value);
      if ((key & mask) == prefix) {
        const unsigned int digit = (key >> shift) & (RADIX_BUCKETS - 1);
        atomicAdd(&s->count[digit], 1u);
        const u64 w = fixed_weight(value, row_max);
        if (w) atomicAdd(&s->mass[digit], w);
      }
    }
    __syncthreads();
    if (threadIdx.x < BM_WARP_SIZE) {
      // lane l owns the 8 buckets 255 - 8l .. 248 - 8l, walked from the top
      const int per_lane = RADIX_BUCKETS / BM_WARP_SIZE;
      const int top = RADIX_BUCKETS - 1 - lane * per_lane;
      u64 lane_count = 0, lane_mass = 0;
      for (int j = 0; j < per_lane; ++j) {
        lane_count += s->count[top - j];
        lane_mass += s->mass[top - j];
      }
      u64 count_before = count_above + warp_inclusive_scan(lane_count) - lane_count;
      u64 mass_before = mass_above + warp_inclusive_scan(lane_mass) - lane_mass;
      const u64 before = by_mass ? mass_before : count_before;
      const u64 mine = by_mass ? lane_mass : lane_count;
      if (before < target && target <= before + mine) {  // exactly one lane
        for (int j = 0; j < per_lane; ++j) {
          const int b = top - j;
          const u64 reached = (by_mass ? mass_before + s->mass[b] : count_before + s->count[b]);
          if (reached >= target) {
            s->bcast[0] = (u64)b;
            s->bcast[1] = count_before;
            s->bcast[2] = mass_before;
            s->bcast[3] = s->count[b];
            break;
          }
          count_before += s->count[b];
          mass_before += s->mass[b];
        }
      }
    }
    __syncthreads();
    prefix |= (unsigned int)s->bcast[0] << shift;
    mask |= (unsigned int)(RADIX_BUCKETS - 1) << shift;
    count_above = s->bcast[1];
    mass_above = s->bcast[2];
    count_equal = s->bcast[3];
    // NOTE: no barrier here: bcast and the histograms are next written after the next pass's first
    // barrier, which every thread reaches only after these reads.
  }
  Selection out = {prefix, count_above, mass_above, count_equal};
  return out;
}

// floor(u * total) exactly, for u = m * 2^-24 (m < 2^24) and total < 2^64.
__device__ __forceinline__ u64 scaled_floor(float u, u64 total) {
  const u64 m = (u64)(u * 16777216.0f);
  return m * (total >> 24) + ((m * (total & 0xffffffull)) >> 24);
}

__device__ __forceinline__ float log_fixed(u64 mass) { return logf((float)mass) - LOG_FIXED_ONE; }

// ---- kernels ------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(1024, 1) greedy_tokens(
    long long* __restrict__ tokens, float* __restrict__ log_probs, const float* __restrict__ logits, int vocab,
    long long row_stride) {
  __shared__ float best_s[MAX_WARPS];
  __shared__ int index_s[MAX_WARPS];
  __shared__ float scratch[MAX_WARPS];
  const float* x = logits + blockIdx.x * row_stride;
  float best = NEG_INF;
  int index = 0x7fffffff;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) {
    if (better(x[v], v, best, index)) {
      best = x[v];
      index = v;
    }
  }
  block_argmax(best, index, best_s, index_s);
  float sum = 0.0f;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) sum += expf(x[v] - best);
  sum = block_reduce_sum(sum, scratch);
  if (threadIdx.x == 0) {
    if (!(best > NEG_INF)) {  // every logit -inf (or NaN): nothing is allowed
      tokens[blockIdx.x] = NO_TOKEN;
      log_probs[blockIdx.x] = NEG_INF;
    } else {
      tokens[blockIdx.x] = index;
      log_probs[blockIdx.x] = (x[index] - best) - logf(sum);
    }
  }
}

extern "C" __global__ void __launch_bounds__(1024, 1) log_softmax_rows(
    float* __restrict__ out, const float* __restrict__ logits, int vocab, long long row_stride) {
  __shared__ float scratch[MAX_WARPS];
  const float* x = logits + blockIdx.x * row_stride;
  float* y = out + (long long)blockIdx.x * vocab;
  float row_max = NEG_INF;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) row_max = fmaxf(row_max, x[v]);
  row_max = block_reduce_max(row_max, scratch);
  float sum = 0.0f;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) sum += expf(x[v] - row_max);
  const float log_sum = logf(block_reduce_sum(sum, scratch));
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) y[v] = (x[v] - row_max) - log_sum;
}

extern "C" __global__ void __launch_bounds__(1024, 1) sample_tokens(
    long long* __restrict__ tokens, float* __restrict__ log_probs, const float* __restrict__ logits,
    const long long* __restrict__ top_k, const float* __restrict__ top_p, const float* __restrict__ uniforms,
    const unsigned char* __restrict__ normalize, int vocab, long long row_stride) {
  __shared__ RadixShared radix;
  __shared__ u64 sums[MAX_WARPS];
  __shared__ float scratch[MAX_WARPS];
  __shared__ int found[2];
  const int row = blockIdx.x;
  const float* x = logits + row * row_stride;

  float row_max = NEG_INF;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) row_max = fmaxf(row_max, x[v]);
  row_max = block_reduce_max(row_max, scratch);
  if (!(row_max > NEG_INF)) {  // block-uniform: no token is allowed (never draw token 0)
    if (threadIdx.x == 0) {
      tokens[row] = NO_TOKEN;
      log_probs[row] = NEG_INF;
    }
    return;
  }
  u64 total = 0;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) total += fixed_weight(x[v], row_max);
  total = block_sum_u64(total, sums);  // >= 2^40: the maximum weighs 1

  const long long k = top_k[row];
  const float p = top_p[row];
  // Kept: key > last_key, and the first `take` tokens (id order) with key == last_key.
  unsigned int last_key = 0;
  u64 take = (u64)vocab, count_equal = (u64)vocab, kept_mass = total;
  if (k > 0 && k < vocab) {
    const Selection sel = radix_select(x, vocab, row_max, false, (u64)k, &radix);
    last_key = sel.key;
    count_equal = sel.count_equal;
    take = (u64)k - sel.count_above;
    kept_mass = sel.mass_above + take * fixed_weight(key_value(sel.key), row_max);
  }
  if (p > 0.0f && p < 1.0f) {
    // Keep a token while the kept mass before it is < p * kept_mass: the nucleus ends at the first
    // token whose inclusive mass reaches ceil(p * kept_mass), always inside the top-k prefix.
    const u64 target = (u64)ceil((double)p * (double)kept_mass);
    const Selection sel = radix_select(x, vocab, row_max, true, target > 0 ? target : 1, &radix);
    const u64 weight = fixed_weight(key_value(sel.key), row_max);  // > 0: the select reached target
    last_key = sel.key;
    count_equal = sel.count_equal;
    take = (target - sel.mass_above + weight - 1) / weight;
    kept_mass = sel.mass_above + take * weight;
  }
  int last_id = vocab - 1;  // the last kept token with key == last_key
  if (take < count_equal) {
    last_id = first_crossing(vocab, [&](int v) { return (u64)(order_key(x[v]) == last_key); }, take - 1, sums,
                             &found[0]);
  }
  const auto kept_weight = [&](int v) -> u64 {
    const unsigned int key = order_key(x[v]);
    return (key > last_key || (key == last_key && v <= last_id)) ? fixed_weight(x[v], row_max) : 0;
  };
  int token = first_crossing(vocab, kept_weight, scaled_floor(uniforms[row], kept_mass), sums, &found[1]);
  if (threadIdx.x == 0) {
    token = min(token, vocab - 1);  // unreachable: the target is below the kept mass
    tokens[row] = token;
    log_probs[row] = (x[token] - row_max) - (normalize[row] ? log_fixed(kept_mass) : log_fixed(total));
  }
}
