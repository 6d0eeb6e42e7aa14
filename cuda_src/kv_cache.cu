// KV-cache writes and block copies over the paged pool (torch references: TorchKernels.write_kv,
// TorchKernels.copy_blocks).
//
// Launch contract
//   write_kv:     grid (num_tokens), block (any multiple of 32, <= 1024), no shared memory.
//                 k_cache, v_cache storage_t [num_blocks, tokens_per_block, num_kv_heads, head_dim]
//                 (contiguous, one layer); k, v storage_t [num_tokens, num_kv_heads, head_dim] whose
//                 [num_kv_heads, head_dim] rows are contiguous, tokens `*_token_stride` elements
//                 apart (views of a fused QKV are fine); slot_mapping int64 [num_tokens]
//                 (block * tokens_per_block + offset; a negative slot skips its token).
//   copy_blocks:  grid (num_pairs, num_planes), block (any multiple of 32, <= 1024), no shared memory.
//                 kv_pool storage_t [num_planes = num_layers * 2, num_blocks, block_elems]
//                 (contiguous); src_block_ids, dst_block_ids int64 [num_pairs]. Destinations are
//                 distinct and no destination is also a source (copy-on-write into fresh blocks).
//   write_kv_quant: an int8 cache (runtime/kernels/kv_quant.py): grid (num_tokens), block (a
//                 multiple of 32, <= 1024), no shared memory; one warp per (token, KV head) row.
//                 k_cache, v_cache int8 [num_blocks, tokens_per_block, num_kv_heads, head_dim];
//                 k_scales, v_scales float32 [num_blocks, tokens_per_block, num_kv_heads]
//                 (contiguous); k, v, slot_mapping as write_kv. Row x -> scale = max|x| / 127,
//                 q = clamp(rint(x / scale), -127, 127) (0 where scale == 0), IEEE division.
//   copy_blocks also moves int8 pools and the scale pools: the launcher views them as storage_t.
//   dtypes:       storage_t per DTYPE (0 fp32, 1 fp16, 2 bf16); these kernels only move elements
//                 (write_kv_quant reads storage_t and computes in float32).
#include "prelude.cuh"

extern "C" __global__ void write_kv(storage_t* __restrict__ k_cache, storage_t* __restrict__ v_cache,
                                    const storage_t* __restrict__ k, const storage_t* __restrict__ v,
                                    const long long* __restrict__ slot_mapping, int row_elems,
                                    long long k_token_stride, long long v_token_stride) {
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;
  storage_t* k_dst = k_cache + slot * row_elems;
  storage_t* v_dst = v_cache + slot * row_elems;
  const storage_t* k_src = k + token * k_token_stride;
  const storage_t* v_src = v + token * v_token_stride;
  for (int i = threadIdx.x; i < row_elems; i += blockDim.x) {
    k_dst[i] = k_src[i];
    v_dst[i] = v_src[i];
  }
}

// One (token, head) row of write_kv_quant, by one warp.
__device__ __forceinline__ void quantize_row(signed char* __restrict__ dst, float* __restrict__ scale_dst,
                                             const storage_t* __restrict__ src, int head_dim, int lane) {
  float amax = 0.0f;
  for (int d = lane; d < head_dim; d += BM_WARP_SIZE) amax = fmaxf(amax, fabsf(load_float(src + d)));
  amax = warp_reduce_max(amax);
  const float scale = amax / 127.0f;
  for (int d = lane; d < head_dim; d += BM_WARP_SIZE) {
    const float q = scale > 0.0f ? fminf(fmaxf(rintf(load_float(src + d) / scale), -127.0f), 127.0f) : 0.0f;
    dst[d] = (signed char)(int)q;
  }
  if (lane == 0) *scale_dst = scale;
}

extern "C" __global__ void write_kv_quant(signed char* __restrict__ k_cache, signed char* __restrict__ v_cache,
                                          float* __restrict__ k_scales, float* __restrict__ v_scales,
                                          const storage_t* __restrict__ k, const storage_t* __restrict__ v,
                                          const long long* __restrict__ slot_mapping, int num_kv_heads,
                                          int head_dim, long long k_token_stride, long long v_token_stride) {
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;
  const int lane = threadIdx.x % BM_WARP_SIZE, warp = threadIdx.x / BM_WARP_SIZE;
  const int num_warps = blockDim.x / BM_WARP_SIZE;
  for (int row = warp; row < 2 * num_kv_heads; row += num_warps) {  // warp-uniform: K heads, then V heads
    const bool is_v = row >= num_kv_heads;
    const int head = is_v ? row - num_kv_heads : row;
    const long long dst_row = slot * num_kv_heads + head;
    if (is_v)
      quantize_row(v_cache + dst_row * head_dim, v_scales + dst_row, v + token * v_token_stride + head * head_dim,
                   head_dim, lane);
    else
      quantize_row(k_cache + dst_row * head_dim, k_scales + dst_row, k + token * k_token_stride + head * head_dim,
                   head_dim, lane);
  }
}

extern "C" __global__ void copy_blocks(storage_t* __restrict__ kv_pool, const long long* __restrict__ src_block_ids,
                                       const long long* __restrict__ dst_block_ids, long long num_blocks,
                                       long long block_elems) {
  const long long pair = blockIdx.x;
  const long long plane = blockIdx.y;
  storage_t* base = kv_pool + plane * num_blocks * block_elems;
  const storage_t* src = base + src_block_ids[pair] * block_elems;
  storage_t* dst = base + dst_block_ids[pair] * block_elems;
  for (long long i = threadIdx.x; i < block_elems; i += blockDim.x) dst[i] = src[i];
}
