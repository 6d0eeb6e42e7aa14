"""The KV blocks a context-only request hands to a generation-only request on another instance, as
block ids (ints only; the bytes move in kv_transfer.py). Context side: `KvExports` owns the blocks
kept after such a request ended (the scheduler exports them, the transfer server takes them, the
worker frees them once sent or timed out). Generation side: `import_blocks` gives a starting
request blocks for the fetched prompt KV and plans their writes (`KvWrites`).
"""
from __future__ import annotations

import enum
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable

from runtime.cache.kv_cache_manager import RELEASED, KvCacheManager


class _State(enum.IntEnum):
    WAITING = 0   # reserved, not yet asked for
    SENDING = 1   # the transfer server is reading its blocks
    DONE = 2      # sent (or failed while sending): free at the worker's next look


@dataclass(frozen=True)
class ExportedKv:
    """A context-only request's prompt KV, kept for one fetch."""
    handle: int                     # random 63-bit id: what the generation side asks for
    block_ids: tuple[int, ...]      # its table in token order; RELEASED (-1) where a window released one
    num_tokens: int                 # prompt tokens whose KV the blocks hold


@dataclass
class _Entry:
    exported: ExportedKv
    holder: Hashable
    deadline_s: float               # monotonic: freed at the first look after it, unless being sent
    state: _State = _State.WAITING


class KvExports:
    """handle -> the blocks kept for it. `export` and `release_due` run on the worker thread (the
    KV manager's); `take` and `finish` on the transfer server's threads."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.timeout_s, self._clock = timeout_s, clock
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self._kv: KvCacheManager | None = None   # the pool of the exports (for release_all)
        self.num_exported = self.num_sent = self.num_expired = 0   # cumulative

    @property
    def num_reserved(self) -> int:
        return len(self._entries)

    def export(self, kv: KvCacheManager, request_id: int, num_tokens: int) -> ExportedKv:
        """Keep the blocks of `request_id` (beam width 1) under a holder of their own; the request
        then releases its own references as usual."""
        with self._lock:
            self._kv = kv
            handle = secrets.randbits(63)
            while handle in self._entries:
                handle = secrets.randbits(63)
            holder = ("kv_export", handle)
            kv.fork(request_id, holder)
            exported = ExportedKv(handle, tuple(kv.block_table(holder)), num_tokens)
            self._entries[handle] = _Entry(exported, holder, self._clock() + self.timeout_s)
            self.num_exported += 1
        return exported

    def release_due(self, kv: KvCacheManager) -> int:
        """Free the blocks that were sent or whose time ran out; -> how many exports ended."""
        if not self._entries:
            return 0
        now = self._clock()
        with self._lock:
            due = [h for h, e in self._entries.items()
                   if e.state == _State.DONE or (e.state == _State.WAITING and now > e.deadline_s)]
            for handle in due:   # freed before forgotten: num_reserved 0 means every block is back
                entry = self._entries[handle]
                kv.free(entry.holder)
                if entry.state == _State.WAITING:
                    self.num_expired += 1
                del self._entries[handle]
        return len(due)

    def release_all(self) -> int:
        """Shutdown, once the worker has stopped (nobody else touches the pool): free every export,
        those being sent too (the server is closed). -> how many."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
            for entry in entries:
                self._kv.free(entry.holder)
        return len(entries)

    def take(self, handle: int) -> ExportedKv | str:
        """The blocks of `handle` for sending (they stay held until `finish`), or why not."""
        with self._lock:
            entry = self._entries.get(handle)
            if entry is None:
                return f"no KV blocks under handle {handle}: never exported here, already sent, or timed out"
            if entry.state != _State.WAITING or self._clock() > entry.deadline_s:
                return f"the KV blocks of handle {handle} are being sent, were sent, or timed out"
            entry.state = _State.SENDING
            return entry.exported

    def finish(self, handle: int, sent: bool) -> None:
        """After a send (or a failed one): the blocks are freed either way (one fetch per export)."""
        with self._lock:
            entry = self._entries.get(handle)
            if entry is not None and entry.state == _State.SENDING:
                entry.state = _State.DONE
                self.num_sent += int(sent)


@dataclass(frozen=True)
class KvWrites:
    """The fetched prompt KV a generation-only request's first forward writes into the pool."""
    block_ids: tuple[int, ...]      # destination blocks of this pool
    slots: tuple[int, ...]          # per destination: its block's index among the fetched blocks
    fetched: Any                    # kv_transfer.FetchedBlocks (values uint8 [L, 2, n, tpb, H, D * size])


def import_blocks(kv: KvCacheManager, request_id: int, prompt_len: int, num_computed_tokens: int,
                  fetched) -> KvWrites | None:
    """Cover the fetched prompt (`prompt_len` tokens) with blocks for `request_id`, whose first
    `num_computed_tokens` (a cached prefix of this pool, whole blocks) are already there; -> the
    writes of the other fetched blocks (None: nothing to write). The caller reserved the blocks.
    ValueError naming context_phase_params (and nothing allocated) when the fetched blocks are not
    those of the prompt or leave a block the request reads unwritten."""
    problem = _fetched_problem(kv, prompt_len, num_computed_tokens, fetched)
    if problem is not None:
        raise ValueError(f"context_phase_params: the context instance's answer {problem}")
    ok = kv.allocate(request_id, prompt_len)
    assert ok, f"request {request_id}: blocks for its fetched KV were reserved"
    table = kv.block_table(request_id)
    first = num_computed_tokens // kv.tokens_per_block
    pairs = [(table[j], slot) for slot, j in enumerate(fetched.block_indexes) if j >= first and table[j] != RELEASED]
    if not pairs:
        return None
    return KvWrites(tuple(b for b, _ in pairs), tuple(s for _, s in pairs), fetched)


def _fetched_problem(kv: KvCacheManager, prompt_len: int, num_computed_tokens: int, fetched) -> str | None:
    """Why the fetched blocks cannot stand for the prompt's KV, or None. The blocks the request's
    next query reads (all of the prompt's, less a cached prefix and what a window hides) must each
    be among them."""
    num_blocks = kv.blocks_for_tokens(prompt_len)
    if type(fetched.num_tokens) is not int or fetched.num_tokens != prompt_len:
        return f"num_tokens {fetched.num_tokens!r}: the request's prompt has {prompt_len} tokens"
    indexes = fetched.block_indexes
    if not all(type(j) is int and 0 <= j < num_blocks for j in indexes) or len(set(indexes)) != len(indexes) \
            or len(indexes) != fetched.values.shape[2]:
        return (f"block_indexes {str(list(indexes))[:80]}: expected one distinct index in [0, {num_blocks}) per "
                f"block sent ({fetched.values.shape[2]})")
    missing = sorted(set(_read_block_indexes(kv, prompt_len, num_computed_tokens)) - set(indexes))
    if missing:
        return f"block_indexes {str(list(indexes))[:80]}: the prompt's blocks {missing[:8]} are missing"
    return None


def _read_block_indexes(kv: KvCacheManager, prompt_len: int, num_computed_tokens: int) -> range | list[int]:
    """The prompt's blocks the first generation step reads and this pool does not hold: from the
    cached prefix's end on, less those a window hides (kv.release_invisible_blocks' rule)."""
    first, stop = num_computed_tokens // kv.tokens_per_block, kv.blocks_for_tokens(prompt_len)
    if kv.attention_window is None:
        return range(first, stop)
    sinks = kv.blocks_for_tokens(kv.sink_token_length)
    hidden_stop = (prompt_len - kv.attention_window + 1) // kv.tokens_per_block
    return [j for j in range(first, stop) if not sinks <= j < hidden_stop]
