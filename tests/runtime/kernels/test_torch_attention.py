"""The CPU fast paths of attention (cpu_attention.py: rows grouped by length, gathers into
per-thread workspaces, a plan per step) against the plain reference (torch_attention.py)."""
from __future__ import annotations

import itertools
import threading

import pytest
import torch

from runtime.kernels.torch_kernels import cpu_attention, torch_attention
from runtime.kernels.torch_kernels.cpu_attention import GROUP_COST_BLOCK_ROWS, CpuAttention, length_groups
from runtime.kernels.torch_kernels.torch_backend import TorchKernels


def padded_cost(groups: list[list[int]], blocks: list[int]) -> int:
    return sum(len(g) * max(blocks[r] for r in g) + GROUP_COST_BLOCK_ROWS for g in groups)


def test_length_groups_cover_every_row_once_sorted_by_blocks():
    lens = [5, 70, 300, 130, 200, 384, 64, 65, 1, 257]
    groups = length_groups(lens, 64)
    assert sorted(itertools.chain(*groups)) == list(range(len(lens)))
    blocks = [-(-n // 64) for n in lens]
    flat = [blocks[r] for g in groups for r in g]
    assert flat == sorted(flat)


def test_length_groups_single_group_for_equal_block_counts():
    assert length_groups([65, 100, 128], 64) == [[0, 1, 2]]


def test_length_groups_is_optimal_over_contiguous_splits():
    """Brute force over every split of the sorted distinct block counts."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        lens = torch.randint(1, 600, (int(torch.randint(2, 40, (1,), generator=gen)),), generator=gen).tolist()
        blocks = [-(-n // 64) for n in lens]
        counts = sorted(set(blocks))
        best = min(
            padded_cost([[r for r in range(len(lens)) if lo <= blocks[r] <= hi]
                         for lo, hi in zip([counts[0]] + [counts[c] for c in cuts],
                                           [counts[c - 1] for c in cuts] + [counts[-1]])], blocks)
            for k in range(len(counts))
            for cuts in itertools.combinations(range(1, len(counts)), k))
        assert padded_cost(length_groups(lens, 64), blocks) == best


def test_length_groups_split_a_batch_with_a_long_outlier():
    # 20 one-block rows and one 10-block row: padding all to 10 costs 210 block-rows.
    lens = [10] * 20 + [640]
    groups = length_groups(lens, 64)
    assert groups == [list(range(20)), [20]]


def _cache(num_blocks: int, tpb: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, tpb, 2, 8, generator=gen)
    v = torch.randn(num_blocks, tpb, 2, 8, generator=gen)
    return k, v


@pytest.mark.parametrize("window,sink", [(None, 0), (7, 0), (9, 3)])
def test_grouped_decode_attention_equals_per_row_dense_attention(monkeypatch, window, sink):
    tpb, lens = 4, [3, 17, 9, 1, 30, 16, 5]
    k_cache, v_cache = _cache(64, tpb, seed=1)
    gen = torch.Generator().manual_seed(2)
    tables = torch.randperm(64, generator=gen)[:len(lens) * 8].view(len(lens), 8).int()
    q = torch.randn(len(lens), 4, 8, generator=gen)
    ref = torch_attention
    expected = torch.stack([
        ref.dense_attention(q[i:i + 1], ref.gather_kv(k_cache, tables[i:i + 1], n)[0],
                            ref.gather_kv(v_cache, tables[i:i + 1], n)[0], n - 1, 0.3, window, sink)[0]
        for i, n in enumerate(lens)])
    seq_lens = torch.tensor(lens)
    torch.testing.assert_close(ref.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.3, window, sink),
                               expected, atol=1e-6, rtol=1e-5)  # the reference: one padded call
    for group_cost in (0, 10_000):  # as many groups as block counts, then one padded call
        monkeypatch.setattr(cpu_attention, "GROUP_COST_BLOCK_ROWS", group_cost)
        num_groups = len(length_groups(lens, tpb))
        assert num_groups == (len({-(-n // tpb) for n in lens}) if group_cost == 0 else 1)
        fast = CpuAttention()  # its own plan cache: each setting computes its plan
        for _ in range(2):  # the second call (the next layer of a step) reuses the plan
            got = fast.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.3, window, sink)
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_gathers_reuse_a_per_thread_workspace():
    k_cache, _ = _cache(16, 4, seed=3)
    fast = CpuAttention()
    table = torch.arange(16, dtype=torch.int32).view(2, 8)
    first = fast.gather_kv(k_cache, table, 30, workspace_slot=0)
    torch.testing.assert_close(first, torch_attention.gather_kv(k_cache, table, 30))
    smaller = fast.gather_kv(k_cache, table[:1], 12, workspace_slot=0)
    assert smaller.data_ptr() == first.data_ptr()  # no new allocation for a smaller gather
    other = {}
    thread = threading.Thread(target=lambda: other.update(
        t=fast.gather_kv(k_cache, table, 30, workspace_slot=0)))
    thread.start()
    thread.join()
    assert other["t"].data_ptr() != first.data_ptr()
    torch.testing.assert_close(other["t"], torch_attention.gather_kv(k_cache, table, 30))


def test_a_changed_block_table_or_length_gets_a_new_plan():
    tpb, lens = 4, [6, 3]
    k_cache, v_cache = _cache(16, tpb, seed=4)
    q = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(5))
    fast = CpuAttention()
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    fast.decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), 0.3, None)
    tables[0, 1] = 7  # changed in place, as a caller reusing its tensor would
    for seq_lens in (torch.tensor(lens), torch.tensor([7, 3])):
        torch.testing.assert_close(fast.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.3, None),
                                   torch_attention.decode_attention(q, k_cache, v_cache, tables.clone(),
                                                                    seq_lens.clone(), 0.3, None))


def test_one_group_of_unsorted_rows_keeps_their_order():
    """Several block counts, yet one group is cheapest: the rows are attended as they come."""
    tpb, lens = 4, [9, 2, 5, 12]
    k_cache, v_cache = _cache(32, tpb, seed=6)
    tables = torch.randperm(32, generator=torch.Generator().manual_seed(7))[:16].view(4, 4).int()
    q = torch.randn(4, 4, 8, generator=torch.Generator().manual_seed(8))
    assert len(length_groups(lens, tpb)) == 1
    seq_lens = torch.tensor(lens)
    torch.testing.assert_close(CpuAttention().decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.3, 5),
                               torch_attention.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.3, 5))


@pytest.mark.parametrize("past_len,window,sink", [(0, None, 0), (13, None, 0), (13, 6, 2)])
def test_context_attention_through_workspaces_equals_the_reference(past_len, window, sink):
    tpb, n = 4, 7
    k_cache, v_cache = _cache(16, tpb, seed=9)
    table = torch.randperm(16, generator=torch.Generator().manual_seed(10))[:6].int()
    q = torch.randn(n, 4, 8, generator=torch.Generator().manual_seed(11))
    fast = CpuAttention()
    for _ in range(2):  # the second call reuses the workspaces
        torch.testing.assert_close(fast.context_attention(q, k_cache, v_cache, table, past_len, 0.3, window, sink),
                                   torch_attention.context_attention(q, k_cache, v_cache, table, past_len, 0.3,
                                                                     window, sink))


def test_the_torch_backend_uses_the_fast_paths_only_when_asked():
    tpb, lens = 4, [3, 17, 9]
    k_cache, v_cache = _cache(32, tpb, seed=12)
    tables = torch.randperm(32, generator=torch.Generator().manual_seed(13))[:15].view(3, 5).int()
    q = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(14))
    fast, plain = TorchKernels(fast_paths=True), TorchKernels()
    assert fast.cpu_attention is not None and plain.cpu_attention is None
    torch.testing.assert_close(fast.decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), 0.3, None),
                               plain.decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), 0.3, None))
    assert "decode_plan" in fast.cpu_attention.thread_state()  # the call went through the plan
