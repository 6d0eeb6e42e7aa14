// Beyond the seeds' decoding: the guided-decoding token bitmask and min-p (filters applied in
// place to processed logits, before sampling), and each row's k most likely tokens with their
// log probs. Torch references: TorchKernels.apply_token_bitmask, TorchKernels.apply_min_p,
// TorchKernels.top_log_probs (runtime/kernels/torch_kernels/torch_decoder.py).
//
// Launch contract
//   apply_token_bitmask: grid (n), block (any multiple of 32, <= 1024), no shared memory.
//     Rows `rows[i]` (int64 [n], distinct) of logits float32 [num_rows, row_stride] (unit column
//     stride, vocab columns used): x_v = -inf unless bit (v % 32) of bitmask[i, v / 32] is set;
//     bitmask int32 [n, words], words >= ceil(vocab / 32) (llguidance's packed layout; the bits
//     past vocab are ignored).
//   apply_min_p: grid (n), block as above, no dynamic shared memory. Rows `rows[i]`; min_p float32
//     [n]: x_v = -inf where expf(x_v - max_v x_v) < min_p[i] (the top token always stays; a row
//     of -inf stays as it is).
//   top_log_probs: grid (num_rows), block as above, no dynamic shared memory. -> values float32
//     [num_rows, k], ids int64 [num_rows, k]: the k largest log-softmax values of each row,
//     descending, ties to the lower id (1 <= k <= vocab). k rounds of a block arg-max over the
//     tokens strictly after the previous pick in (value desc, id asc) order: O(k * vocab) per row,
//     meant for the few top log probs a response carries.
//   dtypes: logits float32 whatever DTYPE says (the define is ignored).
#include "prelude.cuh"

#define MAX_WARPS 32

extern "C" __global__ void apply_token_bitmask(float* __restrict__ logits, const long long* __restrict__ rows,
                                               const int* __restrict__ bitmask, int words, int vocab,
                                               long long row_stride) {
  float* x = logits + rows[blockIdx.x] * row_stride;
  const unsigned int* mask = reinterpret_cast<const unsigned int*>(bitmask) + (long long)blockIdx.x * words;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) {
    if (!((mask[v >> 5] >> (v & 31)) & 1u)) x[v] = NEG_INF;
  }
}

extern "C" __global__ void __launch_bounds__(1024, 1) apply_min_p(float* __restrict__ logits,
                                                                  const long long* __restrict__ rows,
                                                                  const float* __restrict__ min_p, int vocab,
                                                                  long long row_stride) {
  __shared__ float scratch[MAX_WARPS];
  float* x = logits + rows[blockIdx.x] * row_stride;
  float row_max = NEG_INF;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) row_max = fmaxf(row_max, x[v]);
  row_max = block_reduce_max(row_max, scratch);
  if (row_max == NEG_INF) return;
  const float threshold = min_p[blockIdx.x];
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) {
    if (expf(x[v] - row_max) < threshold) x[v] = NEG_INF;
  }
}

extern "C" __global__ void __launch_bounds__(1024, 1) top_log_probs(
    float* __restrict__ values, long long* __restrict__ ids, const float* __restrict__ logits, int k, int vocab,
    long long row_stride) {
  __shared__ float scratch[MAX_WARPS];
  __shared__ float best_s[MAX_WARPS];
  __shared__ int index_s[MAX_WARPS];
  const float* x = logits + blockIdx.x * row_stride;
  float row_max = NEG_INF;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) row_max = fmaxf(row_max, x[v]);
  row_max = block_reduce_max(row_max, scratch);
  float sum = 0.0f;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) sum += expf(x[v] - row_max);
  const float log_sum = logf(block_reduce_sum(sum, scratch));
  float last_value = __int_as_float(0x7f800000);   // +inf: nothing picked yet
  int last_index = -1;
  for (int j = 0; j < k; ++j) {
    float best = NEG_INF;
    int index = 0x7fffffff;
    for (int v = threadIdx.x; v < vocab; v += blockDim.x) {
      const float value = x[v];
      if (better(last_value, last_index, value, v) && better(value, v, best, index)) {
        best = value;
        index = v;
      }
    }
    block_argmax(best, index, best_s, index_s);   // ends with a barrier: best_s is free again
    if (threadIdx.x == 0) {
      values[(long long)blockIdx.x * k + j] = (best - row_max) - log_sum;
      ids[(long long)blockIdx.x * k + j] = index;
    }
    last_value = best;
    last_index = index;
  }
}
