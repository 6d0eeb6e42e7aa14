"""The emu shim itself: barriers, shuffles, votes, atomics and poisoned dynamic shared memory
behave like CUDA's; launches check argument types; ThreadSanitizer catches a missing
__syncthreads (and, with BATCH_MANAGER_TSAN=1, finds no race in the KV kernels)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime.kernels.cuda import emu_backend, sources
from runtime.kernels.cuda.launchers import c_int, c_ptr

REPO = Path(__file__).resolve().parents[3]

PROBE = r'''
extern "C" __global__ void probe(float* out, float* lanes, int* counters, const float* in) {
  DYNAMIC_SMEM(float, scratch);
  const int tid = threadIdx.x;
  const float v = in[blockIdx.x * blockDim.x + tid];
  const float total = block_reduce_sum(v, scratch);
  const float best = block_reduce_max(v, scratch);
  const unsigned ballot = __ballot_sync(FULL_MASK, v > 0.0f);
  const int positive = __syncthreads_count(v > 0.0f);
  lanes[(blockIdx.x * blockDim.x + tid) * 3 + 0] = __shfl_up_sync(FULL_MASK, v, 1);
  lanes[(blockIdx.x * blockDim.x + tid) * 3 + 1] = __shfl_down_sync(FULL_MASK, v, 2);
  lanes[(blockIdx.x * blockDim.x + tid) * 3 + 2] = __shfl_sync(FULL_MASK, v, 5);
  atomicAdd(&counters[0], 1);
  atomicMax(&counters[1], (int)(v * 1000.0f));
  atomicAdd(&out[blockIdx.x * 4 + 3], 1.0f);
  if (tid == 0) {
    out[blockIdx.x * 4 + 0] = total;
    out[blockIdx.x * 4 + 1] = best;
    out[blockIdx.x * 4 + 2] = (float)positive;
    counters[2 + blockIdx.x] = (int)ballot;
  }
}

extern "C" __global__ void read_before_write(float* out) {
  DYNAMIC_SMEM(float, scratch);
  out[threadIdx.x] = scratch[threadIdx.x];
  scratch[threadIdx.x] = 1.0f;
}
'''


@pytest.fixture(scope="module")
def probe_module():
    if not emu_backend.compiler_available():
        pytest.skip("needs g++")
    code = sources.read(sources.PRELUDE) + PROBE
    return emu_backend.EmuModule(code, emu_backend.build(code))


def test_reductions_shuffles_votes_and_atomics(probe_module):
    blocks, threads = 2, 64
    x = torch.randn(blocks * threads, generator=torch.Generator().manual_seed(0))
    out, lanes = torch.zeros(blocks * 4), torch.zeros(blocks * threads, 3)
    counters = torch.tensor([0, -10 ** 6, 0, 0], dtype=torch.int32)
    probe_module.get_function("probe")((blocks,), (threads,), (c_ptr(out), c_ptr(lanes), c_ptr(counters), c_ptr(x)),
                                       shared_mem=4 * threads // 32)
    per_block = x.view(blocks, threads)
    torch.testing.assert_close(out.view(blocks, 4)[:, 0], per_block.sum(1), atol=1e-5, rtol=1e-5)
    assert out.view(blocks, 4)[:, 1].tolist() == per_block.max(1).values.tolist()
    assert out.view(blocks, 4)[:, 2].tolist() == (per_block > 0).sum(1).float().tolist()
    assert out.view(blocks, 4)[:, 3].tolist() == [float(threads)] * blocks
    assert counters[0] == blocks * threads
    assert counters[1] == int((x * 1000).int().max())
    warp0 = (x[:32] > 0).tolist()
    assert counters[2] & 0xffffffff == sum(1 << i for i, positive in enumerate(warp0) if positive)
    warps = x.view(-1, 32)
    up = torch.cat([warps[:, :1], warps[:, :-1]], 1).flatten()      # lane 0 keeps its own value
    down = torch.cat([warps[:, 2:], warps[:, -2:]], 1).flatten()     # the last two lanes keep theirs
    assert torch.equal(lanes[:, 0], up) and torch.equal(lanes[:, 1], down)
    assert torch.equal(lanes[:, 2], warps[:, 5:6].expand(-1, 32).flatten())


def test_dynamic_shared_memory_is_poisoned_before_each_block(probe_module):
    out = torch.zeros(32)
    kernel = probe_module.get_function("read_before_write")
    kernel((3,), (32,), (c_ptr(out),), shared_mem=4 * 32)
    assert out.isnan().all()


def test_launches_check_argument_types_like_the_c_signature(probe_module):
    kernel = probe_module.get_function("read_before_write")
    out = torch.zeros(32)
    with pytest.raises(TypeError, match="numpy.uint64"):
        kernel((1,), (32,), (out.data_ptr(),), shared_mem=128)       # a Python int: 8 bytes on CuPy
    with pytest.raises(TypeError, match="1 parameters"):
        kernel((1,), (32,), (c_ptr(out), c_int(3)), shared_mem=128)
    with pytest.raises(ValueError, match="empty launch"):
        kernel((0,), (32,), (c_ptr(out),), shared_mem=128)
    with pytest.raises(TypeError, match="tuples"):
        kernel([1], (32,), (c_ptr(out),))


def test_signatures_are_parsed_from_every_source():
    for name in sources.source_names():
        found = sources.signatures(sources.program(name))
        assert set(sources.KERNEL_SOURCES.get(name, found)) <= set(found), name
    params = sources.signatures(sources.program("kv_cache.cu"))["write_kv"].params
    assert [p.ctype for p in params] == ["pointer"] * 5 + ["int", "long long", "long long"]


TSAN_ENV_VAR = "BATCH_MANAGER_TSAN"
slow_tsan = pytest.mark.skipif(os.environ.get(TSAN_ENV_VAR) != "1",
                               reason=f"ThreadSanitizer over the KV kernels takes ~20 s; set {TSAN_ENV_VAR}=1")


def _tsan_run(mode: str) -> subprocess.CompletedProcess:
    if not emu_backend.compiler_available():
        pytest.skip("needs g++")
    library = subprocess.run(["g++", "-print-file-name=libtsan.so"], capture_output=True, text=True).stdout.strip()
    if not library or not os.path.isabs(library) or not os.path.exists(library):
        pytest.skip("ThreadSanitizer runtime (libtsan) not installed")
    env = {**os.environ, "LD_PRELOAD": library, "TSAN_OPTIONS": "halt_on_error=1 exitcode=66",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "tests.runtime.kernels.tsan_probe", mode], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    if "FATAL: ThreadSanitizer" in done.stderr:   # e.g. a kernel whose mmap layout TSan cannot handle
        pytest.skip(f"ThreadSanitizer cannot run here: {done.stderr.strip().splitlines()[0]}")
    return done


def test_thread_sanitizer_catches_a_missing_syncthreads():
    racy = _tsan_run("racy")
    assert racy.returncode == 66 and "data race" in racy.stderr, racy.stderr[-2000:]


@slow_tsan
def test_the_barrier_and_the_kv_kernels_are_race_free_under_thread_sanitizer():
    done = _tsan_run("clean")
    assert done.returncode == 0, done.stderr[-3000:]
