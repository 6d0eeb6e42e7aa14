"""The native CPU layer's shape (runtime/kernels/cpu/library.py): one library from its op-family
sources, built once (no source pasted into another), one ctypes table naming every entry point;
the per-op entry points and the fused step share one RMSNorm, silu * up, softmax and paged decode
attention; and the AVX-512 tiers, which this CPU may not run, still compile."""
from __future__ import annotations

import re
import subprocess

import pytest

from runtime.kernels.cpu import library
from runtime.kernels.native_build import CXX, compiler_available

CPU = library.HERE
# Instruction sets whose paths a CPU without them cannot run, compiled here without running.
AVX512_FLAGS = ("-march=haswell", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
                "-mavx512bf16", "-mavxvnni")


def test_every_source_is_part_of_the_one_library():
    on_disk = {p.name for p in CPU.iterdir() if p.suffix in (".cpp", ".h")}
    assert on_disk == set(library.SOURCES) | set(library.HEADERS)


def test_no_source_is_pasted_into_another():
    """Translation units include headers only, and no Python module reads C++ text to paste it."""
    for name in (*library.SOURCES, *library.HEADERS):
        includes = re.findall(r'#include\s+"([^"]+)"', (CPU / name).read_text())
        assert all(include in library.HEADERS for include in includes), (name, includes)
    for module in CPU.glob("*.py"):
        assert ".cpp\")" not in module.read_text().replace("'", '"') or module.name == "library.py", module.name


@pytest.mark.parametrize("function", ["rms_norm_row", "silu_mul_range", "softmax_row", "dot_rows", "attend_chunk",
                                      "combine_chunks", "exp8", "visible_keys"])
def test_each_shared_function_is_defined_once(function):
    """One RMSNorm, one silu * up, one softmax of a row (decode and context attention's), one paged
    decode attention: the per-op entry points
    (ops.cpp) and the fused step (decode_step.cpp) call these, so both compute the same numbers."""
    definition = re.compile(rf"^(?:template <[^>]*>\s*)?(?:inline |static |BM_ONE_COPY )*[\w:<>]+ {function}\(", re.M)
    found = [name for name in (*library.SOURCES, *library.HEADERS)
             for _ in definition.finditer((CPU / name).read_text())]
    assert len(found) == 1, found
    users = [name for name in ("ops.cpp", "decode_step.cpp") if function in (CPU / name).read_text()]
    if function in ("rms_norm_row", "silu_mul_range"):
        assert users == ["ops.cpp", "decode_step.cpp"]


def test_the_loaded_library_has_every_signed_entry_point():
    lib = library.load()
    if lib is None:
        pytest.skip("the native CPU kernels cannot be built here")
    exported = subprocess.run(["nm", "-D", "--defined-only", lib._name], capture_output=True, text=True)
    if exported.returncode != 0:
        pytest.skip("nm is unavailable")
    names = {line.split()[-1] for line in exported.stdout.splitlines() if " T bm_" in line}
    assert names == set(library.SIGNATURES)


def _compiler_takes(flags: tuple[str, ...]) -> bool:
    probe = subprocess.run([CXX, *flags, "-x", "c++", "-E", "-", "-o", "/dev/null"], input="", text=True,
                           capture_output=True)
    return probe.returncode == 0


def test_the_avx512_tiers_compile(tmp_path):
    """AVX-512, AVX512-VNNI, AVX512-BF16 and AVX-VNNI paths built (never loaded: this CPU may lack them)."""
    if not compiler_available() or not _compiler_takes(AVX512_FLAGS):
        pytest.skip(f"{CXX} cannot target AVX-512 here")
    flags = tuple(f for f in library.CXX_FLAGS if f != "-march=native") + AVX512_FLAGS
    path = library.build(flags, name="cpu-native-avx512-compile-check", directory=tmp_path)
    assert path.stat().st_size > 0
