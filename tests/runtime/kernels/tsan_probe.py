"""Run under ThreadSanitizer in a child process (libtsan preloaded): `python -m
tests.runtime.kernels.tsan_probe {racy,clean}`. Exit status 66 when TSan reports a race; `clean`
runs the barrier-correct neighbour kernel and the KV kernels."""
from __future__ import annotations

import math
import sys

import numpy as np
import torch

from runtime.kernels.cuda import emu_backend, sources

NEIGHBOUR = r'''
extern "C" __global__ void neighbour(float* out) {
  __shared__ float buf[64];
  buf[threadIdx.x] = (float)threadIdx.x;
  BARRIER
  out[threadIdx.x] = buf[(threadIdx.x + 1) % blockDim.x];
}
'''


def neighbour(with_barrier: bool) -> None:
    code = sources.read(sources.PRELUDE) + NEIGHBOUR.replace("BARRIER", "__syncthreads();" if with_barrier else "")
    module = emu_backend.EmuModule(code, emu_backend.build(code, emu_backend.TSAN_CXX_FLAGS))
    out = torch.zeros(64)
    module.get_function("neighbour")((2,), (64,), (np.uint64(out.data_ptr()),))


def kv_kernels() -> None:
    from tests.runtime.kernels.conftest import paged_case
    kernels = emu_backend.EmuKernels(dtypes=(torch.float32,), cxx_flags=emu_backend.TSAN_CXX_FLAGS)
    q, clean, _, table, lens = paged_case([5, 70], 4, 2, 16, 4, torch.float32, window=40, sink=2)
    out = kernels.decode_attention(q, *clean, table, lens, 1 / math.sqrt(16), 40, 2)
    assert not out.isnan().any()
    kernels.write_kv(*clean, q[:, :2], q[:, 2:], torch.tensor([1, 2]))
    kernels.copy_blocks(torch.stack(clean)[None], torch.tensor([0]), torch.tensor([1]))


if __name__ == "__main__":
    if sys.argv[1] == "racy":
        neighbour(with_barrier=False)
    else:
        neighbour(with_barrier=True)
        kv_kernels()
