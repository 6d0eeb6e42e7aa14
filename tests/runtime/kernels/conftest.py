"""Fixtures for the kernel tests: emu backends (built once per session into the emu build cache)
and random paged KV caches with their visibility masks."""
from __future__ import annotations

import pytest
import torch

from runtime.kernels.cuda.emu_backend import EmuKernels, compiler_available
from runtime.kernels.cuda.launchers import LaunchConfig
from runtime.kernels.torch_kernels.torch_backend import TorchKernels

# The cuda backend's launch configuration, exercised on emu by a few cases.
CUDA_LIKE = LaunchConfig()


@pytest.fixture(scope="session")
def emu():
    if not compiler_available():
        pytest.skip("emu kernels need a C++20 compiler (g++)")
    return EmuKernels()


@pytest.fixture(scope="session")
def emu_cuda_like(emu):
    return EmuKernels(CUDA_LIKE)


@pytest.fixture(scope="session")
def reference():
    return TorchKernels()


def tolerance(dtype: torch.dtype) -> dict:
    """Float32 math on both sides; 16-bit outputs may round to a neighbouring value."""
    return {torch.float32: dict(atol=2e-6, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}[dtype]


def visible(pos: int, seq_len: int, window: int | None, sink: int) -> bool:
    return pos < seq_len and (window is None or pos >= seq_len - window or pos < sink)


def paged_case(seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, tokens_per_block: int,
               dtype: torch.dtype, window: int | None = None, sink: int = 0, spare_columns: int = 2,
               release: bool = True, seed: int = 0):
    """A random decode-attention problem.

    Returns (q, clean k/v caches, poisoned k/v caches, block_tables int32, seq_lens int64): in the
    poisoned caches every slot no query may see holds NaN; block-table entries of blocks without a
    visible key are negative when `release`, and the table has `spare_columns` of -1 padding."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    blocks_per_seq = [-(-n // tokens_per_block) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq) + spare_columns
    table = torch.full((batch, width), -1, dtype=torch.int32)
    shape = (num_blocks, tokens_per_block, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    k_poison, v_poison = k_cache.clone(), v_cache.clone()
    k_poison[:] = float("nan")
    v_poison[:] = float("nan")
    for s, n in enumerate(seq_lens):
        for j in range(blocks_per_seq[s]):
            block = ids.pop()
            positions = range(j * tokens_per_block, (j + 1) * tokens_per_block)
            seen = [visible(p, n, window, sink) for p in positions]
            table[s, j] = -1 - block if release and not any(seen) else block
            for offset, is_seen in enumerate(seen):
                if is_seen:
                    k_poison[block, offset] = k_cache[block, offset]
                    v_poison[block, offset] = v_cache[block, offset]
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    return q, (k_cache, v_cache), (k_poison, v_poison), table, torch.tensor(seq_lens, dtype=torch.int64)
