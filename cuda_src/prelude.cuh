// Device prelude shared by every kernel source: no CUDA headers, so the same text compiles under
// NVRTC (no include path) and under the CPU emulation shim (cuda_src/emu/shim.h, force-included).
//
// The loader (runtime/kernels/sources.py) inlines this file where a source says
// `#include "prelude.cuh"`, so the whole program is one string (CuPy's cache key sees all of it).
//
// Provides:
//   - storage types: fp16 / bf16 are 16-bit `unsigned short` bit patterns with conversion helpers;
//     `storage_t`, `load_float`, `to_storage` follow the DTYPE define (0 fp32, 1 fp16, 2 bf16)
//   - NEG_INF without <cmath>
//   - warp reductions over a power-of-two group of lanes, and block reductions
//   - better / block_argmax: the (value desc, index asc) order and a block arg-max under it
//   - DYNAMIC_SMEM(T, name): the kernel's dynamic shared memory as a T*
#ifndef BM_PRELUDE_CUH
#define BM_PRELUDE_CUH

#ifndef DTYPE
#define DTYPE 0
#endif

#define FULL_MASK 0xffffffffu
#define BM_WARP_SIZE 32

__device__ __forceinline__ float bm_neg_inf() { return __int_as_float(0xff800000); }
#define NEG_INF (bm_neg_inf())

// ---- 16-bit float storage ----------------------------------------------------------------------
__device__ __forceinline__ float half_to_float(unsigned short h) {
#ifdef BM_EMU
  return emu::half_bits_to_float(h);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#endif
}

__device__ __forceinline__ unsigned short float_to_half(float f) {  // round to nearest even
#ifdef BM_EMU
  return emu::float_to_half_bits(f);
#else
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#endif
}

__device__ __forceinline__ float bf16_to_float(unsigned short h) {
  return __uint_as_float(((unsigned int)h) << 16);
}

__device__ __forceinline__ unsigned short float_to_bf16(float f) {  // round to nearest even
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}

#if DTYPE == 0
typedef float storage_t;
__device__ __forceinline__ float load_float(const storage_t* p) { return *p; }
__device__ __forceinline__ storage_t to_storage(float x) { return x; }
#elif DTYPE == 1
typedef unsigned short storage_t;
__device__ __forceinline__ float load_float(const storage_t* p) { return half_to_float(*p); }
__device__ __forceinline__ storage_t to_storage(float x) { return float_to_half(x); }
#elif DTYPE == 2
typedef unsigned short storage_t;
__device__ __forceinline__ float load_float(const storage_t* p) { return bf16_to_float(*p); }
__device__ __forceinline__ storage_t to_storage(float x) { return float_to_bf16(x); }
#else
#error "DTYPE must be 0 (fp32), 1 (fp16) or 2 (bf16)"
#endif

__device__ __forceinline__ float fast_exp(float x) {
#ifdef BM_EMU
  return expf(x);
#else
  return __expf(x);
#endif
}

// ---- reductions ----------------------------------------------------------------------------------
// Every lane of the warp must call these (full-mask shuffles); `width` is a power of two <= 32 and
// the result is reduced within each aligned group of `width` lanes, available to all of them.
__device__ __forceinline__ float group_reduce_sum(float v, int width) {
  for (int offset = width >> 1; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
  return v;
}

__device__ __forceinline__ float group_reduce_max(float v, int width) {
  for (int offset = width >> 1; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
  return v;
}

__device__ __forceinline__ float warp_reduce_sum(float v) { return group_reduce_sum(v, BM_WARP_SIZE); }
__device__ __forceinline__ float warp_reduce_max(float v) { return group_reduce_max(v, BM_WARP_SIZE); }

// Block-wide reductions: every thread calls; blockDim.x a multiple of 32; `scratch` holds at least
// blockDim.x / 32 floats of shared memory. Returns the result to every thread. Ends with a barrier,
// so scratch may be reused right after.
__device__ __forceinline__ float block_reduce_sum(float v, float* scratch) {
  const int lane = threadIdx.x % BM_WARP_SIZE, warp = threadIdx.x / BM_WARP_SIZE;
  const int num_warps = blockDim.x / BM_WARP_SIZE;
  v = warp_reduce_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < num_warps; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

__device__ __forceinline__ float block_reduce_max(float v, float* scratch) {
  const int lane = threadIdx.x % BM_WARP_SIZE, warp = threadIdx.x / BM_WARP_SIZE;
  const int num_warps = blockDim.x / BM_WARP_SIZE;
  v = warp_reduce_max(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float best = NEG_INF;
  for (int w = 0; w < num_warps; ++w) best = fmaxf(best, scratch[w]);
  __syncthreads();
  return best;
}

// ---- (value desc, index asc) order and the block arg-max under it ------------------------------
__device__ __forceinline__ bool better(float value, int index, float other_value, int other_index) {
  return value > other_value || (value == other_value && index < other_index);
}

// Block argmax of (value, index) under `better` (values_s / indices_s: blockDim.x / 32 entries of
// shared memory): every thread calls; the winner goes to every
// thread (NO_INDEX when no thread offered one). Ends with a barrier.
__device__ __forceinline__ void block_argmax(float& value, int& index, float* values_s, int* indices_s) {
  for (int offset = BM_WARP_SIZE / 2; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(FULL_MASK, value, offset);
    const int other_index = __shfl_xor_sync(FULL_MASK, index, offset);
    if (better(other, other_index, value, index)) {
      value = other;
      index = other_index;
    }
  }
  if (threadIdx.x % BM_WARP_SIZE == 0) {
    values_s[threadIdx.x / BM_WARP_SIZE] = value;
    indices_s[threadIdx.x / BM_WARP_SIZE] = index;
  }
  __syncthreads();
  value = values_s[0];
  index = indices_s[0];
  for (int w = 1; w < (int)blockDim.x / BM_WARP_SIZE; ++w) {
    if (better(values_s[w], indices_s[w], value, index)) {
      value = values_s[w];
      index = indices_s[w];
    }
  }
  __syncthreads();
}

// ---- dynamic shared memory ------------------------------------------------------------------------
#ifdef BM_EMU
#define DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(emu::dynamic_smem())
#else
#define DYNAMIC_SMEM(T, name)                                         \
  extern __shared__ __align__(16) unsigned char name##_bytes[];      \
  T* name = reinterpret_cast<T*>(name##_bytes)
#endif

// a * b rounded on its own: NVRTC would otherwise contract `x - f * c` into one FMA, which rounds
// differently from the torch reference.
__device__ __forceinline__ float mul_rn(float a, float b) {
#ifdef BM_EMU
  return a * b;
#else
  return __fmul_rn(a, b);
#endif
}

#endif  // BM_PRELUDE_CUH
