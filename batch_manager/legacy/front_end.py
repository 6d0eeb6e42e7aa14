"""The worker's outward face: the `FrontEnd` protocol (where requests come from and responses
and stats go), and GptManager's adapter over the four user callbacks. The worker calls a front
end only on its own thread; the Executor's adapter lives in `batch_manager.executor`."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

from ..admission import to_spec
from .callbacks import UserCallbacks
from .inference_request import InferenceRequest
from runtime.request import RequestOutput, RequestSpec

from ..scheduling.llm_request import LlmRequest
from .responses import StreamCursors, response_tensors
from ..stats import IterationStats, stats_json

logger = logging.getLogger(__name__)

TERMINATED = "terminated: the terminate request id was received"


@dataclass(frozen=True)
class Fetched:
    requests: list[Any]       # items with a `request_id`, admitted later through `FrontEnd.admit`
    num_items: int            # everything handed over (dropped items included): 0 lets the worker idle
    terminate: bool = False   # stop now: fail everything (GptManager's terminate_req_id)


class FrontEnd(Protocol):
    @property
    def num_pending(self) -> int:
        """Requests waiting on the front end's side; the worker keeps fetching them after a
        shutdown while this is non-zero."""

    @property
    def has_stats(self) -> bool:
        """Whether `report_stats` wants iteration stats (they are not built otherwise)."""

    def fetch(self, max_num_requests: int) -> Fetched:
        """At most `max_num_requests` new requests."""

    def wait_for_work(self, stop: threading.Event, poll_s: float) -> None:
        """The worker idles: return when new requests or stop ids may have arrived, `stop` is
        set, or after `poll_s` (a front end that hears of its requests may block longer, up to
        half a second, if `wake` ends the wait)."""

    def wake(self) -> None:
        """End a `wait_for_work` (the worker is stopping)."""

    def admit(self, item: Any, arrival_index: int) -> LlmRequest:
        """A fetched item as an admitted request (its spec validated, its resources resolved);
        raises ValueError (answered as that request's error) for bad input."""

    def poll_stop_ids(self) -> Iterable[Any]:
        """Ids of requests to end with what they have."""

    def respond(self, spec: RequestSpec, output: RequestOutput, is_final: bool) -> None:
        """Answer a request from its output: its final response, or (streaming) the tokens
        generated since its last response, if any. May raise while building the response, before
        anything is sent: the worker then fails the request."""

    def respond_error(self, request_id: Any, message: str) -> None:
        """A final error response: the request ends (what the front end keeps of it goes)."""

    def refuse(self, request_id: Any, message: str) -> None:
        """The final error response of a request that was never admitted (bad input, a duplicate
        id, a failed or terminated run): an active request with the same id is untouched."""

    def report_stats(self, stats: IterationStats, scheduled_ids: frozenset[int], scheduler,
                     finished: list[LlmRequest]) -> None:
        """One iteration's stats; `scheduler` (read only) and the requests that finished in this
        iteration give the per-request view."""


class CallbackFrontEnd:
    """GptManager's adapter: InferenceRequests from the get callback, validated at admission on
    the worker thread; NamedTensor responses; stats as orjson text. User code only through
    `UserCallbacks`."""

    def __init__(self, callbacks: UserCallbacks, limits: AdmissionLimits, terminate_req_id: int | None,
                 exclude_input_in_output: bool, normalize_log_probs: bool, is_static_batching: bool):
        self.callbacks, self.limits = callbacks, limits
        self.terminate_req_id = terminate_req_id
        self.exclude_input_in_output, self.normalize_log_probs = exclude_input_in_output, normalize_log_probs
        self.is_static_batching = is_static_batching
        self._streams = StreamCursors()

    num_pending = 0   # the user's own queue is out of sight: nothing is fetched after a shutdown

    @staticmethod
    def wait_for_work(stop: threading.Event, poll_s: float) -> None:
        """The get-requests callback is polled: nothing tells of a request before it."""
        stop.wait(poll_s)

    def wake(self) -> None:
        pass

    @property
    def has_stats(self) -> bool:
        return self.callbacks.has_stats

    def fetch(self, max_num_requests: int) -> Fetched:
        """Requests up to the terminate id; requests after it are answered as terminated."""
        items = self.callbacks.get_requests(max_num_requests)
        requests = []
        for i, item in enumerate(items):
            if not isinstance(item, InferenceRequest):
                _log_dropped(item)
            elif self._is_terminate(item):
                for later in items[i + 1:]:
                    if isinstance(later, InferenceRequest):
                        self.refuse(later.request_id, TERMINATED)
                return Fetched(requests, len(items), terminate=True)
            else:
                requests.append(item)
        return Fetched(requests, len(items))

    def _is_terminate(self, request: InferenceRequest) -> bool:
        terminate_id = self.terminate_req_id
        return terminate_id is not None and type(request.request_id) is int and request.request_id == terminate_id

    def admit(self, item: InferenceRequest, arrival_index: int) -> LlmRequest:
        return LlmRequest(item.request_id, to_spec(item, self.limits, self.normalize_log_probs), arrival_index)

    def poll_stop_ids(self) -> list[Any]:
        return self.callbacks.poll_stop_signals()

    def respond(self, spec: RequestSpec, output: RequestOutput, is_final: bool) -> None:
        start = self._streams.start(output, is_final)
        if start is None:
            return
        tensors = response_tensors(spec, output, start, self.exclude_input_in_output)
        self._streams.advance(output, is_final)
        self.callbacks.send_response(output.request_id, tensors, is_final, "")

    def respond_error(self, request_id: Any, message: str) -> None:
        self._streams.forget(request_id)
        self.callbacks.send_response(request_id, [], True, message)

    def refuse(self, request_id: Any, message: str) -> None:
        # NOTE: no cursor is forgotten: a duplicate of a streaming request's id once reset that
        # request's cursor, and its next response repeated the tokens already streamed.
        self.callbacks.send_response(request_id, [], True, message)

    def report_stats(self, stats: IterationStats, scheduled_ids: frozenset[int], scheduler,
                     finished: list[LlmRequest]) -> None:
        if stats.num_active:   # the legacy manager reports iterations that leave requests active
            self.callbacks.report_stats(stats_json(stats, self.is_static_batching))


def _log_dropped(item) -> None:
    logger.warning("get_inference_requests_cb returned a %s, not an InferenceRequest; dropped", type(item).__name__)
