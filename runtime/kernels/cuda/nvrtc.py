"""Compile CUDA source text with the NVRTC library through ctypes: no driver, no GPU, no CuPy.

Used to prove that every cuda_src/ program compiles for the target architectures on machines
without a GPU (CuPy's own compile path needs a driver). The library is found in the
`nvidia-cuda-nvrtc` wheel (nvidia/cu13/lib or nvidia/cuda_nvrtc/lib), else as $NVRTC_LIBRARY,
else on the loader path.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
from functools import lru_cache

NVRTC_ENV_VAR = "NVRTC_LIBRARY"


class NvrtcError(RuntimeError):
    """A compile failed; the message carries NVRTC's log."""


def _candidates() -> list[str]:
    found = []
    override = os.environ.get(NVRTC_ENV_VAR)
    if override:
        found.append(override)
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*")), reverse=True):
            if "builtins" not in os.path.basename(path) and "alt" not in os.path.basename(path):
                found.append(path)
    system = ctypes.util.find_library("nvrtc")
    if system:
        found.append(system)
    return found


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The NVRTC library, or None when none can be loaded."""
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    return None


def version() -> tuple[int, int]:
    lib = _require()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _require() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise NvrtcError("NVRTC library not found (pip install nvidia-cuda-nvrtc, or set $NVRTC_LIBRARY)")
    return lib


def _check(lib: ctypes.CDLL, result: int, what: str, log: str = "") -> None:
    if result != 0:
        raise NvrtcError(f"{what}: {lib.nvrtcGetErrorString(result).decode()}\n{log}")


def compile_program(code: str, name: str, arch: str, options: tuple[str, ...] = ("-std=c++17",),
                    cubin: bool = False, headers: dict[str, str] | None = None) -> bytes:
    """PTX of `code` for a virtual arch ("compute_90"), or with cubin=True the CUBIN for a real
    arch ("sm_90"). `headers`: include name -> text, served to `#include "name"` without any
    include path. Raises NvrtcError with the compile log on failure."""
    lib = _require()
    program = ctypes.c_void_p()
    headers = headers or {}
    texts = (ctypes.c_char_p * len(headers))(*[text.encode() for text in headers.values()])
    names = (ctypes.c_char_p * len(headers))(*[header.encode() for header in headers])
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(program), code.encode(), name.encode(), len(headers),
                                       texts if headers else None, names if headers else None),
           "nvrtcCreateProgram")
    try:
        args = [f"--gpu-architecture={arch}", *options]
        argv = (ctypes.c_char_p * len(args))(*[a.encode() for a in args])
        result = lib.nvrtcCompileProgram(program, len(args), argv)
        log_size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(program, ctypes.byref(log_size))
        log = ctypes.create_string_buffer(log_size.value)
        lib.nvrtcGetProgramLog(program, log)
        _check(lib, result, f"compiling {name} for {arch}", log.value.decode(errors="replace"))
        getter, sizer = ("nvrtcGetCUBIN", "nvrtcGetCUBINSize") if cubin else ("nvrtcGetPTX", "nvrtcGetPTXSize")
        size = ctypes.c_size_t()
        _check(lib, getattr(lib, sizer)(program, ctypes.byref(size)), sizer)
        out = ctypes.create_string_buffer(size.value)
        _check(lib, getattr(lib, getter)(program, out), getter)
        return out.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))
