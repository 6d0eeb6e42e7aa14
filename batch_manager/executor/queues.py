"""The Executor's two thread-safe queues: requests waiting for the worker (by priority, bounded in
requests and in prompt tokens) and responses waiting for the user (per request id, with blocking
waits)."""
from __future__ import annotations

import heapq
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

from runtime.request import RequestSpec

from .request import Response
from .waits import wait_for

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """A refusal for load (API.md, "Admission"): max_queue_size requests or max_num_queued_tokens
    prompt tokens already waiting, or a predicted time to first token past the request's
    ttft_budget_ms. retry_after_s: seconds after which trying again may succeed (None: unknown)."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class QueuedRequest:
    request_id: int
    spec: RequestSpec
    exports_kv: bool = False   # context-only: leaves its prompt's KV for a generation-only request


class RequestQueue:
    """Validated requests not yet fetched by the worker: higher priority first, FIFO among equals."""

    def __init__(self, max_size: int | None, max_num_tokens: int | None = None):
        self.max_size, self.max_num_tokens = max_size, max_num_tokens
        self.lock = threading.Lock()
        self._heap: list[tuple[float, int, QueuedRequest]] = []
        self._num_pushed = 0
        self.num_tokens = 0     # prompt tokens of the waiting requests
        self.closed = False

    def __len__(self) -> int:
        return len(self._heap)

    def check_room(self, specs: list[RequestSpec], tokens_per_s: float | None = None) -> None:
        """QueueFullError unless `specs` fit beside the waiting requests (call with `lock` held);
        tokens_per_s (the measured context rate) estimates when room is made."""
        if self.max_size is not None and len(self._heap) + len(specs) > self.max_size:
            raise QueueFullError(f"Executor: the request queue is full (max_queue_size={self.max_size}, "
                                 f"{len(self._heap)} waiting)", self._drain_s(self.num_tokens, tokens_per_s))
        num_new = sum(len(spec.prompt) for spec in specs)
        if self.max_num_tokens is not None and self.num_tokens + num_new > self.max_num_tokens:
            raise QueueFullError(f"Executor: the request queue is full (max_num_queued_tokens={self.max_num_tokens}, "
                                 f"{self.num_tokens} prompt tokens waiting, {num_new} more asked)",
                                 self._drain_s(self.num_tokens + num_new - self.max_num_tokens, tokens_per_s))

    @staticmethod
    def _drain_s(num_tokens: int, tokens_per_s: float | None) -> float | None:
        return num_tokens / tokens_per_s if tokens_per_s else None

    def push_all(self, requests: list[QueuedRequest]) -> None:
        """Call with `lock` held, after `check_room`."""
        for r in requests:
            heapq.heappush(self._heap, (-r.spec.priority, self._num_pushed, r))
            self._num_pushed += 1
            self.num_tokens += len(r.spec.prompt)

    def pop(self, max_num: int) -> list[QueuedRequest]:
        with self.lock:
            out = [heapq.heappop(self._heap)[2] for _ in range(min(max_num, len(self._heap)))]
            self.num_tokens -= sum(len(r.spec.prompt) for r in out)
            return out

    def remove(self, request_id: int) -> QueuedRequest | None:
        with self.lock:
            for i, (_, _, r) in enumerate(self._heap):
                if r.request_id == request_id:
                    self._heap[i] = self._heap[-1]
                    self._heap.pop()
                    heapq.heapify(self._heap)
                    self.num_tokens -= len(r.spec.prompt)
                    return r
            return None

    def snapshot(self) -> list[QueuedRequest]:
        with self.lock:
            return [r for _, _, r in sorted(self._heap)]


class ResponseStore:
    """Responses by request id, until `await_*` hands them over. An id is known from its enqueue
    until its final response is handed over or the id is abandoned; a wait for an unknown id
    answers at once. Each response goes to exactly one call: an id that a call waits for by id, or
    that has a listener (`generate_async`), is claimed, and `await_any` leaves its responses to
    that call. `close()` (at shutdown) wakes every wait; a closed store never waits."""

    def __init__(self):
        self._ready = threading.Condition()
        self._responses: dict[int, deque[Response]] = {}
        self._known: set[int] = set()
        self._abandoned: set[int] = set()      # ids whose later responses are dropped, until the final
        self._listeners: dict[int, Callable[[], None]] = {}
        self._num_id_waits: dict[int, int] = {}   # request id -> calls waiting for it by id
        self._num_ready = 0
        self.closed = False

    @property
    def known_ids(self) -> frozenset[int]:
        with self._ready:
            return frozenset(self._known)

    @property
    def abandoned_ids(self) -> frozenset[int]:
        with self._ready:
            return frozenset(self._abandoned)

    def num_id_waits(self, request_id: int) -> int:
        with self._ready:
            return self._num_id_waits.get(request_id, 0)

    def register(self, request_id: int, listener: Callable[[], None] | None = None) -> None:
        with self._ready:
            self._known.add(request_id)
            if listener is not None:
                self._listeners[request_id] = listener

    def push(self, response: Response, is_final: bool) -> None:
        request_id = response.request_id
        with self._ready:
            if request_id in self._abandoned:
                if is_final:
                    self._abandoned.discard(request_id)
                return
            self._responses.setdefault(request_id, deque()).append(response)
            self._num_ready += 1
            self._ready.notify_all()
            listener = self._listeners.get(request_id)
        _call(listener, request_id)

    def listen(self, request_id: int, listener: Callable[[], None] | None) -> None:
        """`listener()` is called (on the worker thread) after each response of the id."""
        with self._ready:
            if listener is None:
                self._listeners.pop(request_id, None)
            else:
                self._listeners[request_id] = listener

    def abandon(self, request_id: int) -> None:
        """Drop the id's ready responses and every later one; the id is unknown from now on."""
        with self._ready:
            dropped = self._responses.pop(request_id, ())
            self._num_ready -= len(dropped)
            self._listeners.pop(request_id, None)
            if request_id in self._known and not any(_is_last(resp) for resp in dropped):
                self._abandoned.add(request_id)
            self._known.discard(request_id)
            self._ready.notify_all()

    def close(self) -> None:
        """Wake every wait (and listener); from now on no call waits."""
        with self._ready:
            self.closed = True
            self._ready.notify_all()
            listeners = list(self._listeners.items())
        for request_id, listener in listeners:
            _call(listener, request_id)

    def num_ready(self, request_id: int | None = None) -> int:
        with self._ready:
            if request_id is None:
                return self._num_ready
            return len(self._responses.get(request_id, ()))

    def await_any(self, timeout_s: float | None) -> list[Response]:
        """The ready responses of every unclaimed id, after waiting for one (or closing)."""
        with self._ready:
            wait_for(self._ready, lambda: self.closed or any(map(self._is_unclaimed, self._responses)), timeout_s)
            return [resp for request_id in list(self._responses) if self._is_unclaimed(request_id)
                    for resp in self._take(request_id)]

    def await_ids(self, request_ids: list[int], timeout_s: float | None) -> list[list[Response]]:
        """Per id in turn, its ready responses after waiting up to `timeout_s` for one: an error
        response for an unknown id, [] on timeout. Every id is claimed for the whole call."""
        with self._ready:
            for request_id in request_ids:
                self._num_id_waits[request_id] = self._num_id_waits.get(request_id, 0) + 1
            try:
                return [self._await_id(request_id, timeout_s) for request_id in request_ids]
            finally:
                for request_id in request_ids:
                    self._num_id_waits[request_id] -= 1
                    if not self._num_id_waits[request_id]:
                        del self._num_id_waits[request_id]

    def _await_id(self, request_id: int, timeout_s: float | None) -> list[Response]:
        """Call with the lock held and the id claimed."""
        wait_for(self._ready, lambda: self.closed or request_id not in self._known
                 or bool(self._responses.get(request_id)), timeout_s)
        if self._responses.get(request_id):
            return self._take(request_id)
        if request_id not in self._known:
            return [Response(request_id, error_msg=f"request id {request_id}: unknown (never enqueued, or its "
                                                  "final response was already returned)")]
        return []

    def _is_unclaimed(self, request_id: int) -> bool:
        return request_id not in self._num_id_waits and request_id not in self._listeners

    def _take(self, request_id: int) -> list[Response]:
        """Call with the lock held."""
        out = list(self._responses.pop(request_id, ()))
        self._num_ready -= len(out)
        if any(_is_last(resp) for resp in out):
            self._known.discard(request_id)
            self._listeners.pop(request_id, None)
            self._ready.notify_all()   # other waits for the id answer at once
        return out


def _is_last(response: Response) -> bool:
    return response.has_error() or response.result.is_final


def _call(listener: Callable[[], None] | None, request_id: int) -> None:
    if listener is None:
        return
    try:
        listener()
    except Exception:  # noqa: BLE001 - a closed event loop must not fail the request
        logger.exception("response listener of request %s raised", request_id)
