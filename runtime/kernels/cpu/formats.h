// The native CPU layer's format codes (runtime/quantization/native_codes.py declares the same
// lists; tests/runtime/kernels/test_native_formats.py fails when a code is declared on one side only).
//   WeightFormat: a weight's stored layout; its dot kernels live in the linear family
//       (linear_float.h: float32, bf16; linear_weight_only.h: int8, int4 with float32 inputs;
//       linear_act_quant.h: int8, int4 with q8x32 inputs, repacked; linear_blocks.h: llama.cpp's
//       block formats q8_0 ... q6_k with q8x32 / q8k inputs). format_table.h holds the table of
//       their traits (block geometry, input type, row de-quantization, dot kernel per tier).
//   InputType: how an input row is prepared for a dot kernel (llama.cpp's vec_dot_type): float32 as
//       it is, bf16 rounding, or q8x32 (symmetric int8 blocks of 32, a float32 scale and the block's
//       integer sum per block: the int8-activation mode), or q8k (llama.cpp's Q8_K role: int8
//       blocks of 256, a float32 scale and int16 sums per 16, for the K formats).
//   KvFormat: a KV cache's rows, read and written by attention.h's KvRows.
#pragma once

#include <stdint.h>

namespace bm {

enum WeightFormat : int32_t {
  kWeightFloat32 = 0, kWeightBf16 = 1, kWeightInt8 = 2, kWeightInt4 = 3,
  // llama.cpp's blocks, ggml's byte layouts (quants_blocks.h)
  kWeightQ8_0 = 4, kWeightQ4_0 = 5, kWeightQ4_1 = 6, kWeightQ5_0 = 7, kWeightQ4_K = 8, kWeightQ5_K = 9,
  kWeightQ6_K = 10,
};
enum InputType : int32_t { kInputFloat32 = 0, kInputBf16 = 1, kInputQ8x32 = 2, kInputQ8K = 3 };
enum KvFormat : int32_t { kKvFloat32 = 0, kKvBf16 = 1, kKvInt8 = 2 };

}  // namespace bm
