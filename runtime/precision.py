"""Numerical precision (the seeds' quantMode): `QuantMode` with TensorRT-LLM's names, the CPU's
features read at run time, and the checks and resolution of a BuildConfig's precision fields
(`dtype`, `weight_only`, `group_size`, `weight_only_skip`, `kv_cache_dtype`, `kv_cache_scale`)
into what runs on this machine. Torch-free; runtime.config validates through it and the engine
loader resolves through it.
"""
from __future__ import annotations

import enum
import functools
import platform

BUILD_DTYPES = ("auto", "float32", "float16", "bfloat16")
# Activation quantization of a weight-only engine's matmuls (BuildConfig.act_quant): "int8", per
# block of 32 input columns (runtime/kernels/cpu/act_quant.py states the arithmetic).
ACT_QUANT_MODES = ("int8",)
# BuildConfig.weight_format: what a GGUF file's quantized blocks become. keep: the matmul weights run in
# their block formats (runtime.quantization.gguf_blocks); dequantize: every tensor in the build dtype;
# auto: keep where the native block kernels run here, else dequantize (resolved and recorded at load).
WEIGHT_FORMATS = ("auto", "keep", "dequantize")
ACT_QUANT_BLOCK = 32   # input columns per activation quantization block: every such matmul's width divides by it
GROUP_SIZES = (32, 64, 128)
WEIGHT_ONLY_SKIPPABLE = ("lm_head",)
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
KV_CACHE_SCALES = ("block_head", "token_head")


class QuantMode(enum.IntFlag):
    """TensorRT-LLM's QuantMode bits (the ones this runtime implements keep its values): the public
    record of a build's precision (ModelConfig.quant_mode, engine.json, runtime.build's summary). The
    runtime itself reads the BuildConfig's fields, never these bits back."""
    INT4_WEIGHTS = 1 << 0
    INT8_WEIGHTS = 1 << 1
    ACTIVATIONS = 1 << 2
    PER_CHANNEL = 1 << 3
    PER_TOKEN = 1 << 4
    PER_GROUP = 1 << 5
    INT8_KV_CACHE = 1 << 6
    FP8_KV_CACHE = 1 << 7

    def is_weight_only(self) -> bool:
        return bool(self & (QuantMode.INT4_WEIGHTS | QuantMode.INT8_WEIGHTS)) and not self & QuantMode.ACTIVATIONS

    def is_int8_weight_only(self) -> bool:
        return self.is_weight_only() and bool(self & QuantMode.INT8_WEIGHTS)

    def is_int4_weight_only(self) -> bool:
        return self.is_weight_only() and bool(self & QuantMode.INT4_WEIGHTS)

    def has_int8_kv_cache(self) -> bool:
        return bool(self & QuantMode.INT8_KV_CACHE)

    def has_fp8_kv_cache(self) -> bool:
        return bool(self & QuantMode.FP8_KV_CACHE)

    @staticmethod
    def from_build(weight_bits: "QuantMode", kv_cache_dtype: str, act_quant: str | None = None) -> "QuantMode":
        """weight_bits: the weight format's (runtime.quantization; 0 without weight_only)."""
        mode = QuantMode(weight_bits)
        if act_quant is not None:
            mode |= QuantMode.ACTIVATIONS
        if kv_cache_dtype == "int8":
            mode |= QuantMode.INT8_KV_CACHE
        elif kv_cache_dtype == "fp8":
            mode |= QuantMode.FP8_KV_CACHE
        return mode


@functools.lru_cache(maxsize=None)
def cpu_info(key: str) -> str:
    """The first value of `key` in /proc/cpuinfo ("flags", "model name", "vendor_id"; "" where
    unreadable). Read at run time, never assumed from the build machine."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == key), "")
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    """The feature flags of this machine's CPU (empty where unreadable)."""
    return frozenset(cpu_info("flags").split())


def has_fast_bf16(flags: frozenset[str] | None = None) -> bool:
    """bf16 matmuls in hardware: AMX-BF16 or AVX512-BF16 (x86-64 only)."""
    flags = cpu_flags() if flags is None else flags
    return platform.machine() in ("x86_64", "AMD64") and bool({"amx_bf16", "avx512_bf16"} & flags)


def resolve_dtype(dtype: str, cuda: bool, flags: frozenset[str] | None = None) -> str:
    """`dtype` as it runs here: "auto" is bf16 on CUDA or on a CPU with fast bf16, else float32."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if cuda or has_fast_bf16(flags) else "float32"


def check_precision_fields(weight_only, weight_formats: tuple[str, ...], group_size, weight_only_skip, kv_cache_dtype,
                           kv_cache_scale, error: type[ValueError], act_quant: str | None = None) -> None:
    """`error(message naming the field)` for a value outside the modes above; `weight_formats`: the
    weight_only values (runtime.quantization's entries)."""
    def one_of(name: str, value, supported: tuple, optional: bool = True) -> None:
        if value not in supported and not (optional and value is None):
            raise error(f"{name}: unsupported value {value!r}; supported: {'None, ' if optional else ''}"
                        f"{', '.join(map(repr, supported))}")
    one_of("act_quant", act_quant, ACT_QUANT_MODES)
    if act_quant is not None and weight_only is None:
        raise error(f"act_quant: {act_quant!r} quantizes the activations of weight-only matmuls; set "
                    f"weight_only ({', '.join(map(repr, weight_formats))}) too")
    one_of("weight_only", weight_only, weight_formats)
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise error(f"group_size: must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size!r}")
    if not isinstance(weight_only_skip, tuple) or any(name not in WEIGHT_ONLY_SKIPPABLE for name in weight_only_skip):
        raise error(f"weight_only_skip: must be a tuple of {', '.join(map(repr, WEIGHT_ONLY_SKIPPABLE))}, "
                    f"got {weight_only_skip!r}")
    one_of("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES, optional=False)
    one_of("kv_cache_scale", kv_cache_scale, KV_CACHE_SCALES)
