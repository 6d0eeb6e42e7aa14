"""Weights held in huge-page-advised memory (runtime/kernels/cpu/weight_memory.py): the values,
the mappings they land in (/proc/self/smaps), the pages given back (/proc/self/pagemap), the switch."""
from __future__ import annotations

import mmap
import struct

import pytest
import torch

from runtime.kernels.cpu import weight_memory

pytestmark = pytest.mark.skipif(not weight_memory.huge_pages_available(),
                                reason="no transparent huge pages on this kernel")


def mapping_of(t: torch.Tensor) -> dict:
    """The /proc/self/smaps entry of the mapping that holds t's first byte: start, end and its
    fields in KiB (THPeligible as given)."""
    address = t.data_ptr()
    with open("/proc/self/smaps") as f:
        entry = None
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                start, end = (int(v, 16) for v in fields[0].split("-"))
                entry = {"start": start, "end": end} if start <= address < end else None
                if entry is not None:
                    found = entry
            elif entry is not None and fields[0].endswith(":") and len(fields) >= 2 and fields[1].isdigit():
                entry[fields[0][:-1]] = int(fields[1])
    return found


def present_pages(start: int, stop: int) -> int:
    """How many of the pages of addresses [start, stop) are in memory (pagemap's bit 63)."""
    first, last = start // mmap.PAGESIZE, -(-stop // mmap.PAGESIZE)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = struct.unpack(f"{last - first}Q", f.read((last - first) * 8))
    return sum(e >> 63 for e in entries)


@pytest.fixture(autouse=True)
def fresh_chunk(monkeypatch):
    monkeypatch.delenv("BATCH_MANAGER_HUGE_PAGES", raising=False)
    weight_memory.seal()
    yield
    weight_memory.seal()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.uint8])
def test_hold_copies_the_values_into_an_advised_mapping(dtype):
    source = (torch.randn(37, 300) * 50).to(dtype)
    view = source.t()   # not contiguous: held contiguous
    held = weight_memory.hold(view)
    assert held.dtype == dtype and held.shape == view.shape and held.is_contiguous()
    assert torch.equal(held, view) and held.data_ptr() != source.data_ptr()
    assert held.data_ptr() % weight_memory.ALIGN_BYTES == 0
    assert mapping_of(held)["THPeligible"] == 1


def test_small_weights_share_a_chunk_until_sealed():
    a, b = weight_memory.hold(torch.ones(1000)), weight_memory.hold(torch.ones(3, 5, dtype=torch.int8))
    assert mapping_of(a)["start"] == mapping_of(b)["start"]
    assert b.data_ptr() == a.data_ptr() + 4096   # 4000 bytes, then the next 256-byte boundary
    weight_memory.seal()
    c = weight_memory.hold(torch.ones(10))   # a new chunk (the kernel may merge it with the last one's mapping)
    assert a.data_ptr() % weight_memory.HUGE_PAGE_BYTES == 0 and c.data_ptr() % weight_memory.HUGE_PAGE_BYTES == 0
    assert c.data_ptr() != a.data_ptr()
    assert torch.equal(a, torch.ones(1000)) and torch.equal(b, torch.ones(3, 5, dtype=torch.int8))


def test_sealing_gives_back_the_pages_after_the_last_weight():
    """The copies fault whole huge pages where the kernel has them; after seal the chunk keeps
    only the pages up to its last weight (rounded up to a page)."""
    held = weight_memory.hold(torch.full((3 << 20,), 7, dtype=torch.uint8))   # 3 MiB: ends mid huge page
    end = held.data_ptr() + held.numel()
    chunk_end = held.data_ptr() + weight_memory.CHUNK_BYTES
    weight_memory.seal()
    assert present_pages(held.data_ptr(), end) == (3 << 20) // mmap.PAGESIZE
    assert present_pages(end, chunk_end) == 0
    assert torch.all(held == 7)


def test_a_large_weight_gets_its_own_mapping_from_a_huge_page_boundary():
    nbytes = weight_memory.CHUNK_BYTES // 4
    small = weight_memory.hold(torch.ones(16))
    large = weight_memory.hold(torch.ones(nbytes // 4 + 1))
    assert large.data_ptr() % weight_memory.HUGE_PAGE_BYTES == 0
    assert small.data_ptr() + weight_memory.ALIGN_BYTES != large.data_ptr()   # not in the shared chunk
    assert large[-1].item() == 1.0


def test_switched_off_the_tensor_stays_where_it_is(monkeypatch):
    monkeypatch.setenv("BATCH_MANAGER_HUGE_PAGES", "0")
    t = torch.randn(64, 64)
    assert weight_memory.hold(t).data_ptr() == t.data_ptr()
    view = t.t()
    held = weight_memory.hold(view)
    assert held.is_contiguous() and torch.equal(held, view)


def test_a_refused_mapping_leaves_the_weight_where_it_is(monkeypatch):
    def refuse(nbytes):
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(weight_memory, "_advised_mapping", refuse)
    t = torch.randn(300, 200)
    assert weight_memory.hold(t).data_ptr() == t.data_ptr()
