"""Paged decode attention on emu (the cuda_src/ kernel on CPU threads) equals the torch reference:
GQA ratios, 16-bit storage, windows with sinks, released blocks, several partitions."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from runtime.kernels.cuda.emu_backend import EmuKernels
from runtime.kernels.cuda.launchers import (MAX_SHARED_BYTES, LaunchConfig, decode_smem_bytes, fit_tile_size,
                                        plan_partitions)
from tests.runtime.kernels.conftest import paged_case, tolerance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def check(kernels, reference, seq_lens, num_heads=4, num_kv_heads=2, head_dim=16, tokens_per_block=4,
          dtype=torch.float32, window=None, sink=0, release=True, seed=0):
    q, clean, poisoned, table, lens = paged_case(seq_lens, num_heads, num_kv_heads, head_dim, tokens_per_block,
                                                 dtype, window, sink, release=release, seed=seed)
    scale = 1.0 / math.sqrt(head_dim)
    expected = reference.decode_attention(q, *clean, table, lens, scale, window, sink)
    got = kernels.decode_attention(q, *poisoned, table, lens, scale, window, sink)
    assert got.dtype == dtype and got.shape == q.shape
    assert not got.isnan().any(), "read a slot no query may see"
    torch.testing.assert_close(got.float(), expected.float(), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens", [[1], [4], [5], [1, 4, 8, 13], [3, 97]])
def test_lengths_around_block_boundaries(emu, reference, dtype, seq_lens):
    check(emu, reference, seq_lens, dtype=dtype)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2), (8, 1)])
def test_gqa_ratios_and_mqa(emu, reference, num_heads, num_kv_heads):
    check(emu, reference, [7, 40, 70], num_heads=num_heads, num_kv_heads=num_kv_heads)


@pytest.mark.parametrize("window,sink", [(1, 0), (4, 0), (5, 0), (9, 0), (9, 2), (9, 8), (13, 4), (64, 3),
                                         (200, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_edges_and_sinks(emu, reference, window, sink, dtype):
    # Lengths below, at and beyond the window; sinks shorter and longer than the cut.
    check(emu, reference, [1, 8, 9, 10, 30, 75], dtype=dtype, window=window, sink=sink)


@pytest.mark.parametrize("release", [True, False])
def test_released_blocks_are_never_read(emu, reference, release):
    # release=False keeps the ids of the invisible blocks, which then hold NaN: any read shows.
    check(emu, reference, [50, 61], window=8, sink=3, release=release, seed=3)


@pytest.mark.parametrize("partition_size,tile_size,max_partitions", [(1, 1, 256), (8, 3, 64), (13, 13, 64),
                                                                     (32, 8, 64), (1024, 7, 64), (4, 4, 3)])
def test_partitions_and_tiles_merge_to_the_same_result(reference, emu, partition_size, tile_size, max_partitions):
    kernels = EmuKernels(LaunchConfig(attention_threads=64, threads_per_key=4, partition_size=partition_size,
                                      tile_size=tile_size, max_partitions=max_partitions, copy_threads=32))
    check(kernels, reference, [2, 40, 130], seed=partition_size)
    check(kernels, reference, [2, 40, 130], window=20, sink=2, seed=partition_size)


def test_partition_plan_and_tile_fit():
    config = LaunchConfig(partition_size=512, max_partitions=64)
    assert plan_partitions(1, config) == (512, 1)
    assert plan_partitions(513, config) == (512, 2)
    assert plan_partitions(128 * 1024, config) == (2048, 64)
    assert fit_tile_size(4, 128, 512) == 512
    tile = fit_tile_size(32, 128, 512)          # 32 query heads per KV head: the tile shrinks to fit
    assert 1 <= tile < 512 and decode_smem_bytes(32, 128, tile) <= MAX_SHARED_BYTES
    with pytest.raises(ValueError, match="shared memory"):
        fit_tile_size(64, 128, 512)


@pytest.mark.parametrize("head_dim", [20, 64])
def test_head_dims_not_multiple_of_the_lanes(emu_cuda_like, reference, head_dim):
    check(emu_cuda_like, reference, [3, 33], head_dim=head_dim, dtype=torch.float16)


@pytest.mark.parametrize("threads_per_key", [1, 32])
def test_one_and_a_full_warp_of_lanes_per_key(reference, emu, threads_per_key):
    kernels = EmuKernels(LaunchConfig(attention_threads=64, threads_per_key=threads_per_key, partition_size=16,
                                      copy_threads=32), dtypes=(torch.float16,))
    check(kernels, reference, [3, 33], head_dim=24, dtype=torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_launch_configuration(emu_cuda_like, reference, dtype):
    """The block size, lanes per key and partition size the cuda backend uses."""
    check(emu_cuda_like, reference, [1, 130, 600], num_heads=8, num_kv_heads=2, head_dim=32, tokens_per_block=16,
          dtype=dtype)


@pytest.mark.parametrize("seed", range(6))
def test_randomized(emu, reference, seed):
    gen = torch.Generator().manual_seed(seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]  # noqa: E731
    num_kv_heads = pick([1, 2, 3])
    window = pick([None, None, 1, 6, 23])
    check(emu, reference, torch.randint(1, 90, (pick([1, 3, 5]),), generator=gen).tolist(),
          num_heads=num_kv_heads * pick([1, 2, 4]), num_kv_heads=num_kv_heads, head_dim=pick([8, 16, 24]),
          tokens_per_block=pick([1, 3, 4, 16]), dtype=pick(DTYPES), window=window,
          sink=pick([0, 2]) if window else 0, seed=seed)


def test_empty_batch_launches_nothing(emu):
    q = torch.empty(0, 4, 16)
    cache = torch.zeros(2, 4, 2, 16)
    out = emu.decode_attention(q, cache, cache, torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, dtype=torch.int64),
                               0.25, None)
    assert out.shape == (0, 4, 16)


def test_numpy_integers_are_accepted_for_window_and_sink(emu, reference):
    q, clean, _, table, lens = paged_case([30], 4, 2, 16, 4, torch.float32)
    expected = reference.decode_attention(q, *clean, table, lens, 0.25, 8, 2)
    torch.testing.assert_close(emu.decode_attention(q, *clean, table, lens, 0.25, np.int64(8), np.int32(2)), expected)


def test_rejects_bad_window_and_sink(emu):
    q, clean, _, table, lens = paged_case([5], 4, 2, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="window"):
        emu.decode_attention(q, *clean, table, lens, 0.25, 0)
    with pytest.raises(ValueError, match="window"):
        emu.decode_attention(q, *clean, table, lens, 0.25, 4.0)
    with pytest.raises(ValueError, match="sink"):
        emu.decode_attention(q, *clean, table, lens, 0.25, 4, -1)
