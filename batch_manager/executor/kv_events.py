"""KV-cache events for cache-aware routers: the bounded buffer the KV manager's event sink
writes on the worker thread and `Executor.get_latest_kv_cache_events` drains on any thread
(closed at shutdown: no wait outlives it), and `joined_sinks` for a manager with several sinks
(this buffer and the wire publisher's)."""
from __future__ import annotations

import enum
import threading
from collections import deque
from dataclasses import dataclass

from .waits import wait_for


class KvCacheEventType(enum.Enum):
    STORED = "stored"     # full blocks of computed KV became reusable
    REMOVED = "removed"   # cached blocks were evicted


@dataclass(frozen=True)
class KvCacheEvent:
    """A block hash is the 128-bit key of the block's whole prefix (kv_cache_manager.block_hash)
    as an int. STORED: a chain of blocks, `parent_hash` the key of the block before the first
    (None at the start of a sequence), `tokens` the token ids of each block. REMOVED: hashes only."""
    event_id: int
    type: KvCacheEventType
    block_hashes: tuple[int, ...]
    parent_hash: int | None = None
    tokens: tuple[tuple[int, ...], ...] = ()


class _Sinks:
    """Several sinks of the KV manager's events, each told every event in order."""

    def __init__(self, sinks: tuple):
        self.sinks = sinks

    def stored(self, parent_key: bytes, blocks: list[tuple[bytes, list[int]]], holder=None) -> None:
        for sink in self.sinks:
            sink.stored(parent_key, blocks, holder)

    def removed(self, keys: list[bytes]) -> None:
        for sink in self.sinks:
            sink.removed(keys)


def joined_sinks(*sinks):
    """One event sink for the KV manager telling each given one (None ignored; None if none)."""
    present = tuple(sink for sink in sinks if sink is not None)
    return None if not present else present[0] if len(present) == 1 else _Sinks(present)


def _key(key: bytes) -> int:
    return int.from_bytes(key, "big")


class KvEventBuffer:
    """The newest `max_size` events (older ones are dropped when the consumer falls behind)."""

    def __init__(self, max_size: int):
        if max_size <= 0:
            raise ValueError(f"event_buffer_max_size: must be positive, got {max_size}")
        self._events: deque[KvCacheEvent] = deque(maxlen=max_size)
        self._ready = threading.Condition()
        self._num_events = 0
        self._closed = False

    # The KV manager's sink (worker thread).
    def stored(self, parent_key: bytes, blocks: list[tuple[bytes, list[int]]], holder=None) -> None:
        self._add(KvCacheEventType.STORED, tuple(_key(k) for k, _ in blocks),
                  _key(parent_key) if parent_key else None, tuple(tuple(tokens) for _, tokens in blocks))

    def removed(self, keys: list[bytes]) -> None:
        self._add(KvCacheEventType.REMOVED, tuple(_key(k) for k in keys))

    def _add(self, kind: KvCacheEventType, hashes: tuple[int, ...], parent: int | None = None,
             tokens: tuple = ()) -> None:
        with self._ready:
            self._events.append(KvCacheEvent(self._num_events, kind, hashes, parent, tokens))
            self._num_events += 1
            self._ready.notify_all()

    def close(self) -> None:
        """At shutdown: wake every wait; from now on `get_latest` never waits."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    def get_latest(self, timeout_s: float | None) -> list[KvCacheEvent]:
        """Every buffered event, oldest first, after waiting up to `timeout_s` (None: until one
        arrives or the buffer closes) for the first; [] on timeout or when closed without events."""
        with self._ready:
            wait_for(self._ready, lambda: self._closed or bool(self._events), timeout_s)
            events = list(self._events)
            self._events.clear()
            return events
