"""KV-cache events: the KV manager's STORED / REMOVED reports through the bounded buffer (exact
hashes), and on the Executor, consistent with the reuse counters."""
from __future__ import annotations

import threading
import time

import pytest

from batch_manager.executor import KvCacheConfig, KvCacheEventType, Request
from batch_manager.executor.kv_events import KvEventBuffer
from runtime.cache.kv_cache_manager import KvCacheManager, block_hash
from tests.batch_manager.executor.helpers import collect, executor_for


def chain(tokens: list[int], tokens_per_block: int) -> list[int]:
    """The ints of the keys of `tokens`' full blocks."""
    keys, parent = [], b""
    for j in range(len(tokens) // tokens_per_block):
        parent = block_hash(parent, tokens[j * tokens_per_block:(j + 1) * tokens_per_block])
        keys.append(int.from_bytes(parent, "big"))
    return keys


def test_stored_and_removed_events_carry_the_block_keys():
    kv = KvCacheManager(4, 2, enable_block_reuse=True)
    kv.event_sink = buffer = KvEventBuffer(16)
    tokens = [5, 6, 7, 8, 9]
    assert kv.allocate("a", 5)
    kv.store_computed_blocks("a", tokens, 4)          # two full blocks
    kv.store_computed_blocks("a", tokens[4:] + [3], 6)  # the third
    [first, second] = buffer.get_latest(0)
    keys = chain(tokens + [3], 2)
    assert (first.type, first.block_hashes, first.parent_hash, first.tokens) == \
        (KvCacheEventType.STORED, tuple(keys[:2]), None, ((5, 6), (7, 8)))
    assert (second.block_hashes, second.parent_hash, second.tokens) == ((keys[2],), keys[1], ((9, 3),))
    kv.free("a")                                       # cached, free: evicted least recently used first
    assert kv.allocate("b", 8)
    removed = buffer.get_latest(0)
    assert [e.type for e in removed] == [KvCacheEventType.REMOVED] * 3
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(keys)
    assert [e.event_id for e in removed] == [2, 3, 4]
    assert buffer.get_latest(0) == []


def test_the_buffer_keeps_the_newest_and_waits_for_the_first():
    buffer = KvEventBuffer(2)
    for key in (b"\x01", b"\x02", b"\x03"):
        buffer.removed([key])
    assert [e.block_hashes for e in buffer.get_latest(0)] == [(2,), (3,)]
    start = time.monotonic()
    assert buffer.get_latest(0.05) == [] and time.monotonic() - start >= 0.05
    threading.Timer(0.05, buffer.removed, args=([b"\x04"],)).start()
    assert [e.block_hashes for e in buffer.get_latest(None)] == [(4,)]
    with pytest.raises(ValueError, match="event_buffer_max_size"):
        KvEventBuffer(0)


def test_executor_events_match_the_reuse_counters(tiny_engine, prompts):
    engine_dir, _ = tiny_engine
    prompt = prompts[0][:21] + [9] * (21 - len(prompts[0][:21]))    # 21 tokens: 5 full blocks to reuse
    config = KvCacheConfig(enable_block_reuse=True, event_buffer_max_size=64)
    with executor_for(engine_dir, kv_cache_config=config, iter_stats_max_iterations=100,
                      request_stats_max_iterations=100) as executor:
        first = executor.enqueue_request(Request(prompt, 4))
        [response] = collect(executor, [first])[first]
        events = executor.get_latest_kv_cache_events(timeout=0)
        computed = response.result.output_token_ids[0][:-1]     # the last token's KV is never computed
        stored = [h for e in events if e.type == KvCacheEventType.STORED for h in e.block_hashes]
        assert stored == chain(computed, 4)
        assert events[0].parent_hash is None and all(e.type == KvCacheEventType.STORED for e in events)
        executor.get_latest_iteration_stats(), executor.get_latest_request_stats()

        second = executor.enqueue_request(Request(prompt, 4))
        collect(executor, [second])
        reused = [s.num_reused_blocks for it in executor.get_latest_request_stats() for s in it.request_stats
                  if s.id == second]
        iterations = executor.get_latest_iteration_stats()
        assert set(reused) == {5} and reused[0] == 5
        assert iterations[-1].reused_blocks == 5        # cumulative over the run: only the second reused
        # The reused prefix was announced and never removed; the second request stores nothing new
        # for the prefix, only blocks past it that the first did not have.
        later = executor.get_latest_kv_cache_events(timeout=0)
        assert not any(e.type == KvCacheEventType.REMOVED for e in later)
        assert set(chain(prompt, 4)[:5]) <= set(stored)
        assert not set(h for e in later for h in e.block_hashes) & set(stored)


def test_events_off_is_a_clear_error(tiny_engine):
    with executor_for(tiny_engine[0]) as executor:
        with pytest.raises(RuntimeError, match="event_buffer_max_size"):
            executor.get_latest_kv_cache_events(timeout=0)
