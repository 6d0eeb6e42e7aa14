// Entry points of the block formats (llama.cpp's q8_0 ... q6_k) over the format table
// (format_table.h); blocks.py binds them. Every call names its weight format by its code (formats.h).
//
// Contracts (rows contiguous along their last dimension):
//   bm_blk_format_info(format, info int32 [5]): info = {block_elems, block_bytes, input type,
//       has row de-quantization, mask of the Isa tiers with a linear kernel | the mask of those with
//       a kernel over the 8-row interleaved layout << 8}; -1 for an unknown code.
//   bm_blk_quantize(input, x, rows, ldx, k, q, d, sums): x float32 [rows, k] (row stride ldx) into
//       the input type `input` (quants_blocks.h): q int8 [rows, k], d float32 [rows, k / block],
//       sums int32 [rows, k / 32] (q8x32) or int16 [rows, k / 16] (q8k). -1: not a block input type.
//   bm_blk_linear(format, x, rows, ldx, w, n, k, bias, y, ldy, accumulate, num_threads, isa):
//       y[r, o] (+)= x[r, :] . W[o, :] (+ bias[o]) over w uint8 [n, k / block_elems * block_bytes];
//       x quantized once into the format's input type (from bm_blk::kShareMinInputs values each
//       thread an even share of its blocks, then one barrier; below, before the parallel region),
//       each thread a contiguous range of whole output tiles. bias float32 [n] or null;
//       y row stride ldy; isa a bm::Isa cap. format | kLayoutX8: w is in the 8-row interleaved
//       layout (linear_blocks_avx2.h; blocks.py's repack), same bytes. -1: no such linear kernel.
//   bm_blk_dequant(format, w, n0, n1, k, out, num_threads): rows [n0, n1) of w -> out float32
//       [n1 - n0, k] contiguous, bit for bit gguf.quants.dequantize. -1: no row de-quantization.
// Shapes (k a multiple of the block, row bytes) are checked by the caller (blocks.py).
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "format_table.h"

constexpr int kLayoutX8 = 1 << 8;   // bm_blk_linear's format flag: the 8-row interleaved layout

extern "C" int bm_blk_format_info(int format, int32_t* info) {
  const bm::FormatTraits* t = bm::format_traits(format);
  if (!t) return -1;
  int32_t mask = 0;
  for (int tier = 0; tier < bm::kNumIsa; ++tier)
    mask |= (t->linear[tier] ? 1 << tier : 0) | (t->linear_x8[tier] ? 1 << (tier + 8) : 0);
  info[0] = t->block_elems, info[1] = t->block_bytes, info[2] = t->input, info[3] = t->dequant_row != nullptr;
  info[4] = mask;
  return 0;
}

extern "C" int bm_blk_quantize(int input, const float* x, int64_t rows, int64_t ldx, int64_t k, int8_t* q, float* d,
                               void* sums) {
  return bm_blk::quantize_share(input, x, rows, ldx, k, q, d, sums, 0, 1) ? 0 : -1;
}

extern "C" int bm_blk_linear(int format, const float* x, int64_t rows, int64_t ldx, const uint8_t* w, int64_t n,
                             int64_t k, const float* bias, float* y, int64_t ldy, int accumulate, int num_threads,
                             int isa) {
  const bm::FormatTraits* t = bm::format_traits(format & ~kLayoutX8);
  const bm::LinearRange kernel = t ? bm::linear_kernel(*t, isa, format & kLayoutX8) : nullptr;
  if (!kernel) return -1;
  const bool is_k = t->input == bm::kInputQ8K;
  const int64_t in_block = is_k ? bm_blk::kQK : bm_blk::kQ, nd = k / in_block;
  std::vector<int8_t> q(rows * k);
  std::vector<float> d(rows * nd);
  std::vector<int32_t> s(is_k ? 0 : rows * (k / bm_blk::kQ));
  std::vector<int16_t> bsums(is_k ? rows * (k / 16) : 0);
  void* sums = is_k ? (void*)bsums.data() : (void*)s.data();
  const bool by_threads = bm_blk::quantize_by_threads(rows, k);
  if (!by_threads) bm_blk::quantize_share(t->input, x, rows, ldx, k, q.data(), d.data(), sums, 0, 1);
  const bm_blk::QInput in{q.data(), d.data(), is_k ? nullptr : s.data(), is_k ? bsums.data() : nullptr, k, nd};
  const bm_blk::LinearArgs a{w, k / t->block_elems * t->block_bytes, n, k, in, rows, bias, y, ldy, accumulate};
  const int64_t tiles = (n + bm_blk::kTile - 1) / bm_blk::kTile;
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>(num_threads, tiles));
#pragma omp parallel num_threads(threads)
  {
    const int64_t i = omp_get_thread_num(), nt = omp_get_num_threads();
    if (by_threads) {   // the same branch on every thread
      bm_blk::quantize_share(t->input, x, rows, ldx, k, q.data(), d.data(), sums, i, nt);
#pragma omp barrier
    }
    const int64_t o0 = tiles * i / nt * bm_blk::kTile, o1 = std::min(n, tiles * (i + 1) / nt * bm_blk::kTile);
    if (o0 < o1) kernel(a, o0, o1);
  }
  return 0;
}

extern "C" int bm_blk_dequant(int format, const uint8_t* w, int64_t n0, int64_t n1, int64_t k, float* out,
                              int num_threads) {
  const bm::FormatTraits* t = bm::format_traits(format);
  if (!t || !t->dequant_row) return -1;
  const int64_t row_bytes = k / t->block_elems * t->block_bytes;
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((n1 - n0) * k >= 65536)
  for (int64_t o = n0; o < n1; ++o) t->dequant_row(w + o * row_bytes, k, out + (o - n0) * k);
  return 0;
}

// Rows ids[0, count) of a block weight w [n, row_bytes] -> out float32 [count, k] (an embedding
// lookup), bit for bit bm_blk_dequant's: in ggml's layout, or (gather non-null) the x8 layout, whose
// group of rows 8g .. 8g + 7 holds byte b of its row r at gather[r * row_bytes + b] (blocks.py's
// x8_row_gather; rows past the last whole group in ggml's layout). -1: no row de-quantization;
// -2: an id outside [0, n).
extern "C" int bm_blk_rows(int format, const uint8_t* w, int64_t n, int64_t k, const int32_t* gather,
                           const int64_t* ids, int64_t count, float* out) {
  const bm::FormatTraits* t = bm::format_traits(format);
  if (!t || !t->dequant_row) return -1;
  const int64_t row_bytes = k / t->block_elems * t->block_bytes, grouped = gather ? n / 8 * 8 : 0;
  std::vector<uint8_t> row(row_bytes);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t id = ids[i];
    if (id < 0 || id >= n) return -2;
    const uint8_t* src = w + id * row_bytes;
    if (id < grouped) {
      const uint8_t* group = w + id / 8 * 8 * row_bytes;
      const int32_t* map = gather + id % 8 * row_bytes;
      for (int64_t b = 0; b < row_bytes; ++b) row[b] = group[map[b]];
      src = row.data();
    }
    t->dequant_row(src, k, out + i * k);
  }
  return 0;
}

