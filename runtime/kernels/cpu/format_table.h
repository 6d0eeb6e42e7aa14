// The native CPU layer's format table (ggml-cpu's type_traits_cpu): one row per WeightFormat code
// (formats.h) with its block geometry, the input type its dot kernel takes (vec_dot_type), its row
// de-quantization and its linear range kernel per ISA tier (isa.h; null: no kernel at that tier,
// the driver takes the next lower one), and per tier its kernel over the 8-row interleaved layout
// (linear_blocks_avx2.h, linear_blocks_avx2_k.h; null: none, its weights stay in ggml's layout).
// Adding a block format: its layout and de-quantization in quants_blocks.h, its kernels in
// linear_blocks*.h, one row here.
//
// float32 / bf16 / int8 / int4 keep their own drivers (linear_float.h, linear_weight_only.h,
// linear_act_quant.h); their rows give the geometry and input type, float32 / bf16 their row
// de-quantization (int8 / int4 keep their scales beside the codes, outside a row's bytes: none).
#pragma once

#include <stdint.h>

#include <array>

#include "formats.h"
#include "isa.h"
#include "linear_blocks.h"

namespace bm {

constexpr int kNumIsa = 6;   // the tiers of isa.h's Isa

using DequantRow = void (*)(const uint8_t* row, int64_t k, float* out);
using LinearRange = void (*)(const bm_blk::LinearArgs& a, int64_t o0, int64_t o1);

struct FormatTraits {
  const char* name;
  int32_t block_elems, block_bytes;   // a row of k elements is k / block_elems * block_bytes bytes
  InputType input;                    // what from_float makes of an input row for the dot kernel
  DequantRow dequant_row;             // one row of k elements -> float32 [k]; null: none
  std::array<LinearRange, kNumIsa> linear;      // by Isa tier; null: none at that tier
  std::array<LinearRange, kNumIsa> linear_x8;   // the same over the 8-row interleaved layout
                                                // (linear_blocks_avx2*.h)
};

// Kernels by tier: the scalar, AVX2 and VNNI (linear_blocks_avx2.h's BM_BLK_VNNI_TIER) ones, each
// null where not compiled in.
constexpr std::array<LinearRange, kNumIsa> by_tier(LinearRange scalar, LinearRange avx2, LinearRange vnni) {
  std::array<LinearRange, kNumIsa> kernels{};
  kernels[kScalar] = scalar, kernels[kAvx2] = avx2;
#ifdef BM_BLK_VNNI
  kernels[BM_BLK_VNNI_TIER] = vnni;
#else
  (void)vnni;
#endif
  return kernels;
}

#ifdef __AVX2__
#define BM_AVX2_KERNEL(K) &bm_blk::linear_range<bm_blk::K>
#else
#define BM_AVX2_KERNEL(K) nullptr
#endif
#ifdef BM_BLK_X8
#define BM_AVX2_X8(KX8, K) &bm_blk::linear_range_x8<bm_blk::KX8, bm_blk::K>
#else
#define BM_AVX2_X8(KX8, K) nullptr
#endif
#ifdef BM_BLK_VNNI
#define BM_VNNI_KERNEL(K) &bm_blk::linear_range<bm_blk::K>
#define BM_VNNI_X8(KX8, K) &bm_blk::linear_range_x8<bm_blk::KX8, bm_blk::K>
#else
#define BM_VNNI_KERNEL(K) nullptr
#define BM_VNNI_X8(KX8, K) nullptr
#endif

// A block format's row: its AVX2 kernels, and VNNI ones (row and x8 layout) where given (the K
// formats: over the x8 layout only; at the VNNI tier their rows in ggml's layout run the AVX2
// kernel, linear_kernel's next lower one).
#define BM_BLOCK_ROW(name, elems, bytes, input, dequant, scalar, avx2, avx2_x8, vnni, vnni_x8)                   \
  {name, elems, bytes, input, dequant, by_tier(&bm_blk::linear_range<bm_blk::scalar>, BM_AVX2_KERNEL(avx2), vnni), \
   by_tier(nullptr, avx2_x8, vnni_x8)}

inline constexpr FormatTraits kFormats[] = {
    {"float32", 1, 4, kInputFloat32, bm_blk::dequant_float32, {}},
    {"bf16", 1, 2, kInputBf16, bm_blk::dequant_bf16, {}},
    {"int8", 1, 1, kInputFloat32, nullptr, {}},
    {"int4", 2, 1, kInputFloat32, nullptr, {}},
    BM_BLOCK_ROW("q8_0", 32, 34, kInputQ8x32, bm_blk::dequant_q8_0, ScalarQ8_0, Avx2Q8_0,
                 BM_AVX2_X8(Avx2Q8_0x8, Avx2Q8_0), BM_VNNI_KERNEL(VnniQ8_0), BM_VNNI_X8(VnniQ8_0x8, VnniQ8_0)),
    BM_BLOCK_ROW("q4_0", 32, 18, kInputQ8x32, bm_blk::dequant_q4_0, ScalarQ4_0, Avx2Q4_0,
                 BM_AVX2_X8(Avx2Q4_0x8, Avx2Q4_0), BM_VNNI_KERNEL(VnniQ4_0), BM_VNNI_X8(VnniQ4_0x8, VnniQ4_0)),
    BM_BLOCK_ROW("q4_1", 32, 20, kInputQ8x32, bm_blk::dequant_q4_1, ScalarQ4_1, Avx2Q4_1,
                 BM_AVX2_X8(Avx2Q4_1x8, Avx2Q4_1), BM_VNNI_KERNEL(VnniQ4_1), BM_VNNI_X8(VnniQ4_1x8, VnniQ4_1)),
    BM_BLOCK_ROW("q5_0", 32, 22, kInputQ8x32, bm_blk::dequant_q5_0, ScalarQ5_0, Avx2Q5_0,
                 BM_AVX2_X8(Avx2Q5_0x8, Avx2Q5_0), BM_VNNI_KERNEL(VnniQ5_0), BM_VNNI_X8(VnniQ5_0x8, VnniQ5_0)),
    BM_BLOCK_ROW("q4_k", 256, 144, kInputQ8K, bm_blk::dequant_q4_k, ScalarQ4_K, Avx2Q4_K,
                 BM_AVX2_X8(Avx2Q4_Kx8, Avx2Q4_K), nullptr, BM_VNNI_X8(VnniQ4_Kx8, Avx2Q4_K)),
    BM_BLOCK_ROW("q5_k", 256, 176, kInputQ8K, bm_blk::dequant_q5_k, ScalarQ5_K, Avx2Q5_K,
                 BM_AVX2_X8(Avx2Q5_Kx8, Avx2Q5_K), nullptr, BM_VNNI_X8(VnniQ5_Kx8, Avx2Q5_K)),
    BM_BLOCK_ROW("q6_k", 256, 210, kInputQ8K, bm_blk::dequant_q6_k, ScalarQ6_K, Avx2Q6_K,
                 BM_AVX2_X8(Avx2Q6_Kx8, Avx2Q6_K), nullptr, BM_VNNI_X8(VnniQ6_Kx8, Avx2Q6_K)),
};
constexpr int kNumFormats = sizeof(kFormats) / sizeof(kFormats[0]);
static_assert(kNumFormats == kWeightQ6_K + 1, "one row per WeightFormat code");

#undef BM_BLOCK_ROW
#undef BM_AVX2_KERNEL
#undef BM_AVX2_X8
#undef BM_VNNI_KERNEL
#undef BM_VNNI_X8

// The row of `format`, or null for a code outside the table.
inline const FormatTraits* format_traits(int32_t format) {
  return format >= 0 && format < kNumFormats ? &kFormats[format] : nullptr;
}

// The kernel of the highest tier at or below `isa` that `t` has (over the 8-row interleaved layout
// with `x8`); null: none.
inline LinearRange linear_kernel(const FormatTraits& t, int isa, bool x8 = false) {
  const LinearRange* kernels = x8 ? t.linear_x8.data() : t.linear.data();
  for (int tier = std::min(isa, kNumIsa - 1); tier >= 0; --tier)
    if (kernels[tier]) return kernels[tier];
  return nullptr;
}

}  // namespace bm
