"""KV block bookkeeping (ints only): reference-counted blocks, each holder's block table, the
prefix cache of full computed blocks, and the release of blocks outside the attention window.

Block storage (the K/V tensors) lives in ModelRunner; this module only hands out block ids. A
pure-Python leaf of the runtime: the manager's scheduler and executor (on its worker thread) and
GptSession use it.

A holder is any hashable key that owns one block table: a request id (GptSession: a sequence
index), or (request id, beam) for the other beams (beam_blocks.py). A block may sit in any number of tables; its reference count is
the number of table entries pointing at it. Invariants (`check_invariants`):
  - a block is either free (reference count 0, in exactly one free list) or held (count > 0);
  - count == occurrences in all tables; a table never holds a block twice;
  - free (uncached + cached) + used == num_blocks.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from typing import Hashable, Sequence

# A released block-table entry (window/sinks): the runtime and its kernels never read it.
RELEASED = -1
_ROOT_HASH = b""


def block_hash(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Key of a full block: digest of (parent block's key, the block's token ids).

    NOTE: a 128-bit BLAKE2b digest, not Python's hash(): tuple hashes of ints are not
    randomised, so crafted prompts could collide and read another prompt's KV."""
    return hashlib.blake2b(parent_hash + array("q", token_ids).tobytes(), digest_size=16).digest()


def max_blocks_held(max_step_tokens: int, max_num_tokens: int, tokens_per_block: int,
                    attention_window: int | None = None, sink_token_length: int = 0) -> int:
    """Most blocks one sequence of at most `max_num_tokens` tokens holds at once when no step
    computes more than `max_step_tokens` tokens. With a window w and s sink tokens, a step from
    c computed tokens to t keeps blocks meeting [0, s) or [c - w + 1, t): an interval of
    n + w - 1 tokens (n = t - c) meets at most ceil((n + w - 1) / tpb) + 1 blocks."""
    full = -(-max_num_tokens // tokens_per_block)
    if attention_window is None:
        return full
    bound = (-(-sink_token_length // tokens_per_block)
             + -(-(attention_window + max_step_tokens - 1) // tokens_per_block) + 1)
    return min(full, bound)


class KvCacheManager:
    def __init__(self, num_blocks: int, tokens_per_block: int, enable_block_reuse: bool = False,
                 attention_window: int | None = None, sink_token_length: int = 0):
        if num_blocks <= 0 or tokens_per_block <= 0:
            raise ValueError(f"KvCacheManager: num_blocks {num_blocks} and tokens_per_block "
                             f"{tokens_per_block} must be positive")
        if attention_window is not None and attention_window <= 0:
            raise ValueError(f"KvCacheManager: attention_window must be positive, got {attention_window}")
        if sink_token_length < 0:
            raise ValueError(f"KvCacheManager: sink_token_length must be >= 0, got {sink_token_length}")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.enable_block_reuse = enable_block_reuse
        self.attention_window = attention_window  # the effective window (min of model's and config's)
        self.sink_token_length = sink_token_length if attention_window is not None else 0
        self._ref_counts = [0] * num_blocks
        self._block_to_hash: list[bytes | None] = [None] * num_blocks   # set only while in _hash_to_block
        self._hash_to_block: dict[bytes, int] = {}
        self._free_uncached: deque[int] = deque(range(num_blocks))      # FIFO, taken first
        self._free_cached: OrderedDict[int, None] = OrderedDict()       # LRU first: evicted when needed
        self._holder_to_blocks: dict[Hashable, list[int]] = {}
        self._holder_to_hashes: dict[Hashable, list[bytes]] = {}        # keys of its leading full blocks
        self.num_extra_refs = 0          # sum over blocks of max(0, ref_count - 1)
        # Cumulative, as the legacy stats: total = new + reused.
        self.num_allocated_total = 0
        self.num_allocated_new = 0
        self.num_reused = 0
        # KV-cache events (routers): sink.stored(parent_key, [(key, token ids), ...], holder) for a
        # chain of newly cached blocks (parent_key b"" at the root; token ids as given to
        # store_computed_blocks), sink.removed([key]) for an evicted one.
        self.event_sink = None

    # -- counts -------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never-used or released ones, then cached ones (evicted)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._free_cached)

    def free_block_ids(self, cached: bool) -> list[int]:
        """Uncached ones in the order allocations take them (before any cached one); cached ones
        least recently used first, the order allocations evict them in."""
        return list(self._free_cached if cached else self._free_uncached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def max_blocks_held(self, max_step_tokens: int, max_num_tokens: int) -> int:
        return max_blocks_held(max_step_tokens, max_num_tokens, self.tokens_per_block, self.attention_window,
                               self.sink_token_length)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_free(self, block_id: int) -> bool:
        return self._ref_counts[block_id] == 0

    def is_cached(self, block_id: int) -> bool:
        """Its content is findable by its key (the prefix cache), held or free."""
        return self._block_to_hash[block_id] is not None

    def holds(self, holder: Hashable) -> bool:
        return holder in self._holder_to_blocks

    def block_table(self, holder: Hashable) -> list[int]:
        """Block ids in token order; RELEASED (-1) where the window released a block."""
        return self._holder_to_blocks.get(holder, [])

    def num_blocks_held(self, holder: Hashable) -> int:
        return sum(1 for b in self._holder_to_blocks.get(holder, ()) if b != RELEASED)

    def num_blocks_missing(self, holder: Hashable, num_tokens: int) -> int:
        """Table entries `holder` must still get to cover `num_tokens` tokens."""
        return max(0, self.blocks_for_tokens(num_tokens) - len(self._holder_to_blocks.get(holder, ())))

    # -- allocation and release ---------------------------------------------------------------------

    def allocate(self, holder: Hashable, num_tokens: int) -> bool:
        """Grow the holder's table to cover `num_tokens`; False (and no change) if blocks run out."""
        missing = self.num_blocks_missing(holder, num_tokens)
        if missing > self.num_free_blocks:
            return False
        blocks = self._holder_to_blocks.setdefault(holder, [])
        self._holder_to_hashes.setdefault(holder, [])
        for _ in range(missing):
            blocks.append(self._take_free_block())
        self.num_allocated_total += missing
        self.num_allocated_new += missing
        return True

    def free(self, holder: Hashable) -> int:
        """Drop the holder's table; returns how many blocks it held. Blocks nobody else holds become
        free: cached ones at the LRU end in reverse order (a sequence's tail goes first)."""
        blocks = self._holder_to_blocks.pop(holder, [])
        self._holder_to_hashes.pop(holder, None)
        held = [b for b in blocks if b != RELEASED]
        uncached: list[int] = []
        for b in reversed(held):
            self._unref(b, uncached)
        self._free_uncached.extend(reversed(uncached))   # ordinary blocks keep token order
        return len(held)

    def release_invisible_blocks(self, holder: Hashable, num_computed_tokens: int) -> int:
        """With a window w and s sink tokens, release the blocks no query at a position >=
        num_computed_tokens can see: those wholly in [s, num_computed_tokens - w + 1). Their
        entries become RELEASED. Returns how many were released."""
        if self.attention_window is None:
            return 0
        tpb = self.tokens_per_block
        blocks = self._holder_to_blocks.get(holder, [])
        first = self.blocks_for_tokens(self.sink_token_length)   # blocks meeting [0, s) stay
        end = min(len(blocks), (num_computed_tokens - self.attention_window + 1) // tpb)
        released = 0
        for j in range(first, end):
            if blocks[j] != RELEASED:
                self._unref(blocks[j])
                blocks[j] = RELEASED
                released += 1
        return released

    def truncate(self, holder: Hashable, num_tokens: int) -> int:
        """Drop the holder's table entries past those covering `num_tokens` tokens (KV written for
        rejected draft tokens: never registered for reuse, as only computed tokens are). Returns
        how many blocks were freed."""
        blocks = self._holder_to_blocks.get(holder, [])
        keep = self.blocks_for_tokens(num_tokens)
        assert len(self._holder_to_hashes.get(holder, ())) <= keep, "a registered block cannot be rolled back"
        dropped = [b for b in blocks[keep:] if b != RELEASED]
        del blocks[keep:]
        for b in reversed(dropped):
            self._unref(b)
        return len(dropped)

    # -- prefix reuse -------------------------------------------------------------------------------

    def find_cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks holding the longest prefix of `token_ids` in whole blocks, leaving at
        least one token to compute (its logits give the next token). Changes nothing."""
        if not self.enable_block_reuse:
            return []
        tpb, parent, found = self.tokens_per_block, _ROOT_HASH, []
        for j in range((len(token_ids) - 1) // tpb):
            parent = block_hash(parent, token_ids[j * tpb:(j + 1) * tpb])
            block = self._hash_to_block.get(parent)
            if block is None:
                break
            found.append(block)
        return found

    def acquire_cached_prefix(self, holder: Hashable, token_ids: Sequence[int]) -> int:
        """Start the (empty) holder's table with the cached prefix of `token_ids`; returns the
        number of tokens whose KV is thereby already computed."""
        assert not self._holder_to_blocks.get(holder), f"holder {holder!r} already holds blocks"
        found = self.find_cached_prefix(token_ids)
        for b in found:
            self._ref(b)
        self._holder_to_blocks[holder] = list(found)
        self._holder_to_hashes[holder] = [self._block_to_hash[b] for b in found]
        self.num_reused += len(found)
        self.num_allocated_total += len(found)
        return len(found) * self.tokens_per_block

    def store_computed_blocks(self, holder: Hashable, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register the holder's blocks that became full of computed KV. `token_ids` are the
        holder's tokens from its first unregistered block on (`num_stored_tokens`) to at least
        `num_computed_tokens`. A block whose key is already cached elsewhere stays unregistered
        (a duplicate, freed as an ordinary block)."""
        if not self.enable_block_reuse:
            return
        tpb = self.tokens_per_block
        hashes, blocks = self._holder_to_hashes[holder], self._holder_to_blocks[holder]
        start = len(hashes)
        parent = hashes[-1] if hashes else _ROOT_HASH
        chain_parent, chain = parent, []   # consecutive newly cached blocks, for the event sink
        for j in range(start, num_computed_tokens // tpb):
            offset = (j - start) * tpb
            key = block_hash(parent, token_ids[offset:offset + tpb])
            hashes.append(key)
            b = blocks[j]
            if b != RELEASED and key not in self._hash_to_block and self._block_to_hash[b] is None:
                self._hash_to_block[key] = b
                self._block_to_hash[b] = key
                if self.event_sink is not None:
                    if chain and chain[-1][0] != parent:
                        self.event_sink.stored(chain_parent, chain, holder)
                        chain = []
                    if not chain:
                        chain_parent = parent
                    chain.append((key, list(token_ids[offset:offset + tpb])))
            parent = key
        if chain:
            self.event_sink.stored(chain_parent, chain, holder)

    def num_stored_tokens(self, holder: Hashable) -> int:
        """Tokens of the holder covered by its registered (or duplicate) full-block keys."""
        return len(self._holder_to_hashes.get(holder, ())) * self.tokens_per_block

    # -- sharing between holders (beams) -------------------------------------------------------------

    def fork(self, src_holder: Hashable, dst_holder: Hashable) -> None:
        """Give `dst_holder` (holding nothing) the same blocks as `src_holder`, shared."""
        assert not self._holder_to_blocks.get(dst_holder), f"holder {dst_holder!r} already holds blocks"
        blocks = list(self._holder_to_blocks.get(src_holder, []))
        for b in blocks:
            if b != RELEASED:
                self._ref(b)
        self._holder_to_blocks[dst_holder] = blocks
        self._holder_to_hashes[dst_holder] = list(self._holder_to_hashes.get(src_holder, []))

    def make_block_exclusive(self, holder: Hashable, index: int) -> tuple[int, int] | None:
        """Copy-on-write: if entry `index` of the holder's table is shared, point it at a fresh
        block and return (src, dst) for the runtime's copy_blocks; None when already exclusive.
        Raises RuntimeError when no block is free (the scheduler must have reserved one)."""
        blocks = self._holder_to_blocks[holder]
        src = blocks[index]
        assert src != RELEASED, "a released entry cannot be written"
        if self._ref_counts[src] == 1:
            return None
        if not self.num_free_blocks:
            raise RuntimeError("KV cache: no free block for a copy-on-write")
        dst = self._take_free_block()
        self._unref(src)
        blocks[index] = dst
        self.num_allocated_total += 1
        self.num_allocated_new += 1
        return src, dst

    # -- internals ----------------------------------------------------------------------------------

    def _take_free_block(self) -> int:
        if self._free_uncached:
            b = self._free_uncached.popleft()
        else:
            b, _ = self._free_cached.popitem(last=False)   # evict the least recently used
            del self._hash_to_block[self._block_to_hash[b]]
            if self.event_sink is not None:
                self.event_sink.removed([self._block_to_hash[b]])
            self._block_to_hash[b] = None
        self._ref_counts[b] = 1
        return b

    def _ref(self, b: int) -> None:
        if self._ref_counts[b] == 0:
            del self._free_cached[b]   # only cached blocks can be found free by a prefix lookup
        else:
            self.num_extra_refs += 1
        self._ref_counts[b] += 1

    def _unref(self, b: int, uncached: list[int] | None = None) -> None:
        """Drop one reference; a block left unheld becomes free (appended to `uncached` instead
        of the FIFO when given and the block is not cached)."""
        assert self._ref_counts[b] > 0, f"block {b} released more often than held"
        self._ref_counts[b] -= 1
        if self._ref_counts[b]:
            self.num_extra_refs -= 1
        elif self._block_to_hash[b] is not None:
            self._free_cached[b] = None
        elif uncached is not None:
            uncached.append(b)
        else:
            self._free_uncached.append(b)

    def check_invariants(self) -> None:
        occurrences = [0] * self.num_blocks
        for holder, blocks in self._holder_to_blocks.items():
            held = [b for b in blocks if b != RELEASED]
            assert len(held) == len(set(held)), f"holder {holder!r} holds a block twice"
            for b in held:
                occurrences[b] += 1
        free = list(self._free_uncached) + list(self._free_cached)
        assert len(free) == len(set(free)), "a block is free twice"
        assert occurrences == self._ref_counts, "reference counts differ from the tables"
        assert all(self._ref_counts[b] == 0 for b in free), "a free block is held"
        assert sum(1 for c in self._ref_counts if c == 0) == len(free), "KV blocks lost"
        assert self.num_free_blocks + self.num_used_blocks == self.num_blocks
        assert self.num_extra_refs == sum(max(0, c - 1) for c in self._ref_counts)
        for h, b in self._hash_to_block.items():
            assert self._block_to_hash[b] == h, "hash map and block keys disagree"
        assert all(self._block_to_hash[b] is not None for b in self._free_cached), "uncached block in the LRU"
        assert all(self._block_to_hash[b] is None for b in self._free_uncached), "cached block in the FIFO"
        assert sum(1 for h in self._block_to_hash if h is not None) == len(self._hash_to_block)
