"""The raw CUDA sources of cuda_src/ as compilable text: prelude inlined, specialising defines
prepended, and the `extern "C"` kernel signatures parsed out of them.

Used by the cuda backend (CuPy RawModule code strings), the emu backend (g++ translation units)
and the NVRTC compile tests. No CuPy, no torch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

PRELUDE = "prelude.cuh"
SHIM = "emu/shim.h"
# source file -> kernel entry points it defines
KERNEL_SOURCES = {
    "kv_cache.cu": ("write_kv", "write_kv_quant", "copy_blocks"),
    "paged_attention.cu": ("decode_attention_partition", "decode_attention_partition_int8", "decode_attention_merge"),
    "philox.cu": ("philox_uniforms", "philox4x32_raw"),
    "logits_processing.cu": ("apply_penalties", "ban_tokens"),
    "sampling.cu": ("greedy_tokens", "log_softmax_rows", "sample_tokens"),
    "beam_search.cu": ("beam_topk_per_beam", "beam_select"),
    "token_filters.cu": ("apply_token_bitmask", "apply_min_p", "top_log_probs"),
}
_INCLUDE_PRELUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"prelude\.cuh"[ \t]*$', re.M)
_SIGNATURE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)')
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)

# C scalar parameter types the launchers may pass, and the numpy scalar type each one needs.
SCALAR_TYPES = {
    "int": "int32", "unsigned int": "uint32", "unsigned": "uint32", "long long": "int64",
    "unsigned long long": "uint64", "float": "float32", "double": "float64",
}


def read(name: str) -> str:
    """Raw text of cuda_src/<name>."""
    return resources.files("cuda_src").joinpath(name).read_text()


def source_names() -> list[str]:
    """Every kernel source file (*.cu) of cuda_src/, sorted."""
    return sorted(entry.name for entry in resources.files("cuda_src").iterdir() if entry.name.endswith(".cu"))


def program(name: str, defines: dict[str, int | str] | None = None) -> str:
    """cuda_src/<name> as one self-contained string: `#define`s first, the prelude inlined.

    NOTE: inlining (rather than `-I` + `#include`) keeps the whole program in the text CuPy hashes
    for its on-disk cache key, so an edited prelude can never be served as a stale binary.
    """
    text = read(name)
    assert _INCLUDE_PRELUDE.search(text), f"{name}: must include \"{PRELUDE}\""
    text = _INCLUDE_PRELUDE.sub(lambda _: read(PRELUDE), text, count=1)
    header = "".join(f"#define {key} {value}\n" for key, value in sorted((defines or {}).items()))
    return header + text


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str          # normalised: "int", "long long", "float", ... or "pointer"

    @property
    def is_pointer(self) -> bool:
        return self.ctype == "pointer"


@dataclass(frozen=True)
class Signature:
    name: str
    params: tuple[Param, ...]


def signatures(code: str) -> dict[str, Signature]:
    """kernel name -> its parameter list, for every `extern "C" __global__` entry point of `code`."""
    found = {}
    for match in _SIGNATURE.finditer(_COMMENTS.sub(" ", code)):
        params = []
        for raw in match.group(2).split(","):
            raw = " ".join(raw.split())
            if not raw:
                continue
            ident = re.search(r"(\w+)$", raw)
            assert ident, f"{match.group(1)}: cannot parse parameter {raw!r}"
            ctype = raw[:ident.start()].replace("__restrict__", " ").replace("const ", " ")
            ctype = " ".join(ctype.split())
            if "*" in ctype:
                ctype = "pointer"
            elif ctype not in SCALAR_TYPES:
                raise AssertionError(f"{match.group(1)}: unsupported parameter type {ctype!r} in {raw!r}")
            params.append(Param(ident.group(1), ctype))
        found[match.group(1)] = Signature(match.group(1), tuple(params))
    return found
