"""The `tensorrt_llm` model's requests from acceptance to their final response: those waiting to
be handed to the GptManager (in arrival order), those handed over, which of those are to stop, and
the drain. Thread-safe: Triton's execute thread, the cancellation watcher and the GptManager's
worker share it. No Triton import: the model sends the responses, outside the book's lock.

The GptManager ends only requests it holds (a stop for an id it was not handed yet is dropped), so
a request still waiting here is stopped here: it leaves the book and the model answers it. A
handed request's stop is kept, and returned by every poll, until its final response."""
from __future__ import annotations

import collections
import dataclasses
import threading

from samples.triton.llm_requests import BadRequest, RequestIds

SHUTTING_DOWN = "the server is shutting down"
NOT_STARTED = f"{SHUTTING_DOWN}: the request was not started"


@dataclasses.dataclass
class LiveRequest:
    triton_id: str
    request: object              # the Triton request: its cancellation flag
    sender: object               # its decoupled response sender
    num_echoed_tokens: int = 0   # prompt tokens its responses' sequence_length counts (exclude_input_in_output off)
    has_streamed: bool = False   # a streamed response with new tokens went out


class RequestBook:
    def __init__(self):
        self._lock = threading.Lock()
        self._ids = RequestIds()
        self._waiting: collections.OrderedDict[int, tuple[LiveRequest, object]] = collections.OrderedDict()
        self._id_to_handed: dict[int, LiveRequest] = {}
        self._stopping_ids: set[int] = set()   # handed requests to end; kept until their final response
        self.is_draining = False

    @property
    def num_live(self) -> int:
        with self._lock:
            return len(self._waiting) + len(self._id_to_handed)

    @property
    def has_waiting(self) -> bool:
        return bool(self._waiting)   # a read of one reference: no lock needed for a hint

    def accept(self, live: LiveRequest, make_request) -> None:
        """Queue a new request: `make_request(request_id)` builds its InferenceRequest. Raises
        BadRequest for a duplicate live id or during the drain."""
        with self._lock:
            if self._live_id(live.triton_id) is not None:
                raise BadRequest(f"request id {live.triton_id!r} is already in use by a live request")
            if self.is_draining:
                raise BadRequest(SHUTTING_DOWN)
            request_id = self._ids.assign(live.triton_id)
            self._waiting[request_id] = (live, make_request(request_id))

    def stop(self, triton_id: str) -> LiveRequest | None:
        """A `stop` request for this Triton id. -> the live request when it was still waiting
        (it left the book: the caller answers it), else None (stopped in the GptManager, or no
        live request has the id)."""
        with self._lock:
            request_id = self._live_id(triton_id) if triton_id else None
            return None if request_id is None else self._stop(request_id)

    def cancel(self, cancelled: list[tuple[int, LiveRequest]]) -> list[LiveRequest]:
        """Client cancellations, as `live_items` gave them (an id answered and reused since is
        left alone). -> those still waiting (they left the book: the caller answers them)."""
        with self._lock:
            unstarted = [self._stop(request_id) for request_id, live in cancelled if self._entry(request_id) is live]
        return [live for live in unstarted if live is not None]

    def drain(self) -> list[LiveRequest]:
        """From now on nothing is accepted or handed over, and every handed request is to stop.
        -> the waiting requests (they left the book: the caller answers them with an error)."""
        with self._lock:
            self.is_draining = True
            self._stopping_ids.update(self._id_to_handed)
            unstarted = [self._release(request_id, live) for request_id, (live, _) in self._waiting.items()]
            self._waiting.clear()
        return unstarted

    def take(self, max_num_requests: int) -> list:
        """Up to `max_num_requests` waiting InferenceRequests, oldest first (none while draining)."""
        with self._lock:
            if self.is_draining:
                return []
            taken = []
            while self._waiting and len(taken) < max_num_requests:
                request_id, (live, request) = self._waiting.popitem(last=False)
                self._id_to_handed[request_id] = live
                taken.append(request)
            return taken

    def stop_ids(self) -> set[int]:
        with self._lock:
            return set(self._stopping_ids)

    def live_items(self) -> list[tuple[int, LiveRequest]]:
        """(GptManager id, live request) of every request, waiting or handed."""
        with self._lock:
            return [(i, live) for i, (live, _) in self._waiting.items()] + list(self._id_to_handed.items())

    def handed(self, request_id: int, is_final: bool) -> LiveRequest | None:
        """The handed request a response is for; a final response takes it out of the book."""
        with self._lock:
            if not is_final:
                return self._id_to_handed.get(request_id)
            live = self._id_to_handed.pop(request_id, None)
            if live is not None:
                self._release(request_id, live)
            return live

    # under the lock

    def _live_id(self, triton_id: str) -> int | None:
        request_id = self._ids.lookup(triton_id)
        return request_id if request_id in self._waiting or request_id in self._id_to_handed else None

    def _entry(self, request_id: int) -> LiveRequest | None:
        waiting = self._waiting.get(request_id)
        return waiting[0] if waiting is not None else self._id_to_handed.get(request_id)

    def _stop(self, request_id: int) -> LiveRequest | None:
        if request_id in self._waiting:
            live, _ = self._waiting.pop(request_id)
            return self._release(request_id, live)
        if request_id in self._id_to_handed:
            self._stopping_ids.add(request_id)
        return None

    def _release(self, request_id: int, live: LiveRequest) -> LiveRequest:
        self._ids.release(live.triton_id)
        self._stopping_ids.discard(request_id)
        return live
