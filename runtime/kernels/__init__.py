"""Kernel backends: the paged-KV, attention, dense-math and decoding operations behind one declared
interface (interface.KernelBackend).

`get_kernels(name)` returns a backend object:
  "torch"  plain torch (torch_backend.py): the reference of every op, with the CPU fast paths of
           attention (cpu_attention.py, float32 decode attention in cpu_native.py) switched on;
           its dense ops (linear.py, weight_only_linear.py, RMSNorm, silu * up) take theirs always
  "cuda"   cuda_src/ kernels through CuPy RawModule on torch's current stream (cuda_backend.py)
  "emu"    the same sources compiled for the CPU with g++ and a shim; slow, for tests (emu_backend.py)
The name comes from configuration (ModelRunner / GptSession `kernels=`,
TrtGptModelOptionalParams.kernel_backend), else from BATCH_MANAGER_KERNELS, else the default:
"cuda" when a CUDA device and CuPy are present, "torch" otherwise. An unavailable backend is an
error, never a silent fallback.
"""
from __future__ import annotations

import os

from .interface import KERNEL_OPS, KernelBackend
from .torch_kernels.torch_backend import TorchKernels

KERNELS_ENV_VAR = "BATCH_MANAGER_KERNELS"
KNOWN_BACKENDS = ("torch", "cuda", "emu")


class KernelBackendError(ValueError):
    """The requested kernel backend is unknown or cannot run on this machine."""


def _cuda_available() -> bool:
    from .cuda.cuda_backend import cuda_available
    return cuda_available()


def default_backend_name() -> str:
    """BATCH_MANAGER_KERNELS if set, else "cuda" when usable, else "torch"."""
    return os.environ.get(KERNELS_ENV_VAR, "").strip() or ("cuda" if _cuda_available() else "torch")


def get_kernels(name: str | None = None) -> KernelBackend:
    """A constructed backend (its modules compiled). Raises KernelBackendError for an unknown or
    unavailable one."""
    env_name = os.environ.get(KERNELS_ENV_VAR, "").strip()
    origin = "configuration" if name else (KERNELS_ENV_VAR if env_name else "default")
    name = name or default_backend_name()
    if name not in KNOWN_BACKENDS:
        raise KernelBackendError(f"kernel backend: unknown {name!r} (from {origin}); "
                                 f"known: {', '.join(KNOWN_BACKENDS)}")
    if name == "torch":
        return TorchKernels(fast_paths=True, native=True)
    if name == "cuda":
        if not _cuda_available():
            raise KernelBackendError(f"kernel backend 'cuda' (from {origin}) is unavailable: it needs a CUDA "
                                     f"device and CuPy; choose 'torch' or 'emu'")
        from .cuda.cuda_backend import CudaKernels
        # NOTE: when cuda was picked by default, a runner whose tensors live on the CPU still works:
        # such calls go to the torch backend.
        return CudaKernels(cpu_fallback=origin == "default")
    from .cuda.emu_backend import EmuKernels, compiler_available
    if not compiler_available():
        raise KernelBackendError(f"kernel backend 'emu' (from {origin}) is unavailable: it needs a C++20 "
                                 f"compiler (g++ or $CXX)")
    return EmuKernels()
