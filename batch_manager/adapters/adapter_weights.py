"""Which weights each LoRA task id names: a cached id is never served with other weights (API.md,
"LoRA adapters and the PEFT cache"). Weights sent again for an id are a repeat when their
factors are identical in the cache's dtype (compared by a digest of those bytes), else refused.

`AdapterWeights` is thread-safe. The PEFT cache writes it on the worker thread (an id cached, an id
dropped) and asks it whether re-sent weights repeat the cached ones; the Executor checks at
enqueue on the caller's thread, and its claim holds the id for a request queued but not yet in
the cache, so two requests queued with one id and different weights cannot both get in.

NOTE: a claim holds its request's AdapterRef weakly: a request dropped before the cache sees it
(cancelled while queued, or one of a batch refused as a whole) frees its id once it is collected,
with no hook in the queue's code paths.
"""
from __future__ import annotations

import hashlib
import threading
import weakref

import torch


class AdapterWeights:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype                              # the cache's (the runtime's weights')
        self._lock = threading.Lock()
        self._cached: dict[int, bytes] = {}             # task id -> digest of its cached weights
        # task id -> [(weak reference to a queued request's AdapterRef, digest of its weights)]
        self._claims: dict[int, list[tuple[weakref.ref, bytes]]] = {}

    def digest(self, adapter) -> bytes:
        """A runtime.adapters.lora.LoraAdapter's factors converted to the cache's dtype -> their digest."""
        h = hashlib.blake2b(digest_size=16)
        for name in sorted(adapter.factors):
            h.update(name.encode())
            for t in adapter.factors[name]:
                t = t.detach().to("cpu", self.dtype).contiguous()
                h.update(repr(tuple(t.shape)).encode())
                h.update(t.view(torch.uint8).numpy())   # the bytes, uncopied
        return h.digest()

    # -- the Executor, at enqueue ------------------------------------------------------------------

    def claim(self, ref, weights_name: str) -> str | None:
        """A request about to be queued with weights (`ref`: its AdapterRef) -> the error refusing
        it when its id names other weights (cached, or claimed by a request still queued); else
        None, and the id is claimed for these weights until the cache registers `ref` (or `ref`
        is dropped unregistered: a cancelled request)."""
        digest = self.digest(ref.payload)
        with self._lock:
            error = self._conflict(ref.task_id, digest, weights_name)
            if error is None:
                self._claims.setdefault(ref.task_id, []).append((weakref.ref(ref), digest))
            return error

    # -- the PEFT cache, on the worker thread --------------------------------------------------------

    def repeats_cached(self, ref) -> bool:
        """Whether `ref`'s weights (sent for a cached id) equal the cached ones. Ends its claim."""
        with self._lock:
            digest = self._unclaim(ref)
            cached = self._cached.get(ref.task_id)
        digest = digest if digest is not None else self.digest(ref.payload)
        return cached is None or digest == cached

    def cache(self, ref) -> None:
        """`ref`'s weights are cached under its id now. Ends its claim."""
        with self._lock:
            digest = self._claimed_digest(ref)
        digest = digest if digest is not None else self.digest(ref.payload)
        with self._lock:   # one step: no enqueue sees the id neither claimed nor cached
            self._unclaim(ref)
            self._cached[ref.task_id] = digest

    def refuse(self, ref) -> None:
        """`ref` was refused (its adapter does not fit the cache). Ends its claim."""
        with self._lock:
            self._unclaim(ref)

    def forget(self, task_id: int) -> None:
        """`task_id` left the cache: it may take other weights from now on."""
        with self._lock:
            self._cached.pop(task_id, None)

    # -- under the lock ------------------------------------------------------------------------------

    def _conflict(self, task_id: int, digest: bytes, weights_name: str) -> str | None:
        cached = self._cached.get(task_id)
        if cached is not None and cached != digest:
            return (f"{weights_name}: task id {task_id} is cached with other weights; a cached id is never "
                    "served with other weights (send the new adapter under a new task id)")
        claims = [(ref, d) for ref, d in self._claims.get(task_id, []) if ref() is not None]
        self._claims[task_id] = claims
        if not claims:
            del self._claims[task_id]
        if cached is None and any(d != digest for _, d in claims):
            return (f"{weights_name}: task id {task_id} was sent with other weights by a request still "
                    "queued; a task id names one adapter (send the new adapter under a new task id)")
        return None

    def _claimed_digest(self, ref) -> bytes | None:
        return next((digest for claimed, digest in self._claims.get(ref.task_id, []) if claimed() is ref), None)

    def _unclaim(self, ref) -> bytes | None:
        """Drop `ref`'s claim -> the digest it was claimed with, or None (not claimed)."""
        claims = self._claims.get(ref.task_id, [])
        for i, (claimed, digest) in enumerate(claims):
            if claimed() is ref:
                del claims[i]
                if not claims:
                    del self._claims[ref.task_id]
                return digest
        return None

    def check_invariants(self, cached_ids) -> None:
        with self._lock:
            assert set(self._cached) == set(cached_ids), (sorted(self._cached), sorted(cached_ids))
