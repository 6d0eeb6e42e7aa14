// Paged decode attention (one query per sequence) over the block pool, split into partitions of
// the visible keys and merged with an online-softmax rescale (flash-decoding). Torch reference:
// TorchKernels.decode_attention.
//
// Visibility: the query sits at position L - 1 (L = seq_lens[seq]); key k is visible iff k < L and
// (window == 0 or k >= L - window or k < sink). The visible keys are enumerated as
//   j in [0, n_sink)          -> position j               (sink tokens before the window)
//   j in [n_sink, n_visible)  -> position lo + j - n_sink (the window, lo = max(L - window, 0))
// with n_sink = min(sink, lo). Partition p covers j in [p * partition_size, (p + 1) * partition_size);
// only blocks holding a visible key are read, so other block-table entries may be negative.
//
// ALiBi (alibi_slopes != NULL): the logit of query head h for the key at position pos gains
// alibi_slopes[h] * (pos - (L - 1)), added after the scale (BLOOM's bias, in its relative form:
// <= 0 for every visible key, so the running maximum stays near the largest score).
//
// Launch contract
//   decode_attention_partition:
//     grid (num_partitions, num_kv_heads, batch), block (NUM_THREADS), dynamic shared memory
//     decode_smem_bytes(group, head_dim, tile_size) (see runtime/kernels/cuda/launchers.py).
//     One CTA serves the `group = num_heads / num_kv_heads` query heads of one KV head over
//     `partition_size` visible keys, so each K/V row is loaded once per group; it walks them in
//     tiles of `tile_size` keys (shared memory) merged with an online softmax. THREADS_PER_KEY lanes
//     (a power of two <= 32) share one key's dot products.
//     q       storage_t [batch, num_heads, head_dim]                       contiguous
//     k/v     storage_t [num_blocks, tokens_per_block, num_kv_heads, head_dim] contiguous (one layer)
//     block_tables int32 [batch, table_stride]; seq_lens int32 [batch] (>= 1)
//     alibi_slopes float32 [num_heads] or NULL (no ALiBi)
//     num_partitions == 1: writes out storage_t [batch, num_heads, head_dim] directly.
//     num_partitions > 1:  writes part_acc float32 [batch, num_heads, num_partitions, head_dim]
//                          (unnormalised sum of p * v), part_max / part_sum float32
//                          [batch, num_heads, num_partitions] (part_sum == 0: empty partition).
//   decode_attention_merge:
//     grid (num_heads, batch), block (any multiple of 32), no shared memory; reads the partials,
//     writes out storage_t [batch, num_heads, head_dim].
//   decode_attention_partition_int8: the same over an int8 cache (runtime/kernels/kv_quant.py):
//     k/v     int8 [num_blocks, tokens_per_block, num_kv_heads, head_dim]  contiguous (one layer)
//     k_scales/v_scales float32 [num_blocks, tokens_per_block, num_kv_heads] contiguous; a key row
//     reads as q * its scale (the scale applied to the row's dot product / probability). q and
//     out stay storage_t; dynamic shared memory decode_smem_bytes(..., quantized=True) (two more
//     floats per tile key: the tile's K and V scales).
//   dtypes: storage_t per DTYPE (0 fp32, 1 fp16, 2 bf16); all arithmetic in float32.
#include "prelude.cuh"

#ifndef NUM_THREADS
#define NUM_THREADS 128
#endif
#ifndef THREADS_PER_KEY
#define THREADS_PER_KEY 4
#endif

__device__ __forceinline__ float load_cache(const storage_t* p) { return load_float(p); }
__device__ __forceinline__ float load_cache(const signed char* p) { return (float)*p; }

// The partition kernel over a cache of cache_t; k_scales == nullptr: an unquantized cache.
template <typename cache_t>
__device__ __forceinline__ void decode_partition(
    storage_t* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_max,
    float* __restrict__ part_sum, const storage_t* __restrict__ q, const cache_t* __restrict__ k_cache,
    const cache_t* __restrict__ v_cache, const float* __restrict__ k_scales, const float* __restrict__ v_scales,
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
    const float* __restrict__ alibi_slopes, int num_heads, int num_kv_heads, int head_dim, int tokens_per_block,
    int table_stride, int partition_size, int tile_size, float scale, int window, int sink) {
  const int partition = blockIdx.x, kv_head = blockIdx.y, seq = blockIdx.z;
  const int num_partitions = gridDim.x;
  const int group = num_heads / num_kv_heads;
  const int first_head = kv_head * group;
  const long long head_base = (long long)seq * num_heads + first_head;  // first query head of the group
  const int seq_len = seq_lens[seq];
  const int lo = window > 0 ? max(seq_len - window, 0) : 0;
  const int n_sink = window > 0 ? min(sink, lo) : 0;
  const int n_visible = n_sink + seq_len - lo;
  const int begin = partition * partition_size;
  const int n_keys = min(begin + partition_size, n_visible) - begin;  // keys of this partition
  if (n_keys <= 0) {  // block-uniform: no visible key here (seq_len >= 1 makes that num_partitions > 1)
    if (num_partitions == 1) {  // defensive, seq_len < 1: zeros rather than a write through NULL
      for (int i = threadIdx.x; i < group * head_dim; i += blockDim.x) out[head_base * head_dim + i] = to_storage(0.0f);
      return;
    }
    for (int h = threadIdx.x; h < group; h += blockDim.x) {
      part_max[(head_base + h) * num_partitions + partition] = NEG_INF;
      part_sum[(head_base + h) * num_partitions + partition] = 0.0f;
    }
    return;
  }

  DYNAMIC_SMEM(float, smem);
  float* q_s = smem;                                   // [group, head_dim], pre-scaled
  float* acc_s = q_s + group * head_dim;               // [group, head_dim]: running sum of p * v
  float* probs = acc_s + group * head_dim;             // [group, tile_size]: logits, then exp
  float* stats = probs + group * tile_size;            // [3, group]: running max, running sum, rescale
  const int floats = 2 * group * head_dim + group * tile_size + 3 * group;
  long long* rows = reinterpret_cast<long long*>(smem + floats + (floats & 1));
  // rows [tile_size]: element offset of each key's [head_dim] row for this KV head
  float* k_scale_s = reinterpret_cast<float*>(rows + tile_size);  // [tile_size] (quantized cache only)
  float* v_scale_s = k_scale_s + tile_size;                        // [tile_size] (quantized cache only)

  const long long row_elems = (long long)num_kv_heads * head_dim;
  const storage_t* q_seq = q + head_base * head_dim;
  for (int i = threadIdx.x; i < group * head_dim; i += blockDim.x) {
    q_s[i] = load_float(q_seq + i) * scale;
    acc_s[i] = 0.0f;
  }
  for (int h = threadIdx.x; h < group; h += blockDim.x) {
    stats[h] = NEG_INF;
    stats[group + h] = 0.0f;
  }
  const int* table = block_tables + (long long)seq * table_stride;
  const int key_lane = threadIdx.x % THREADS_PER_KEY;
  const int keys_per_step = blockDim.x / THREADS_PER_KEY;
  const int lane = threadIdx.x % BM_WARP_SIZE, warp = threadIdx.x / BM_WARP_SIZE;

  // Tiles of the partition's keys, merged with an online softmax; every loop bound below is
  // block-uniform (barriers) or warp-uniform (shuffles).
  for (int tile = 0; tile < n_keys; tile += tile_size) {
    const int n = min(tile_size, n_keys - tile);
    for (int jj = threadIdx.x; jj < n; jj += blockDim.x) {
      const int j = begin + tile + jj;
      const int pos = j < n_sink ? j : lo + (j - n_sink);
      const long long block = table[pos / tokens_per_block];
      rows[jj] = (block * tokens_per_block + pos % tokens_per_block) * row_elems + (long long)kv_head * head_dim;
      if (k_scales != nullptr) {
        const long long scale_index = (block * tokens_per_block + pos % tokens_per_block) * num_kv_heads + kv_head;
        k_scale_s[jj] = k_scales[scale_index];
        v_scale_s[jj] = v_scales[scale_index];
      }
    }
    __syncthreads();

    // QK: THREADS_PER_KEY lanes per key.
    for (int base = 0; base < n; base += keys_per_step) {
      const int jj = base + threadIdx.x / THREADS_PER_KEY;
      const bool valid = jj < n;
      const cache_t* k_row = k_cache + (valid ? rows[jj] : 0);
      const float k_scale = (k_scales != nullptr && valid) ? k_scale_s[jj] : 1.0f;
      const int j = begin + tile + jj;
      const float distance = (float)((j < n_sink ? j : lo + (j - n_sink)) - (seq_len - 1));  // key - query pos
      for (int h = 0; h < group; ++h) {
        float dot = 0.0f;
        if (valid)
          for (int d = key_lane; d < head_dim; d += THREADS_PER_KEY)
            dot += q_s[h * head_dim + d] * load_cache(k_row + d);
        dot = group_reduce_sum(dot, THREADS_PER_KEY);
        if (k_scales != nullptr) dot *= k_scale;
        if (alibi_slopes != nullptr) dot += alibi_slopes[first_head + h] * distance;
        if (valid && key_lane == 0) probs[h * tile_size + jj] = dot;
      }
    }
    __syncthreads();

    // Online softmax: one warp per query head.
    for (int h = warp; h < group; h += blockDim.x / BM_WARP_SIZE) {
      float* row = probs + h * tile_size;
      float m = stats[h];
      for (int jj = lane; jj < n; jj += BM_WARP_SIZE) m = fmaxf(m, row[jj]);
      m = warp_reduce_max(m);
      float s = 0.0f;
      for (int jj = lane; jj < n; jj += BM_WARP_SIZE) {
        const float e = fast_exp(row[jj] - m);
        row[jj] = e;
        s += e;
      }
      s = warp_reduce_sum(s);
      if (lane == 0) {
        const float rescale = fast_exp(stats[h] - m);  // 0 on the first tile (max was -inf)
        stats[h] = m;
        stats[group + h] = stats[group + h] * rescale + s;
        stats[2 * group + h] = rescale;
      }
    }
    __syncthreads();

    // PV: each (head, dim) element belongs to one thread across tiles; consecutive threads read
    // consecutive dims of a V row.
    for (int item = threadIdx.x; item < group * head_dim; item += blockDim.x) {
      const int h = item / head_dim, d = item % head_dim;
      const float* p = probs + h * tile_size;
      float acc = 0.0f;
      if (v_scales != nullptr)
        for (int jj = 0; jj < n; ++jj) acc += p[jj] * v_scale_s[jj] * load_cache(v_cache + rows[jj] + d);
      else
        for (int jj = 0; jj < n; ++jj) acc += p[jj] * load_cache(v_cache + rows[jj] + d);
      acc_s[item] = acc_s[item] * stats[2 * group + h] + acc;
    }
    __syncthreads();  // the next tile overwrites rows and probs
  }

  for (int item = threadIdx.x; item < group * head_dim; item += blockDim.x) {
    const int h = item / head_dim, d = item % head_dim;
    if (num_partitions == 1) {
      out[(head_base + h) * head_dim + d] = to_storage(acc_s[item] / stats[group + h]);
    } else {
      part_acc[((head_base + h) * num_partitions + partition) * head_dim + d] = acc_s[item];
      if (d == 0) {
        part_max[(head_base + h) * num_partitions + partition] = stats[h];
        part_sum[(head_base + h) * num_partitions + partition] = stats[group + h];
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS) decode_attention_partition(
    storage_t* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_max,
    float* __restrict__ part_sum, const storage_t* __restrict__ q, const storage_t* __restrict__ k_cache,
    const storage_t* __restrict__ v_cache, const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
    const float* __restrict__ alibi_slopes, int num_heads, int num_kv_heads, int head_dim, int tokens_per_block,
    int table_stride, int partition_size, int tile_size, float scale, int window, int sink) {
  decode_partition<storage_t>(out, part_acc, part_max, part_sum, q, k_cache, v_cache, nullptr, nullptr, block_tables,
                              seq_lens, alibi_slopes, num_heads, num_kv_heads, head_dim, tokens_per_block,
                              table_stride, partition_size, tile_size, scale, window, sink);
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS) decode_attention_partition_int8(
    storage_t* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_max,
    float* __restrict__ part_sum, const storage_t* __restrict__ q, const signed char* __restrict__ k_cache,
    const signed char* __restrict__ v_cache, const float* __restrict__ k_scales, const float* __restrict__ v_scales,
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
    const float* __restrict__ alibi_slopes, int num_heads, int num_kv_heads, int head_dim, int tokens_per_block,
    int table_stride, int partition_size, int tile_size, float scale, int window, int sink) {
  decode_partition<signed char>(out, part_acc, part_max, part_sum, q, k_cache, v_cache, k_scales, v_scales,
                                block_tables, seq_lens, alibi_slopes, num_heads, num_kv_heads, head_dim,
                                tokens_per_block, table_stride, partition_size, tile_size, scale, window, sink);
}

extern "C" __global__ void decode_attention_merge(storage_t* __restrict__ out, const float* __restrict__ part_acc,
                                                  const float* __restrict__ part_max,
                                                  const float* __restrict__ part_sum, int num_heads, int head_dim,
                                                  int num_partitions) {
  const long long head = (long long)blockIdx.y * num_heads + blockIdx.x;
  const float* maxes = part_max + head * num_partitions;
  const float* sums = part_sum + head * num_partitions;
  float m = NEG_INF;
  for (int p = 0; p < num_partitions; ++p)
    if (sums[p] > 0.0f) m = fmaxf(m, maxes[p]);
  float denom = 0.0f;
  for (int p = 0; p < num_partitions; ++p)
    if (sums[p] > 0.0f) denom += sums[p] * fast_exp(maxes[p] - m);
  const float* acc = part_acc + head * num_partitions * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float num = 0.0f;
    for (int p = 0; p < num_partitions; ++p)
      if (sums[p] > 0.0f) num += fast_exp(maxes[p] - m) * acc[(long long)p * head_dim + d];
    out[head * head_dim + d] = to_storage(denom > 0.0f ? num / denom : 0.0f);
  }
}
