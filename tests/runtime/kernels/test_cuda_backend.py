"""The cuda backend. Without a GPU: its CuPy calls, against a stand-in `cupy` module (every
module compiled and loaded at construction, NVRTC options, launches on the stream's device).
With a GPU and CuPy (skipped otherwise): every kernel equals the torch reference on the device.
Its bandwidth figure: `python -m samples.microbench.kernels`."""
from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from runtime.kernels.cuda import sources
from runtime.kernels.cuda.cuda_backend import NVRTC_OPTIONS, CudaKernels, cuda_available
from runtime.kernels.cuda.launchers import DTYPE_CODES
from tests.runtime.kernels.conftest import paged_case, tolerance


class FakeRawModule:
    created: list["FakeRawModule"] = []

    def __init__(self, code, options):
        self.code, self.options, self.fetched = code, options, []
        FakeRawModule.created.append(self)

    def get_function(self, name):
        self.fetched.append(name)
        return lambda *args, **kwargs: FakeRawModule.launches.append((name, args, kwargs))


@pytest.fixture
def fake_cupy(monkeypatch):
    entered = []

    class Device:
        def __init__(self, device_id):
            self.device_id = device_id

        def __enter__(self):
            entered.append(self.device_id)

        def __exit__(self, *exc):
            return False

    cuda = types.SimpleNamespace(Device=Device, ExternalStream=None)
    module = types.ModuleType("cupy")
    module.RawModule, module.cuda = FakeRawModule, cuda
    FakeRawModule.created, FakeRawModule.launches = [], []
    monkeypatch.setitem(sys.modules, "cupy", module)
    return entered


def test_every_module_compiles_and_loads_at_construction(fake_cupy):
    backend = CudaKernels()
    assert len(FakeRawModule.created) == len(sources.KERNEL_SOURCES) * len(DTYPE_CODES)
    for module in FakeRawModule.created:
        assert module.options == NVRTC_OPTIONS
        source = next(name for name, kernels in sources.KERNEL_SOURCES.items() if set(module.fetched) == set(kernels))
        assert module.code in {sources.program(source, backend.config.defines(d)) for d in DTYPE_CODES}
    stream = types.SimpleNamespace(device_id=3)
    backend.function(torch.float16, "write_kv")((1,), (32,), (), shared_mem=0, stream=stream)
    assert fake_cupy == [3] and FakeRawModule.launches[-1][0] == "write_kv"
    with pytest.raises(ValueError, match="no write_kv module for dtype torch.float64"):
        backend.function(torch.float64, "write_kv")


gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device and CuPy")


@pytest.fixture(scope="module")
def cuda_kernels():
    return CudaKernels()


@gpu
@pytest.mark.parametrize("dtype", list(DTYPE_CODES), ids=str)
@pytest.mark.parametrize("window,sink", [(None, 0), (37, 4)])
def test_decode_attention_equals_torch_on_the_device(cuda_kernels, reference, dtype, window, sink):
    q, clean, poisoned, table, lens = paged_case([1, 16, 17, 700, 1500], 8, 2, 64, 16, dtype, window, sink)
    scale = 1 / math.sqrt(64)
    expected = reference.decode_attention(q.float(), *(c.float() for c in clean), table, lens, scale, window, sink)
    got = cuda_kernels.decode_attention(q.cuda(), *(p.cuda() for p in poisoned), table.cuda(), lens.cuda(), scale,
                                        window, sink)
    torch.testing.assert_close(got.cpu().float(), expected, **tolerance(dtype))


@gpu
@pytest.mark.parametrize("dtype", list(DTYPE_CODES), ids=str)
def test_kv_writes_and_copies_equal_torch_on_the_device(cuda_kernels, reference, dtype):
    pool = torch.randn(2, 2, 64, 16, 2, 64, device="cuda").to(dtype)
    expected = pool.clone()
    k, v = torch.randn(2, 40, 2, 64, device="cuda").to(dtype)
    slots = torch.randperm(64 * 16, device="cuda")[:40]
    reference.write_kv(expected[0, 0], expected[0, 1], k, v, slots)
    cuda_kernels.write_kv(pool[0, 0], pool[0, 1], k, v, slots)
    src, dst = torch.tensor([1, 2, 3], device="cuda"), torch.tensor([10, 20, 30], device="cuda")
    reference.copy_blocks(expected, src, dst)
    cuda_kernels.copy_blocks(pool, src, dst)
    assert torch.equal(pool, expected)
