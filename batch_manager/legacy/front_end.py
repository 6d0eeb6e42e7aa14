"""GptManager's adapter to the worker (`batch_manager.doors.front_end.FrontEnd`) over the four user
callbacks: InferenceRequests in, NamedTensor responses and orjson stats out."""
from __future__ import annotations

import logging
import threading
from typing import Any

from runtime.request import AdmissionLimits, RequestOutput, RequestSpec

from ..doors.front_end import TERMINATED, Fetched
from ..doors.rendering import StreamCursors
from ..scheduling.llm_request import LlmRequest
from ..stats import IterationStats, stats_json
from .admission import to_spec
from .callbacks import UserCallbacks
from .inference_request import InferenceRequest
from .responses import response_tensors

logger = logging.getLogger(__name__)

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

    def respond(self, spec: RequestSpec, output: RequestOutput, is_final: bool, kv_export=None) -> None:
        """GptManager has no disaggregated requests: `kv_export` is always None."""
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
