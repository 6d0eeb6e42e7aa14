// Logits processing in place: embedding bias, temperature, repetition / presence / frequency
// penalties, the min-length ban of the end id (apply_penalties), and (row, token) bans for bad
// words and no-repeat n-grams (ban_tokens). Torch references: TorchKernels.apply_penalties,
// TorchKernels.ban_tokens (runtime/kernels/torch_kernels/torch_decoder.py; semantics in runtime/decoding_params.py).
//
// Per logit, in TensorRT-LLM's order and with torch's float32 roundings (no contraction into FMAs):
//   x += bias; x /= temperature; if count > 0: x = x > 0 ? x / rep : x * rep; x -= presence;
//   x -= frequency * count; x = -inf for the end id while num_generated < min_length.
// count = occurrences of the token in token_ids[i, :token_lengths[i]] (prompt + generated).
//
// Launch contract
//   apply_penalties: grid (n), block (any multiple of 32, <= 1024; launch bounds (1024, 1)), no dynamic
//     shared memory.
//     One CTA per selected row: logits float32 rows `rows[i]` (int64 [n], distinct) of a
//     [num_rows, row_stride] matrix (unit column stride, vocab columns used); counts int32 [n, vocab]
//     is workspace (overwritten: the row's token histogram); token_ids int64 [n, max_len];
//     token_lengths int64 [n]; embedding_bias float32 [n, vocab] or NULL; temperature,
//     repetition, presence, frequency float32 [n]; min_lengths, num_generated, end_ids int64 [n]
//     (end id -1: none). Token ids outside [0, vocab) are not counted.
//   ban_tokens: grid (ceil(num_pairs / block)), block (any multiple of 32, <= 1024), no shared memory.
//     logits[row_ids[i], token_ids[i]] = -inf (int64 [num_pairs] each); pairs outside the
//     [num_rows, vocab] matrix are skipped.
//   dtypes: logits float32 whatever DTYPE says (the define is ignored).
#include "prelude.cuh"


extern "C" __global__ void __launch_bounds__(1024, 1) apply_penalties(
    float* __restrict__ logits, int* __restrict__ counts, const long long* __restrict__ rows,
    const long long* __restrict__ token_ids, const long long* __restrict__ token_lengths,
    const float* __restrict__ embedding_bias, const float* __restrict__ temperature,
    const float* __restrict__ repetition, const float* __restrict__ presence, const float* __restrict__ frequency,
    const long long* __restrict__ min_lengths, const long long* __restrict__ num_generated,
    const long long* __restrict__ end_ids, int vocab, long long row_stride, int max_len) {
  const int i = blockIdx.x;
  float* x = logits + rows[i] * row_stride;
  int* count = counts + (long long)i * vocab;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) count[v] = 0;
  __syncthreads();
  const long long* tokens = token_ids + (long long)i * max_len;
  const int length = (int)min(token_lengths[i], (long long)max_len);
  for (int j = threadIdx.x; j < length; j += blockDim.x) {
    const long long token = tokens[j];
    if (token >= 0 && token < vocab) atomicAdd(&count[token], 1);
  }
  __syncthreads();  // also orders the global histogram writes before the reads below
  const float* bias = embedding_bias ? embedding_bias + (long long)i * vocab : nullptr;
  const float temp = temperature[i], rep = repetition[i], pres = presence[i], freq = frequency[i];
  const long long end_id = end_ids[i];
  const bool ban_end = end_id >= 0 && num_generated[i] < min_lengths[i];
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) {
    float value = x[v];
    if (bias) value += bias[v];
    value /= temp;
    const int c = count[v];
    if (c > 0) {
      value = value > 0.0f ? value / rep : mul_rn(value, rep);
      value -= pres;
      value -= mul_rn(freq, (float)c);
    }
    if (ban_end && v == end_id) value = NEG_INF;
    x[v] = value;
  }
}

extern "C" __global__ void ban_tokens(float* __restrict__ logits, const long long* __restrict__ row_ids,
                                      const long long* __restrict__ token_ids, int num_pairs, long long num_rows,
                                      int vocab, long long row_stride) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= num_pairs) return;
  const long long row = row_ids[i], token = token_ids[i];
  if (row >= 0 && row < num_rows && token >= 0 && token < vocab) logits[row * row_stride + token] = NEG_INF;
}
