// One request's beam-search candidates: the num_candidates best continuations of its beams.
// Torch reference: TorchKernels.beam_candidates (runtime/kernels/torch_kernels/torch_decoder.py).
//
// score(b, v) = log_probs[b, v] + running_scores[b] (float32). Order: score descending, ties by the
// lower token id. Stage 1 takes each beam's first per_beam = min(num_candidates, vocab) tokens in
// that order; stage 2 ranks candidate r of beam b by score - diversity_rate * r (both roundings
// separate, as torch does; with a zero rate the rank is the score) and keeps the num_candidates
// best, ties by the lower (b, r), which is the lower flat index b * vocab + v of the plain top-k.
// Both stages are iterative block argmaxes (each round finds the best element strictly after the
// previous winner in the order, so nothing is written back to the input): per_beam rounds over
// the vocabulary, then num_candidates rounds over the num_beams * per_beam candidates.
//
// Launch contract
//   beam_topk_per_beam: grid (num_beams), block (any multiple of 32, <= 1024), no dynamic shared
//     memory. log_probs float32 [num_beams, vocab] (contiguous), running_scores float32 [num_beams]
//     -> cand_scores float32 [num_beams, per_beam], cand_tokens int32 [num_beams, per_beam] (best
//     first per beam).
//   beam_select: grid (1), block (any multiple of 32, <= 1024), no dynamic shared memory. Reads the
//     stage-1 candidates -> scores float32, parents int64, tokens int64 [num_candidates], best first.
//   Launch bounds (1024, 1) keep every block size up to 1024 launchable.
//   dtypes: float32 whatever DTYPE says (the define is ignored).
#include "prelude.cuh"

#define MAX_WARPS 32
#define NO_INDEX 0x7fffffff


extern "C" __global__ void __launch_bounds__(1024, 1) beam_topk_per_beam(
    float* __restrict__ cand_scores, int* __restrict__ cand_tokens, const float* __restrict__ log_probs,
    const float* __restrict__ running_scores, int vocab, int per_beam) {
  __shared__ float values_s[MAX_WARPS];
  __shared__ int indices_s[MAX_WARPS];
  const int beam = blockIdx.x;
  const float* row = log_probs + (long long)beam * vocab;
  const float running = running_scores[beam];
  float last = __int_as_float(0x7f800000);  // +inf, index -1: everything comes after it
  int last_index = -1;
  for (int r = 0; r < per_beam; ++r) {
    float best = NEG_INF;
    int index = NO_INDEX;
    for (int v = threadIdx.x; v < vocab; v += blockDim.x) {
      const float score = row[v] + running;
      if (better(last, last_index, score, v) && better(score, v, best, index)) {
        best = score;
        index = v;
      }
    }
    block_argmax(best, index, values_s, indices_s);
    if (threadIdx.x == 0) {
      cand_scores[beam * per_beam + r] = best;
      cand_tokens[beam * per_beam + r] = index == NO_INDEX ? 0 : index;
    }
    last = best;
    last_index = index;
  }
}

extern "C" __global__ void __launch_bounds__(1024, 1) beam_select(
    float* __restrict__ scores, long long* __restrict__ parents, long long* __restrict__ tokens,
    const float* __restrict__ cand_scores, const int* __restrict__ cand_tokens, int num_beams, int per_beam,
    int num_candidates, float diversity_rate) {
  __shared__ float values_s[MAX_WARPS];
  __shared__ int indices_s[MAX_WARPS];
  const int total = num_beams * per_beam;
  float last = __int_as_float(0x7f800000);
  int last_index = -1;
  for (int c = 0; c < num_candidates; ++c) {
    float best = NEG_INF;
    int index = NO_INDEX;
    for (int i = threadIdx.x; i < total; i += blockDim.x) {
      const float rank = cand_scores[i] - mul_rn(diversity_rate, (float)(i % per_beam));
      if (better(last, last_index, rank, i) && better(rank, i, best, index)) {
        best = rank;
        index = i;
      }
    }
    block_argmax(best, index, values_s, indices_s);
    if (threadIdx.x == 0) {
      const int i = index == NO_INDEX ? 0 : index;
      scores[c] = cand_scores[i];
      parents[c] = i / per_beam;
      tokens[c] = cand_tokens[i];
    }
    last = best;
    last_index = index;
  }
}
