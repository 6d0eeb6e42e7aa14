"""KvCacheManager: exact block ids handed out, freed and reused; counters; invariants."""
from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from runtime.cache.kv_cache_manager import KvCacheManager


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


def test_allocation_counters_are_cumulative():
    kv = make_kv()
    assert (kv.num_allocated_total, kv.num_allocated_new, kv.num_reused) == (0, 0, 0)
    kv.allocate(1, 5)
    kv.allocate(2, 1)
    assert (kv.num_allocated_total, kv.num_allocated_new) == (3, 3)
    kv.allocate(2, 5)
    kv.free(1)                          # freeing does not lower either counter
    assert (kv.num_allocated_total, kv.num_allocated_new) == (4, 4)
    kv.allocate(3, 4)                   # takes a freed block: still counts as allocated
    assert (kv.num_allocated_total, kv.num_allocated_new) == (5, 5)
    assert not kv.allocate(4, 100)      # a failed allocation counts nothing
    assert (kv.num_allocated_total, kv.num_allocated_new, kv.num_reused) == (5, 5, 0)


def test_check_invariants_detects_a_block_held_twice_and_a_lost_block():
    kv = make_kv(num_blocks=4)
    kv.allocate(1, 4)
    kv.allocate(2, 4)
    kv.check_invariants()
    kv._holder_to_blocks[2].append(0)           # block 0 in two tables, reference count 1
    with pytest.raises(AssertionError):
        kv.check_invariants()
    kv._holder_to_blocks[2].pop()
    kv._free_uncached.popleft()                 # a block that nobody holds and is not free
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


# -- prefix reuse ------------------------------------------------------------------------------------

def reuse_kv(num_blocks: int = 8, tokens_per_block: int = 4, **kwargs) -> KvCacheManager:
    return KvCacheManager(num_blocks, tokens_per_block, enable_block_reuse=True, **kwargs)


def compute(kv: KvCacheManager, holder, tokens: list[int]) -> None:
    """What the executor does once a step computed all of `tokens`: register the full blocks."""
    kv.store_computed_blocks(holder, tokens[kv.num_stored_tokens(holder):], len(tokens))


SYSTEM = list(range(100, 108))     # two full blocks of 4


def test_reuse_hands_out_the_cached_blocks_with_reference_counts():
    kv = reuse_kv()
    a = SYSTEM + [1, 2]
    assert kv.acquire_cached_prefix(1, a) == 0       # nothing cached yet
    assert kv.allocate(1, len(a))
    assert kv.block_table(1) == [0, 1, 2]
    compute(kv, 1, a)                                # blocks 0, 1 are full: cached; block 2 is not
    b = SYSTEM + [3, 4, 5]
    assert kv.find_cached_prefix(b) == [0, 1]
    assert kv.acquire_cached_prefix(2, b) == 8       # request 1 is still running: shared
    assert kv.allocate(2, len(b))
    assert kv.block_table(2) == [0, 1, 3]
    assert [kv.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    assert kv.num_extra_refs == 2
    assert (kv.num_allocated_total, kv.num_allocated_new, kv.num_reused) == (6, 4, 2)
    assert kv.free(1) == 3                           # the shared blocks stay with request 2
    assert [kv.ref_count(i) for i in range(4)] == [1, 1, 0, 1]
    assert kv.num_free_blocks == 5 and kv.num_cached_free_blocks == 0
    compute(kv, 2, b)
    assert kv.free(2) == 3                           # cached blocks become free but stay findable
    assert kv.num_free_blocks == 8 and kv.num_cached_free_blocks == 2
    assert kv.free_block_ids(cached=True) == [1, 0]  # the tail of a sequence is evicted first
    assert kv.acquire_cached_prefix(3, SYSTEM + [9]) == 8
    assert kv.block_table(3) == [0, 1]
    assert kv.num_cached_free_blocks == 0 and kv.ref_count(0) == 1
    kv.check_invariants()


def test_a_prompt_never_reuses_its_last_token():
    kv = reuse_kv()
    kv.allocate(1, 9)
    compute(kv, 1, SYSTEM + [1])
    kv.free(1)
    assert kv.find_cached_prefix(SYSTEM) == [0]      # 8 tokens: the second block is recomputed
    assert kv.find_cached_prefix(SYSTEM + [1]) == [0, 1]
    assert kv.find_cached_prefix(SYSTEM[:4]) == []
    assert kv.find_cached_prefix(SYSTEM[:5]) == [0]
    assert kv.find_cached_prefix([100, 101, 102, 0, 104]) == []   # a different first block
    assert kv.find_cached_prefix(SYSTEM[:4] + [0, 0, 0, 0, 0]) == [0]


def test_the_key_chains_the_parent_block():
    kv = reuse_kv()
    kv.allocate(1, 9)
    compute(kv, 1, SYSTEM + [1])
    kv.free(1)
    # The same second block after a different first block is another key.
    assert kv.find_cached_prefix([0, 0, 0, 0] + SYSTEM[4:] + [1]) == []


def test_cached_free_blocks_are_evicted_least_recently_used_and_only_when_needed():
    kv = reuse_kv(num_blocks=6)
    for holder, first in ((1, 10), (2, 20), (3, 30)):
        tokens = [first] * 4 + [1]
        kv.allocate(holder, 5)
        compute(kv, holder, tokens)
    assert [kv.block_table(h) for h in (1, 2, 3)] == [[0, 1], [2, 3], [4, 5]]
    for holder in (2, 1, 3):                         # freed in this order: LRU 2, 0, 4
        kv.free(holder)
    assert kv.free_block_ids(cached=True) == [2, 0, 4]
    assert kv.free_block_ids(cached=False) == [3, 1, 5]
    assert kv.allocate(4, 12)                        # uncached blocks first: nothing evicted
    assert kv.block_table(4) == [3, 1, 5]
    assert all(kv.find_cached_prefix([f] * 4 + [1]) for f in (10, 20, 30))
    assert kv.acquire_cached_prefix(5, [10] * 4 + [1]) == 4   # touching block 0 takes it out of the LRU
    assert kv.allocate(6, 4)                         # evicts block 2 (request 2's), the oldest
    assert kv.block_table(6) == [2]
    assert kv.find_cached_prefix([20] * 4 + [1]) == []
    assert kv.find_cached_prefix([30] * 4 + [1]) == [4]
    kv.free(5)                                       # block 0 is now the most recently used
    assert kv.free_block_ids(cached=True) == [4, 0]
    assert kv.allocate(7, 4) and kv.block_table(7) == [4]
    assert kv.find_cached_prefix([10] * 4 + [1]) == [0]
    kv.check_invariants()


def test_a_block_computed_twice_is_registered_once():
    kv = reuse_kv()
    tokens = SYSTEM + [1]
    for holder in (1, 2):                            # both start before either registers
        assert kv.acquire_cached_prefix(holder, tokens) == 0
        kv.allocate(holder, len(tokens))
    compute(kv, 1, tokens)
    compute(kv, 2, tokens)                           # duplicates of blocks 0, 1: not registered
    assert kv.block_table(2) == [3, 4, 5]
    kv.free(2)
    assert kv.num_cached_free_blocks == 0            # request 2's copies are ordinary free blocks
    assert kv.find_cached_prefix(tokens) == [0, 1]
    kv.check_invariants()


def test_reuse_disabled_caches_nothing():
    kv = make_kv()
    kv.allocate(1, 9)
    compute(kv, 1, SYSTEM + [1])
    kv.free(1)
    assert kv.find_cached_prefix(SYSTEM + [1]) == []
    assert kv.acquire_cached_prefix(2, SYSTEM + [1]) == 0
    assert kv.num_cached_free_blocks == 0


# -- window and sink tokens --------------------------------------------------------------------------

def test_window_releases_blocks_no_later_query_can_see():
    kv = make_kv(num_blocks=8, tokens_per_block=4)
    kv = KvCacheManager(8, 4, attention_window=8, sink_token_length=2)
    assert kv.allocate(1, 20)
    assert kv.block_table(1) == [0, 1, 2, 3, 4]
    # Queries from position 16 on see keys > 16 - 8, i.e. from 9: blocks [4, 8) is out; [0, 4) holds sinks.
    assert kv.release_invisible_blocks(1, 16) == 1
    assert kv.block_table(1) == [0, -1, 2, 3, 4]
    assert kv.release_invisible_blocks(1, 16) == 0
    assert kv.release_invisible_blocks(1, 20) == 1   # keys from 13 on: block [8, 12) goes
    assert kv.block_table(1) == [0, -1, -1, 3, 4]
    assert kv.num_blocks_held(1) == 3 and kv.num_free_blocks == 5
    assert kv.num_blocks_missing(1, 21) == 1         # table positions, released ones included
    assert kv.allocate(1, 21) and kv.block_table(1) == [0, -1, -1, 3, 4, 5]
    assert kv.free(1) == 4
    kv.check_invariants()


def test_window_without_sinks_and_a_shared_block():
    kv = KvCacheManager(8, 4, enable_block_reuse=True, attention_window=4)
    tokens = SYSTEM + [1, 2, 3, 4]
    kv.allocate(1, 12)
    compute(kv, 1, tokens)
    assert kv.acquire_cached_prefix(2, tokens + [5]) == 12
    assert kv.ref_count(0) == 2
    assert kv.release_invisible_blocks(1, 12) == 2   # keys from 9 on: blocks 0 and 1 go
    assert kv.block_table(1) == [-1, -1, 2]
    assert [kv.ref_count(b) for b in (0, 1, 2)] == [1, 1, 2]
    kv.check_invariants()


@pytest.mark.parametrize("window, sink, step, expected", [
    (None, 0, 10, 25), (8, 0, 1, 3), (8, 2, 1, 4), (8, 0, 10, 6), (1, 0, 1, 2), (1000, 0, 1, 25)])
def test_max_blocks_held(window, sink, step, expected):
    kv = KvCacheManager(8, 4, attention_window=window, sink_token_length=sink)
    assert kv.max_blocks_held(step, 100) == expected


# -- beams: shared tables and copy-on-write ----------------------------------------------------------

def test_fork_shares_every_block_and_copy_on_write_splits_the_last():
    kv = make_kv()
    kv.allocate((1, 0), 6)                           # blocks 0, 1; block 1 half full
    kv.fork((1, 0), (1, 1))
    assert kv.block_table((1, 1)) == [0, 1]
    assert [kv.ref_count(b) for b in (0, 1)] == [2, 2]
    assert kv.make_block_exclusive((1, 1), 1) == (1, 2)
    assert kv.block_table((1, 1)) == [0, 2]
    assert [kv.ref_count(b) for b in (0, 1, 2)] == [2, 1, 1]
    assert kv.make_block_exclusive((1, 1), 1) is None
    assert kv.make_block_exclusive((1, 0), 1) is None  # the original's last block is now its own
    kv.free((1, 0))
    assert kv.ref_count(0) == 1 and kv.num_free_blocks == 6
    kv.check_invariants()


# -- state machine: reuse, eviction, sharing, windows ------------------------------------------------

class BlockMachine(RuleBasedStateMachine):
    """Random holders over a small pool, with prefix reuse, forks (beams), copy-on-write and an
    optional window. Block contents are simulated: a token written into a block that another
    holder also holds, or a reused block whose content differs from the prefix, fails."""
    attention_window: int | None = None
    sink_token_length = 0
    TPB = 2

    def __init__(self):
        super().__init__()
        self.kv = KvCacheManager(10, self.TPB, enable_block_reuse=True, attention_window=self.attention_window,
                                 sink_token_length=self.sink_token_length)
        self.tokens: dict[int, list[int]] = {}      # holder -> tokens it covers
        self.computed: dict[int, int] = {}          # holder -> tokens whose KV is written
        self.content: dict[int, list] = {}          # block -> simulated tokens of its slots
        self.next_holder = 0

    def _write(self, holder: int, start: int, stop: int) -> None:
        table = self.kv.block_table(holder)
        for pos in range(start, stop):
            b = table[pos // self.TPB]
            assert b >= 0 and self.kv.ref_count(b) == 1, "a write into a shared or released block"
            self.content.setdefault(b, [None] * self.TPB)[pos % self.TPB] = self.tokens[holder][pos]

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=9))
    def add(self, tokens):
        h, self.next_holder = self.next_holder, self.next_holder + 1
        reused = self.kv.acquire_cached_prefix(h, tokens)
        assert reused % self.TPB == 0 and reused < len(tokens)
        for j, b in enumerate(self.kv.block_table(h)):
            assert self.content[b] == tokens[j * self.TPB:(j + 1) * self.TPB], "reused a block of other tokens"
        if not self.kv.allocate(h, len(tokens)):
            self.kv.free(h)
            return
        self.tokens[h], self.computed[h] = list(tokens), reused

    @rule(data=st.data())
    def compute(self, data):
        if not self.tokens:
            return
        h = data.draw(st.sampled_from(sorted(self.tokens)))
        start, stop = self.computed[h], len(self.tokens[h])
        for j in range(start // self.TPB, self.kv.blocks_for_tokens(stop)):   # copy-on-write
            if self.kv.ref_count(self.kv.block_table(h)[j]) > 1:
                if not self.kv.num_free_blocks:
                    return                          # no block for the copy: try later
                src, dst = self.kv.make_block_exclusive(h, j)
                self.content[dst] = list(self.content.get(src, [None] * self.TPB))
        self._write(h, start, stop)
        self.computed[h] = stop
        self.kv.store_computed_blocks(h, self.tokens[h][self.kv.num_stored_tokens(h):], stop)
        self.kv.release_invisible_blocks(h, stop)
        if self.attention_window is not None:
            bound = self.kv.max_blocks_held(1, 1 << 30)
            assert self.kv.num_blocks_held(h) <= bound

    @rule(data=st.data(), new=st.lists(st.integers(0, 1), min_size=1, max_size=3))
    def extend(self, data, new):
        if not self.tokens:
            return
        h = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.computed[h] == len(self.tokens[h]) and self.kv.allocate(h, len(self.tokens[h]) + len(new)):
            self.tokens[h] += new

    @rule(data=st.data())
    def fork(self, data):
        if not self.tokens:
            return
        src = data.draw(st.sampled_from(sorted(self.tokens)))
        h, self.next_holder = self.next_holder, self.next_holder + 1
        self.kv.fork(src, h)
        self.tokens[h], self.computed[h] = list(self.tokens[src]), self.computed[src]

    @rule(data=st.data())
    def free(self, data):
        if not self.tokens:
            return
        h = data.draw(st.sampled_from(sorted(self.tokens)))
        held = self.kv.num_blocks_held(h)
        assert self.kv.free(h) == held
        del self.tokens[h], self.computed[h]

    @invariant()
    def consistent(self):
        self.kv.check_invariants()
        assert all(self.kv.ref_count(b) >= 0 for b in range(self.kv.num_blocks))
        assert self.kv.num_free_blocks + self.kv.num_used_blocks == self.kv.num_blocks
        shared = [b for b in range(self.kv.num_blocks) if self.kv.ref_count(b) > 1]
        for b in shared:   # a block in several tables: only a full computed block or a fork's copy
            holders = [h for h in self.tokens if b in self.kv.block_table(h)]
            assert len(holders) == self.kv.ref_count(b)


class WindowBlockMachine(BlockMachine):
    attention_window = 3
    sink_token_length = 1


KV_STATEFUL_SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                suppress_health_check=[HealthCheck.too_slow])
BlockMachine.TestCase.settings = KV_STATEFUL_SETTINGS
WindowBlockMachine.TestCase.settings = KV_STATEFUL_SETTINGS
TestBlockMachine = BlockMachine.TestCase
TestWindowBlockMachine = WindowBlockMachine.TestCase
