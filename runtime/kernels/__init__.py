"""Kernel backends: the paged-KV and attention operations behind one interface.

`get_kernels(name)` returns a backend object. Names: "torch" (reference, default on CPU),
"cuda" and "emu" (raw CUDA sources; arrive with the CUDA kernels). The environment variable
BATCH_MANAGER_KERNELS overrides the default choice.
"""
from __future__ import annotations

import os

from .torch_backend import TorchKernels

KERNELS_ENV_VAR = "BATCH_MANAGER_KERNELS"
KNOWN_BACKENDS = ("torch",)


def default_backend_name() -> str:
    return os.environ.get(KERNELS_ENV_VAR, "").strip() or "torch"


def get_kernels(name: str | None = None) -> TorchKernels:
    name = name or default_backend_name()
    if name == "torch":
        return TorchKernels()
    raise ValueError(f"kernel backend: unknown or unavailable {name!r} "
                     f"(from {KERNELS_ENV_VAR} or configuration); available: {', '.join(KNOWN_BACKENDS)}")
