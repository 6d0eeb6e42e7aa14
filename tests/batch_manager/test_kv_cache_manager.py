"""KvCacheManager: exact block ids handed out, freed and reused; counters; invariants."""
from __future__ import annotations

import pytest

from batch_manager.kv_cache_manager import KvCacheManager


def make_kv(num_blocks: int = 8, tokens_per_block: int = 4) -> KvCacheManager:
    return KvCacheManager(num_blocks, tokens_per_block)


def test_fresh_pool_allocates_in_order():
    kv = make_kv()
    assert kv.allocate(1, 5)            # 5 tokens / 4 per block -> 2 blocks
    assert kv.allocate(2, 4)            # exactly one full block
    assert kv.allocate(3, 9)
    assert kv.block_table(1) == [0, 1]
    assert kv.block_table(2) == [2]
    assert kv.block_table(3) == [3, 4, 5]
    assert (kv.num_free_blocks, kv.num_used_blocks) == (2, 6)
    kv.check_invariants()


def test_growing_allocates_only_missing_blocks():
    kv = make_kv()
    assert kv.allocate(1, 3)
    assert kv.allocate(2, 1)
    assert kv.block_table(1) == [0]
    assert kv.allocate(1, 4)            # still fits block 0
    assert kv.block_table(1) == [0]
    assert kv.num_allocated_total == 2
    assert kv.allocate(1, 5)            # one more block, after request 2's
    assert kv.block_table(1) == [0, 2]
    assert kv.allocate(1, 12)
    assert kv.block_table(1) == [0, 2, 3]
    assert kv.allocate(1, 2)            # shrinking asks for nothing and frees nothing
    assert kv.block_table(1) == [0, 2, 3]
    assert kv.num_allocated_total == 4
    assert kv.num_blocks_missing(1, 16) == 1
    assert kv.num_blocks_missing(1, 13) == 1
    assert kv.num_blocks_missing(1, 12) == 0
    assert kv.num_blocks_missing(99, 1) == 1
    kv.check_invariants()


def test_allocate_fails_without_change_when_blocks_run_out():
    kv = make_kv(num_blocks=4)
    assert kv.allocate(1, 8)            # blocks 0, 1
    assert kv.allocate(2, 4)            # block 2
    assert not kv.allocate(1, 13)       # needs 2 more, 1 free
    assert not kv.allocate(3, 8)        # new request needing 2, 1 free
    assert kv.block_table(1) == [0, 1]
    assert kv.block_table(3) == []
    assert not kv.holds(3)
    assert kv.num_free_blocks == 1
    assert kv.num_allocated_total == 3
    assert kv.num_allocated_new == 3
    assert kv.allocate(1, 12)           # exactly the last block still works
    assert kv.block_table(1) == [0, 1, 3]
    assert kv.num_free_blocks == 0
    assert not kv.allocate(4, 1)
    kv.check_invariants()


def test_free_returns_blocks_to_the_end_of_the_free_list():
    kv = make_kv(num_blocks=6)
    assert kv.allocate(1, 8)            # [0, 1]
    assert kv.allocate(2, 8)            # [2, 3]
    assert kv.free(1) == 2              # free list: 4, 5, 0, 1
    assert not kv.holds(1)
    assert kv.block_table(1) == []
    assert kv.num_free_blocks == 4
    assert kv.allocate(3, 12)           # never-used blocks first, then the freed ones
    assert kv.block_table(3) == [4, 5, 0]
    assert kv.free(2) == 2              # free list: 1, 2, 3
    assert kv.allocate(4, 12)
    assert kv.block_table(4) == [1, 2, 3]
    assert kv.free(1) == 0              # freeing twice (or an unknown id) is a no-op
    assert kv.free(123) == 0
    kv.check_invariants()


def test_allocation_counters_and_start_iteration():
    kv = make_kv()
    assert (kv.num_allocated_total, kv.num_allocated_new) == (0, 0)
    kv.allocate(1, 5)
    kv.allocate(2, 1)
    assert (kv.num_allocated_total, kv.num_allocated_new) == (3, 3)
    kv.start_iteration()
    assert (kv.num_allocated_total, kv.num_allocated_new) == (3, 0)
    kv.allocate(2, 5)
    kv.free(1)                          # freeing does not lower either counter
    assert (kv.num_allocated_total, kv.num_allocated_new) == (4, 1)
    kv.allocate(3, 4)                   # reuses a freed block: still counts as allocated
    assert (kv.num_allocated_total, kv.num_allocated_new) == (5, 2)
    assert not kv.allocate(4, 100)      # a failed allocation counts nothing
    assert (kv.num_allocated_total, kv.num_allocated_new) == (5, 2)


def test_check_invariants_detects_a_block_held_twice_and_a_lost_block():
    kv = make_kv(num_blocks=4)
    kv.allocate(1, 4)
    kv.allocate(2, 4)
    kv.check_invariants()
    kv._request_to_blocks[2].append(0)          # block 0 held by 1 and 2
    with pytest.raises(AssertionError):
        kv.check_invariants()
    kv._request_to_blocks[2].pop()
    kv._free_block_ids.popleft()                # a block that nobody holds and is not free
    with pytest.raises(AssertionError):
        kv.check_invariants()


@pytest.mark.parametrize("num_tokens, num_blocks", [(1, 1), (2, 2), (7, 7)])
def test_one_token_per_block(num_tokens, num_blocks):
    kv = make_kv(num_blocks=8, tokens_per_block=1)
    assert kv.blocks_for_tokens(num_tokens) == num_blocks
    assert kv.allocate(1, num_tokens)
    assert kv.block_table(1) == list(range(num_blocks))
    assert kv.allocate(1, num_tokens + 1)      # every new token needs a new block
    assert kv.block_table(1) == list(range(num_blocks + 1))


@pytest.mark.parametrize("num_tokens, num_blocks", [(1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3), (64, 4)])
def test_sixteen_tokens_per_block_boundaries(num_tokens, num_blocks):
    kv = make_kv(num_blocks=4, tokens_per_block=16)
    assert kv.blocks_for_tokens(num_tokens) == num_blocks
    assert kv.allocate(1, num_tokens)
    assert kv.block_table(1) == list(range(num_blocks))
    assert kv.num_free_blocks == 4 - num_blocks


def test_exactly_full_pool():
    kv = make_kv(num_blocks=4, tokens_per_block=16)
    assert kv.allocate(1, 64)
    assert kv.num_free_blocks == 0
    assert not kv.allocate(1, 65)
    assert kv.block_table(1) == [0, 1, 2, 3]
    assert make_kv(num_blocks=4, tokens_per_block=16).allocate(1, 65) is False


def test_blocks_for_zero_tokens_is_zero():
    kv = make_kv()
    assert kv.blocks_for_tokens(0) == 0
    assert kv.allocate(1, 0)
    assert kv.block_table(1) == []
    assert kv.num_free_blocks == 8


@pytest.mark.parametrize("num_blocks, tokens_per_block", [(0, 4), (4, 0), (-1, 4)])
def test_rejects_non_positive_sizes(num_blocks, tokens_per_block):
    with pytest.raises(ValueError, match="must be positive"):
        KvCacheManager(num_blocks, tokens_per_block)
