"""Block tables of beam-search requests (ints only, over KvCacheManager's holder API).

Beam 0 is the request's own holder (its request id; GptSession: its sequence index); beam b > 0
is the holder (request id, b). After each step the live beams continue their parents: a beam takes its parent's table, sharing
every block by reference count (no copy). Before a beam writes its next token into a block that
another beam still shares, that block is copied (copy-on-write): at most one block per beam per
step, the partially filled last one. The prompt's blocks stay shared by all beams for the
request's lifetime.

NOTE: TensorRT-LLM instead keeps per-beam caches and reads them through a cache indirection
table in the attention kernel; sharing tables needs no kernel change here, at the price of one
block copy per diverging beam per step.
"""
from __future__ import annotations

from typing import Hashable

from .kv_cache_manager import KvCacheManager


def beam_holder(request_id: int, beam: int) -> Hashable:
    return request_id if beam == 0 else (request_id, beam)


def max_beam_blocks(kv: KvCacheManager, beam_width: int, max_num_tokens: int) -> int:
    """Most blocks a request of `beam_width` beams can hold at once: each beam's own table plus
    one copy-on-write block (an upper bound: the shared prompt blocks are counted per beam)."""
    blocks = kv.blocks_for_tokens(max_num_tokens)
    return blocks if beam_width == 1 else beam_width * (blocks + 1)


def fork_beams(kv: KvCacheManager, request_id: int, num_old_beams: int, parents: list[int]) -> None:
    """Live beam b continues old beam parents[b] (tables shared, nothing copied)."""
    if parents == list(range(num_old_beams)):
        return
    staged = [("beam-fork", request_id, b) for b in range(len(parents))]
    for b, parent in enumerate(parents):
        kv.fork(beam_holder(request_id, parent), staged[b])
    for b in range(num_old_beams):
        kv.free(beam_holder(request_id, b))
    for b, holder in enumerate(staged):
        kv.fork(holder, beam_holder(request_id, b))
        kv.free(holder)


def prepare_beam_writes(kv: KvCacheManager, request_id: int, num_beams: int, position: int,
                        copies: list[tuple[int, int]]) -> None:
    """Every beam is about to write the token at `position`: give each a private block there
    (a fresh one at a block boundary), appending to `copies` the (src, dst) block copies the
    runtime must make. Raises RuntimeError when the pool runs out; the copies made so far are in
    `copies` already, and a retry completes the rest."""
    index = position // kv.tokens_per_block
    for b in range(num_beams):
        holder = beam_holder(request_id, b)
        if index < len(kv.block_table(holder)):
            pair = kv.make_block_exclusive(holder, index)
            if pair is not None:
                copies.append(pair)
        elif not kv.allocate(holder, position + 1):
            raise RuntimeError(f"KV cache: no free block for beam {b} of request {request_id}")


def free_beams(kv: KvCacheManager, request_id: int, num_beams: int) -> None:
    """Drop every beam's table, beam 0 (the request's own holder) included."""
    for b in range(num_beams):
        kv.free(beam_holder(request_id, b))
