"""Beam block tables: forks share blocks, the next write copies only a shared block, everything
is freed at the end (exact block ids and reference counts)."""
from __future__ import annotations

import pytest

from runtime.cache.beam_blocks import beam_holder, fork_beams, free_beams, max_beam_blocks, prepare_beam_writes
from runtime.cache.kv_cache_manager import KvCacheManager


def tables(kv, request_id, num_beams):
    return [kv.block_table(beam_holder(request_id, b)) for b in range(num_beams)]


def test_fork_then_copy_on_write_then_reorder_then_free():
    kv = KvCacheManager(num_blocks=12, tokens_per_block=4)
    assert kv.allocate(7, 6)                       # a 6-token prompt: blocks 0, 1 (block 1 half full)
    fork_beams(kv, 7, num_old_beams=1, parents=[0, 0, 0])
    assert tables(kv, 7, 3) == [[0, 1]] * 3
    assert (kv.ref_count(0), kv.ref_count(1)) == (3, 3)

    # Every beam writes position 6 (block index 1, shared by 3): two copies, the last keeps block 1.
    copies = []
    prepare_beam_writes(kv, 7, 3, 6, copies)
    assert copies == [(1, 2), (1, 3)]
    assert tables(kv, 7, 3) == [[0, 2], [0, 3], [0, 1]]
    assert [kv.ref_count(b) for b in range(4)] == [3, 1, 1, 1]

    # Beams 0 and 1 continue old beam 1, beam 2 continues old beam 0.
    fork_beams(kv, 7, num_old_beams=3, parents=[1, 1, 0])
    assert tables(kv, 7, 3) == [[0, 3], [0, 3], [0, 2]]
    assert kv.is_free(1) and kv.ref_count(3) == 2
    # Position 7 is still in block index 1: beam 0 copies block 3 into the next free block (4;
    # freed blocks queue at the back), beam 1 then owns block 3 alone.
    copies = []
    prepare_beam_writes(kv, 7, 3, 7, copies)
    assert copies == [(3, 4)]
    # Position 8 starts a new block for every beam: allocations, no copies.
    copies = []
    prepare_beam_writes(kv, 7, 3, 8, copies)
    assert copies == []
    assert [len(t) for t in tables(kv, 7, 3)] == [3, 3, 3]
    kv.check_invariants()

    free_beams(kv, 7, 3)
    assert kv.num_free_blocks == 12
    kv.check_invariants()


def test_identity_fork_changes_nothing_and_bound_counts_copies():
    kv = KvCacheManager(num_blocks=8, tokens_per_block=4)
    kv.allocate(1, 5)
    fork_beams(kv, 1, 1, [0])
    assert tables(kv, 1, 1) == [[0, 1]] and kv.ref_count(1) == 1
    assert max_beam_blocks(kv, 1, 10) == 3
    assert max_beam_blocks(kv, 4, 10) == 4 * (3 + 1)


def test_copy_on_write_that_runs_out_midway_keeps_the_copies_it_made():
    """Regression: the copies made before the pool ran out were lost, so a beam read a block
    that was never filled."""
    kv = KvCacheManager(num_blocks=4, tokens_per_block=4)
    kv.allocate(3, 6)                              # blocks 0, 1
    fork_beams(kv, 3, 1, [0, 0, 0])                # three beams share block 1 (partial)
    assert kv.allocate(99, 4)                      # someone else takes block 2: one free block left
    copies = []
    with pytest.raises(RuntimeError):
        prepare_beam_writes(kv, 3, 3, 6, copies)   # beam 0 copies into block 3; beam 1 finds none
    assert copies == [(1, 3)]
    kv.free(99)
    prepare_beam_writes(kv, 3, 3, 6, copies)       # the retry completes beam 1 only
    assert copies == [(1, 3), (1, 2)]
    assert tables(kv, 3, 3) == [[0, 3], [0, 2], [0, 1]]
    kv.check_invariants()
