"""The native CPU layer's format codes: ONE declared list each of weight formats, KV formats and
input types (how a dot kernel takes its input row: llama.cpp's vec_dot_type). A code is its
position here; the C++ table (runtime/kernels/cpu/formats.h) declares the same, and a test fails
if a code is declared on one side only. The Python entries (WeightFormat.native_code, the fused
step's float and KV codes) read their codes from here. Torch-free."""
from __future__ import annotations

# kWeight<Name> of formats.h; a registered weight format whose name is absent has no native kernel
WEIGHT_FORMATS = ("float32", "bf16", "int8", "int4",
                  # llama.cpp's block formats (ggml's names and byte layouts)
                  "q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q5_k", "q6_k")
# kKv<Name>: a KV cache's rows (read row / write row in attention.h)
KV_FORMATS = ("float32", "bf16", "int8")
# kInput<Name>: float32 rows as they are; bf16 rounding; q8x32: symmetric int8 blocks of 32 with a
# float32 scale and the block's integer sum (the int8-activation mode; the 32-element block formats);
# q8k: int8 blocks of 256 with a float32 scale and int16 sums per 16 (the K formats; ggml's Q8_K role)
INPUT_TYPES = ("float32", "bf16", "q8x32", "q8k")


def weight_code(name: str) -> int | None:
    """The native code of weight format `name`; None: no native kernel takes it."""
    return WEIGHT_FORMATS.index(name) if name in WEIGHT_FORMATS else None


def kv_code(name: str) -> int | None:
    return KV_FORMATS.index(name) if name in KV_FORMATS else None


def input_code(name: str) -> int:
    return INPUT_TYPES.index(name)
