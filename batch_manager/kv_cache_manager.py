"""KV block bookkeeping: the free list and each request's block table (ints only).

Block storage (the K/V tensors) lives in the runtime; this module only hands out block ids.
Invariant: free + sum(held) == num_blocks, and no block is held twice.
"""
from __future__ import annotations

from collections import deque


class KvCacheManager:
    def __init__(self, num_blocks: int, tokens_per_block: int):
        if num_blocks <= 0 or tokens_per_block <= 0:
            raise ValueError(f"KvCacheManager: num_blocks {num_blocks} and tokens_per_block "
                             f"{tokens_per_block} must be positive")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._request_to_blocks: dict[int, list[int]] = {}
        self.num_allocated_total = 0   # blocks handed out since start
        self.num_allocated_new = 0     # blocks handed out since the last `start_iteration`

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_block_ids)

    def start_iteration(self) -> None:
        self.num_allocated_new = 0

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def num_blocks_held(self, request_id: int) -> int:
        return len(self._request_to_blocks.get(request_id, ()))

    def num_blocks_missing(self, request_id: int, num_tokens: int) -> int:
        """Blocks `request_id` must still get to hold `num_tokens` tokens."""
        return max(0, self.blocks_for_tokens(num_tokens) - self.num_blocks_held(request_id))

    def allocate(self, request_id: int, num_tokens: int) -> bool:
        """Grow the request's table to hold `num_tokens`; False (and no change) if blocks run out."""
        missing = self.num_blocks_missing(request_id, num_tokens)
        if missing > len(self._free_block_ids):
            return False
        blocks = self._request_to_blocks.setdefault(request_id, [])
        for _ in range(missing):
            blocks.append(self._free_block_ids.popleft())
        self.num_allocated_total += missing
        self.num_allocated_new += missing
        return True

    def free(self, request_id: int) -> int:
        """Return the request's blocks to the free list; returns how many."""
        blocks = self._request_to_blocks.pop(request_id, [])
        self._free_block_ids.extend(blocks)
        return len(blocks)

    def block_table(self, request_id: int) -> list[int]:
        return self._request_to_blocks.get(request_id, [])

    def holds(self, request_id: int) -> bool:
        return request_id in self._request_to_blocks

    def check_invariants(self) -> None:
        held = [b for blocks in self._request_to_blocks.values() for b in blocks]
        every = held + list(self._free_block_ids)
        assert len(every) == self.num_blocks and set(every) == set(range(self.num_blocks)), \
            "KV blocks lost or held twice"
