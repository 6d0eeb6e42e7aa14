"""Weights the native kernels stream, held in transparent huge pages.

A one-stream generation step reads every weight once, so its rate is the rate memory delivers
them. On 4 KiB pages that rate is lower: every 4 KiB costs a TLB miss and the hardware prefetchers
stop at page boundaries. `hold(t)` copies a prepared weight into anonymous memory advised
MADV_HUGEPAGE (chunks of CHUNK_BYTES, 2 MiB aligned, each weight at a 256-byte boundary), so the
kernel backs it with 2 MiB pages where it can. The copy replaces the tensor it was made from: an
engine's mapped file pages (float32, bf16) or a repacked weight's heap allocation (blocks, int8
activations); the caller drops the original, so a process still holds one copy.

Measured (SmolLM2-135M float32's weights per token, 538 MB, one-row GEMV, 2 threads, AMD EPYC Zen 4,
kernel 6.18 with THP on madvise): 4 KiB pages 25-27 GB/s, huge pages 30-31 GB/s.

Chunk memory: a weight of at least CHUNK_BYTES / 4 gets a mapping of its own; smaller ones share
the current chunk. `seal()` (the model runner calls it once a model's weights are prepared) retires
the current chunk, so the next model starts a new one and a chunk is unmapped when the last weight
in it is freed. A retired chunk's pages after its last weight (and a mapping's own after its weight)
are given back, the rest of the huge page its last weight ends in included: unused address space,
not memory.

Off (weights stay where they are) where the kernel has no transparent huge pages or has them set to
never, for a non-CPU or empty tensor, where the mapping is refused (OSError: a strict overcommit
limit), and with BATCH_MANAGER_HUGE_PAGES=0.
"""
from __future__ import annotations

import functools
import mmap
import os
import threading

import torch

HUGE_PAGE_BYTES = 2 << 20
CHUNK_BYTES = 64 << 20   # a model's small weights share chunks; each chunk's size counts in the commit charge
ALIGN_BYTES = 256
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def huge_pages_available() -> bool:
    """Whether this kernel can back advised anonymous memory with transparent huge pages (read once
    per process, not once per weight)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def enabled() -> bool:
    """Whether `hold` copies weights into huge pages (BATCH_MANAGER_HUGE_PAGES=0: no)."""
    return os.environ.get("BATCH_MANAGER_HUGE_PAGES", "1") != "0" and huge_pages_available()


def _trim(region: mmap.mmap, used: int) -> None:
    """Give back the pages of `region` after its first `used` bytes: the rest of the huge page that
    holds its last weight (faulted whole, zero-filled) is split and returned."""
    start = -(-used // mmap.PAGESIZE) * mmap.PAGESIZE
    if start < len(region):
        region.madvise(mmap.MADV_DONTNEED, start, len(region) - start)


def _advised_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping with room for `nbytes` from a 2 MiB boundary: (mapping, that offset)."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    address = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    return region, -address % HUGE_PAGE_BYTES


class _Chunks:
    """The current shared chunk: bump allocation at ALIGN_BYTES, under a lock (models may be built
    on several threads at once)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.region: mmap.mmap | None = None
        self.used = self.end = 0

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of contiguous `t` in huge-page-advised memory."""
        nbytes = t.numel() * t.element_size()
        if nbytes >= CHUNK_BYTES // 4:
            region, start = _advised_mapping(nbytes)
            out = _copy(region, start, t)
            _trim(region, start + nbytes)
            return out
        with self.lock:
            start = -(-self.used // ALIGN_BYTES) * ALIGN_BYTES
            if self.region is None or start + nbytes > self.end:
                self._retire()
                self.region, start = _advised_mapping(CHUNK_BYTES)
                self.end = start + CHUNK_BYTES
            self.used = start + nbytes
            return _copy(self.region, start, t)

    def _retire(self) -> None:
        if self.region is not None:
            _trim(self.region, self.used)
        self.region, self.used, self.end = None, 0, 0

    def seal(self) -> None:
        with self.lock:
            self._retire()


def _copy(region: mmap.mmap, start: int, t: torch.Tensor) -> torch.Tensor:
    out = torch.frombuffer(region, dtype=torch.uint8, count=t.numel() * t.element_size(), offset=start)
    out = out.view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


_CHUNKS = _Chunks()


def hold(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values, contiguous, in huge-page-advised memory (a new tensor of t's dtype and shape);
    `t` itself, contiguous, where huge pages are off (module docstring)."""
    t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes == 0 or not enabled():
        return t
    try:
        return _CHUNKS.place(t)
    except OSError:   # no address space or commit charge left for a mapping: the weight stays put
        return t


def seal() -> None:
    """Retire the current shared chunk (module docstring): call once a model's weights are held."""
    _CHUNKS.seal()
