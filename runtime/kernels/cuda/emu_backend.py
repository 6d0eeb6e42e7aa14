"""The `emu` kernel backend: the same cuda_src/ text compiled for the CPU with g++ and the shim
header cuda_src/emu/shim.h (one OS thread per CUDA thread, a barrier per block, per-warp shuffle
exchange; see the header), loaded with ctypes and driven by the cuda backend's launchers with CPU
torch tensors standing in for device memory. Slow; it exists to verify the kernels without a GPU.
`EmuKernels` subclasses CudaKernels on purpose and overrides no op: it IS the CUDA code on the
CPU, and swaps only the module loader, the device type and the stream.

Build cache: one shared library per (source, specialising defines), named by a sha256 of the
whole translation unit (shim + prelude + source + defines + generated launch wrappers), the
compiler flags and `g++ --version`, in $BATCH_MANAGER_EMU_CACHE, else
$XDG_CACHE_HOME/batch_manager/emu (default ~/.cache/batch_manager/emu), built by native_build.py
(the one builder of the package's native libraries). The first construction compiles (seconds
per module); later ones only load.
"""
from __future__ import annotations

import ctypes
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from . import sources
from ..native_build import CXX, build_library, compiler_available
from ..native_build import emu_cache_dir as cache_dir
from .cuda_backend import CudaKernels
from .launchers import DTYPE_CODES, LaunchConfig

logger = logging.getLogger(__name__)

CXX_FLAGS = ("-std=c++20", "-O2", "-pthread", "-fPIC", "-shared", "-fno-strict-aliasing")
# ThreadSanitizer build: catches shared-memory races such as a missing __syncthreads. The process
# that loads such a library must start with libtsan preloaded (LD_PRELOAD=$(g++ -print-file-name=libtsan.so)).
TSAN_CXX_FLAGS = ("-std=c++20", "-O1", "-g", "-pthread", "-fPIC", "-shared", "-fno-strict-aliasing",
                  "-fsanitize=thread")
_CTYPES = {
    "pointer": ctypes.c_void_p, "int": ctypes.c_int32, "unsigned int": ctypes.c_uint32, "unsigned": ctypes.c_uint32,
    "long long": ctypes.c_int64, "unsigned long long": ctypes.c_uint64, "float": ctypes.c_float,
    "double": ctypes.c_double,
}
_WRAPPER_HELPERS = """
namespace emu {
template <class P, class A>
P arg_cast(A a) { return (P)a; }
template <class... P, class... A>
void invoke(void (*kernel)(P...), A... args) { kernel(arg_cast<P>(args)...); }
}  // namespace emu
"""


def translation_unit(code: str) -> str:
    """shim + kernel program + one `emu_launch_<kernel>` C wrapper per entry point."""
    lines = [sources.read(sources.SHIM), code, _WRAPPER_HELPERS]
    for sig in sources.signatures(code).values():
        params = [f"{'void*' if p.is_pointer else p.ctype} a{i}" for i, p in enumerate(sig.params)]
        args = ", ".join(f"a{i}" for i in range(len(sig.params)))
        lines.append(
            f'extern "C" void emu_launch_{sig.name}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, '
            f'unsigned by, unsigned bz, unsigned long long smem{"".join(", " + p for p in params)}) {{\n'
            f"  emu::launch(dim3{{gx, gy, gz}}, dim3{{bx, by, bz}}, smem, [=] {{ emu::invoke({sig.name}"
            f"{', ' + args if args else ''}); }});\n}}\n")
    return "\n".join(lines)


def build(code: str, flags: tuple[str, ...] = CXX_FLAGS, directory: Path | None = None) -> Path:
    """Compile `code` with the shim into a cached shared library; returns its path."""
    return build_library(translation_unit(code), flags, "kernels", directory or cache_dir(), "emu kernels")


class EmuFunction:
    """One kernel of a loaded emu library, called like a CuPy RawKernel. Checks that every
    argument is a numpy scalar of exactly its parameter's C type (the launchers' contract)."""

    def __init__(self, library: ctypes.CDLL, signature: sources.Signature):
        self.signature = signature
        self._fn = getattr(library, f"emu_launch_{signature.name}")
        self._fn.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_ulonglong] + [_CTYPES[p.ctype] for p in signature.params]
        self._fn.restype = None

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0, stream=None) -> None:
        name, params = self.signature.name, self.signature.params
        if not isinstance(grid, tuple) or not isinstance(block, tuple):
            raise TypeError(f"{name}: grid and block must be tuples (as CuPy requires)")
        if len(args) != len(params):
            raise TypeError(f"{name}: {len(args)} arguments for {len(params)} parameters")
        values = []
        for param, arg in zip(params, args):
            expected = np.uint64 if param.is_pointer else np.dtype(sources.SCALAR_TYPES[param.ctype]).type
            if type(arg) is not expected:
                raise TypeError(f"{name}: parameter {param.name} ({param.ctype}) got {type(arg).__name__}, "
                                f"expected numpy.{expected.__name__}")
            values.append(arg.item())
        grid3, block3 = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
        if min(grid3) < 1 or min(block3) < 1:
            raise ValueError(f"{name}: empty launch grid {grid} block {block} (guard empty work on the host)")
        self._fn(*grid3, *block3, int(shared_mem), *values)


class EmuModule:
    def __init__(self, code: str, library_path: Path):
        self._library = ctypes.CDLL(str(library_path))
        self._signatures = sources.signatures(code)

    def get_function(self, name: str) -> EmuFunction:
        return EmuFunction(self._library, self._signatures[name])


class EmuKernels(CudaKernels):
    name = "emu"
    device_type = "cpu"

    def __init__(self, config: LaunchConfig | None = None, dtypes: tuple[torch.dtype, ...] = tuple(DTYPE_CODES),
                 cxx_flags: tuple[str, ...] = CXX_FLAGS):
        self.cxx_flags = tuple(cxx_flags)
        super().__init__(config, cpu_fallback=False, dtypes=dtypes)

    @staticmethod
    def default_config() -> LaunchConfig:
        # NOTE: small blocks, partitions and tiles: a barrier costs ~0.25 ms at 128 OS threads, and
        # short partitions and tiles make ordinary test contexts exercise the tile loop and the merge.
        return LaunchConfig(attention_threads=64, threads_per_key=4, partition_size=32, tile_size=16, copy_threads=32)

    def _compile_all(self):
        if not compiler_available():
            raise RuntimeError(f"emu kernels: the C++ compiler {CXX!r} is not available")
        jobs = [(source, names, sources.program(source, self.config.defines(dtype)), dtype)
                for source, names in sources.KERNEL_SOURCES.items() for dtype in self.dtypes]
        with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            paths = list(pool.map(lambda job: build(job[2], self.cxx_flags), jobs))
        functions = {}
        for (_, names, code, dtype), path in zip(jobs, paths):
            module = EmuModule(code, path)
            for name in names:
                functions[dtype, name] = module.get_function(name)
        return functions

    def _stream(self, device: torch.device):
        return None
