"""Every cuda_src/ program compiles with the NVRTC library (the compiler CuPy's RawModule uses)
for sm_80 and sm_90: standalone (every define at its default), as the cuda backend specialises it
for each storage dtype, and through ptxas to a cubin. Needs no driver and no GPU."""
from __future__ import annotations

import re

import pytest
import torch

from runtime.kernels.cuda import nvrtc, sources
from runtime.kernels.cuda.cuda_backend import NVRTC_OPTIONS
from runtime.kernels.cuda.launchers import DTYPE_CODES, LaunchConfig

pytestmark = pytest.mark.skipif(nvrtc.load() is None, reason="NVRTC library not found: pip install nvidia-cuda-nvrtc "
                                                             "(part of the test extra)")
ARCHS = ["compute_80", "compute_90"]
OPTIONS = NVRTC_OPTIONS + ("-ftz=true",)   # CuPy appends -ftz=true to every compile


def entries(ptx: bytes) -> set[str]:
    return set(re.findall(r"\.entry\s+(\w+)", ptx.decode(errors="replace")))


def test_nvrtc_version():
    assert nvrtc.version() >= (12, 0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sources.source_names())
def test_compiles_standalone_with_the_prelude_as_a_header(name, arch):
    """The file as it is on disk: `#include "prelude.cuh"` served as an NVRTC header, no defines."""
    ptx = nvrtc.compile_program(sources.read(name), name, arch, OPTIONS,
                                headers={sources.PRELUDE: sources.read(sources.PRELUDE)})
    assert set(sources.signatures(sources.program(name))) <= entries(ptx)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPE_CODES), ids=str)
@pytest.mark.parametrize("name", sorted(sources.KERNEL_SOURCES))
def test_compiles_as_the_cuda_backend_specialises_it(name, dtype, arch):
    code = sources.program(name, LaunchConfig().defines(dtype))
    assert entries(nvrtc.compile_program(code, name, arch, OPTIONS)) == set(sources.KERNEL_SOURCES[name])


@pytest.mark.parametrize("name", sorted(sources.KERNEL_SOURCES))
def test_assembles_to_a_cubin_for_sm_90(name):
    code = sources.program(name, LaunchConfig().defines(torch.float16))
    cubin = nvrtc.compile_program(code, name, "sm_90", OPTIONS, cubin=True)
    assert cubin[:4] == b"\x7fELF"


def test_a_compile_error_carries_the_log():
    with pytest.raises(nvrtc.NvrtcError, match="undefined_identifier"):
        nvrtc.compile_program('extern "C" __global__ void broken() { undefined_identifier = 1; }', "broken.cu",
                              "compute_90")
