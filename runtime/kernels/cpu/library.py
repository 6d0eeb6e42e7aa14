"""The native CPU layer's one library: its C++ sources (tiers and format codes: isa.h, formats.h; by
op family: vec.h, norm_activation.h, attention.h, attention_dense.h, linear_float.h, linear_weight_only.h,
linear_act_quant.h; llama.cpp's block formats: quants_blocks.h, linear_blocks.h, linear_blocks_avx2.h,
linear_blocks_avx2_k.h and their table format_table.h; entry points ops.cpp, collectives.cpp,
decode_step.cpp, blocks.cpp) compiled once into one shared object, loaded once with ctypes, with the one signature table of every
entry point. The binding modules (cpu_native.py, cpu_native_bf16.py, cpu_weight_only.py, act_quant.py,
cpu_decode_step.py, blocks.py) wrap its functions.

Build cache: one library per sha256 of (sources, flags, compiler version, CPU model and flags) in
`native/` (native_build.py). `load()` is None where it cannot run: not x86-64 with AVX2 / FMA, no
compiler, or the build failed (callers then stay on torch).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import platform
import subprocess
from pathlib import Path

from ..native_build import CXX, build_sources, compiler_available, native_cache_dir

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = ("ops.cpp", "collectives.cpp", "decode_step.cpp", "blocks.cpp")
HEADERS = ("isa.h", "formats.h", "vec.h", "norm_activation.h", "attention.h", "attention_dense.h",
           "linear_float.h", "linear_weight_only.h", "linear_weight_only_gemm.h", "linear_act_quant.h",
           "quants_blocks.h", "linear_blocks.h", "linear_blocks_avx2.h", "linear_blocks_avx2_k.h",
           "format_table.h")
# -falign-loops=64: a hot loop's speed must not depend on where it lands. A 16-lane one-row int8 GEMV
# loop (tried for linear_weight_only.h) ran at 12.7 or 21.6 GB/s by its address alone in a harness
# on an AMD EPYC Zen 4 (both placements 21.5-22.2 with the flag); the library's steps measured the
# same with and without it (0.99-1.03x in one process, SmolLM2, 1 and 4 rows).
CXX_FLAGS = ("-std=c++17", "-O3", "-march=native", "-mavx2", "-mfma", "-falign-loops=64", "-fopenmp", "-fPIC",
             "-shared")
NAME = "cpu-native"

_P, _I64, _I32, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_int
_BF16_LINEAR = [_P, _INT, _I64, _I64, _P, _I64, _I64, _P, _P, _INT, _I64, _INT, _INT]
_DECODE_TAIL = [_P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _F32, _I64, _I64, _P, _INT]
# entry point -> (argument types, result type); ops.cpp, collectives.cpp and decode_step.cpp state the contracts
SIGNATURES: dict[str, tuple[list, object]] = {
    "bm_isa_mask": ([], _INT),
    "bm_linear": ([_P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _INT, _INT], None),
    "bm_rms_norm": ([_P, _I64, _I64, _I64, _P, _F32, _P, _I64, _INT], None),
    "bm_silu_mul": ([_P, _I64, _I64, _I64, _P, _INT], None),
    "bm_decode_attention": ([_P, _P, _P, *_DECODE_TAIL], None),
    "bm_decode_attention_int8": ([_P, _P, _P, _P, _P, *_DECODE_TAIL], None),
    "bm_dense_attention": ([_P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _INT], None),
    "bm_token_bitmask": ([_P, _P, _P, _I64, _I64, _I64, _I64, _INT], None),
    "bm_greedy": ([_P, _I64, _I64, _I64, _I64, _P, _P, _INT], None),
    "bm_shm_all_reduce": ([_P, _I64, _P, _I64, _INT, _INT, _I64, _I64, _P, _I64], _INT),
    "bm_linear_bf16": (_BF16_LINEAR, None),
    "bm_linear_bf16_avx2": (_BF16_LINEAR, None),
    "bm_rms_norm_bf16": ([_P, _I64, _I64, _I64, _P, _F32, _P, _I64, _INT], None),
    "bm_silu_mul_bf16": ([_P, _I64, _I64, _I64, _P, _INT], None),
    "bm_decode_attention_bf16": ([_P, _P, _P, *_DECODE_TAIL], None),
    "bm_bf16_has_dot_product": ([], _INT),
    "bm_wo_int8_linear": ([_P, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _I64, _INT, _INT, _INT], None),
    "bm_wo_int4_linear": ([_P, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _P, _P, _I64, _INT, _INT, _INT], None),
    "bm_aq_quantize": ([_P, _I64, _I64, _P, _P, _P], None),
    "bm_aq_linear": ([_P, _P, _I64, _P, _I64, _INT, _INT, _INT], None),
    "bm_blk_format_info": ([_INT, _P], _INT),
    "bm_blk_quantize": ([_INT, _P, _I64, _I64, _I64, _P, _P, _P], _INT),
    "bm_blk_linear": ([_INT, _P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _INT, _INT, _INT], _INT),
    "bm_blk_dequant": ([_INT, _P, _I64, _I64, _I64, _P, _INT], _INT),
    "bm_blk_rows": ([_INT, _P, _I64, _I64, _P, _P, _I64, _P], _INT),
    "bm_decode_step": ([_P, _I64, _P, _P, _P, _P, _I64, _P, _P, _INT], None),
}


def cpu_identity() -> str:
    """The CPU's model name and feature flags (-march=native compiles for them)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor()


def cpu_supported() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    flags = cpu_identity()
    return " avx2" in flags and " fma" in flags


def source_files() -> dict[str, str]:
    """name -> text of every source and header of the library."""
    return {name: (HERE / name).read_text() for name in (*SOURCES, *HEADERS)}


def build(flags: tuple[str, ...] = CXX_FLAGS, name: str = NAME, directory: Path | None = None) -> Path:
    """Compile the library with `flags` into the cache (once per sources, flags, compiler and CPU);
    its path. Other flags build variants for tests (a lower -march, AVX-512 on a CPU without it)."""
    return build_sources(source_files(), SOURCES, flags, name, directory or native_cache_dir(), "cpu native kernels",
                         extra_key=cpu_identity())


def bind(path: Path) -> ctypes.CDLL:
    """The library at `path` with every entry point's signature set."""
    # NOTE: torch is imported first (by the callers), so the library's libgomp.so.1 binds to torch's
    # OpenMP runtime.
    lib = ctypes.CDLL(str(path))
    for entry, (argtypes, restype) in SIGNATURES.items():
        fn = getattr(lib, entry)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


@functools.lru_cache(maxsize=None)
def load() -> ctypes.CDLL | None:
    """The library, built and loaded once per process; None where it cannot run here."""
    if not cpu_supported() or not compiler_available():
        logger.info("cpu native kernels: unavailable (needs x86-64 AVX2/FMA and %s); using torch", CXX)
        return None
    try:
        return bind(build())
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.warning("cpu native kernels: build failed, using torch: %s", error)
        return None
