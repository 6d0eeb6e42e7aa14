// Philox4x32-10 draws keyed by (seed, step, beam): bit-identical to runtime/rng.py (the torch
// reference TorchKernels.uniforms calls it). 32-bit integer arithmetic only; the uniform is
// (x0 >> 8) * 2^-24, an exact float32.
//
// Launch contract
//   philox_uniforms: grid (ceil(n / block)), block (any multiple of 32, <= 1024), no shared memory.
//                    seeds int64 [n] (uint64 bit patterns: key = (low 32 bits, high 32 bits)),
//                    steps, beams int64 [n] (counter = (step mod 2^32, beam mod 2^32, lane, 0));
//                    writes out float32 [n] in [0, 1).
//   philox4x32_raw:  grid (ceil(n / block)), block (any multiple of 32, <= 1024), no shared memory.
//                    counters uint32 [n, 4], keys uint32 [n, 2] -> out uint32 [n, 4] (the raw block
//                    function, for Random123's known-answer tests).
//   dtypes:          none of the storage types; DTYPE is ignored.
#include "prelude.cuh"

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u
#define PHILOX_ROUNDS 10

__device__ __forceinline__ void philox4x32_10(unsigned int c[4], unsigned int k0, unsigned int k1) {
  for (int round = 0; round < PHILOX_ROUNDS; ++round) {
    if (round) {
      k0 += PHILOX_W0;
      k1 += PHILOX_W1;
    }
    const unsigned long long p0 = (unsigned long long)c[0] * PHILOX_M0;
    const unsigned long long p1 = (unsigned long long)c[2] * PHILOX_M1;
    const unsigned int hi0 = (unsigned int)(p0 >> 32), lo0 = (unsigned int)p0;
    const unsigned int hi1 = (unsigned int)(p1 >> 32), lo1 = (unsigned int)p1;
    const unsigned int c1 = c[1], c3 = c[3];
    c[0] = hi1 ^ c1 ^ k0;
    c[1] = lo1;
    c[2] = hi0 ^ c3 ^ k1;
    c[3] = lo0;
  }
}

extern "C" __global__ void philox_uniforms(float* __restrict__ out, const long long* __restrict__ seeds,
                                           const long long* __restrict__ steps,
                                           const long long* __restrict__ beams, int n, int lane) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const unsigned long long seed = (unsigned long long)seeds[i];
  unsigned int c[4] = {(unsigned int)(unsigned long long)steps[i], (unsigned int)(unsigned long long)beams[i],
                       (unsigned int)lane, 0u};
  philox4x32_10(c, (unsigned int)seed, (unsigned int)(seed >> 32));
  out[i] = (float)(c[0] >> 8) * 5.9604644775390625e-08f;  // 2^-24: exact
}

extern "C" __global__ void philox4x32_raw(unsigned int* __restrict__ out, const unsigned int* __restrict__ counters,
                                          const unsigned int* __restrict__ keys, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  unsigned int c[4] = {counters[4 * i], counters[4 * i + 1], counters[4 * i + 2], counters[4 * i + 3]};
  philox4x32_10(c, keys[2 * i], keys[2 * i + 1]);
  for (int j = 0; j < 4; ++j) out[4 * i + j] = c[j];
}
