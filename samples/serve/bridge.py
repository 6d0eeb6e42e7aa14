"""The bridge between asyncio HTTP handlers and a GptManager (samples.serve): owns the manager,
the thread-safe queue its get-requests callback drains, the handler of each request id and the
stop signals. Handlers call `submit` / `cancel` on their event loop; the callbacks run on the
manager's worker thread and hand each response to its handler's loop (call_soon_threadsafe)."""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable

from batch_manager import GptManager, InferenceRequest, TrtGptModelType, tensor_names as tn
from batch_manager.executor import QueueFullError
from samples.serve.metrics import TritonMetrics

logger = logging.getLogger(__name__)

VALIDATION_ERROR_PREFIX = "Cannot process new request"  # GptManager's admission errors
SHUTTING_DOWN = "the server is shutting down"


@dataclass(frozen=True)
class ResponseEvent:
    output_ids: list[int]           # beam 0. Streaming: this response's new tokens; else every generated token
    is_final: bool
    error: str = ""
    log_probs: list[float] | None = None   # per token of output_ids, when return_log_probs
    cum_log_prob: float | None = None
    beams: list[list[int]] | None = None   # every beam's output_ids, when beam_width > 1
    # per token of output_ids, when num_top_log_probs k: (k log probs, descending; their k ids)
    top_log_probs: list[tuple[list[float], list[int]]] | None = None

    @property
    def is_bad_request(self) -> bool:
        return self.error.startswith(VALIDATION_ERROR_PREFIX)


@dataclass
class _Handler:
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue           # of ResponseEvent
    return_log_probs: bool


class ManagerBridge:
    def __init__(self, engine_dir: str, model_type: TrtGptModelType, max_beam_width: int, scheduler_policy,
                 optional_params, metrics: TritonMetrics | None = None, max_queue_size: int | None = None):
        self.metrics = metrics
        self.max_queue_size = max_queue_size   # requests submitted, not yet fetched by the manager; None: unbounded
        self._incoming: queue.Queue[InferenceRequest] = queue.Queue()
        self._lock = threading.Lock()
        self._handlers: dict[int, _Handler] = {}   # request id -> its waiting handler
        self._stop_ids: set[int] = set()           # cancelled ids, for the next poll
        self._cancelled_ids: set[int] = set()      # cancelled ids not yet answered with a final response
        self._next_ids = itertools.count(1)
        self.is_closed = False
        self.manager = GptManager(engine_dir, model_type, max_beam_width, scheduler_policy, self._get_requests,
                                  self._send_response, self._poll_stop_signals, self._report_stats,
                                  optional_params, exclude_input_in_output=True)

    # -- handler side (event loop) ----------------------------------------------------------------

    def submit(self, make_request: Callable[[int], InferenceRequest], return_log_probs: bool,
               loop: asyncio.AbstractEventLoop) -> tuple[int, asyncio.Queue]:
        """Queue a request built with a fresh id; returns (id, queue of ResponseEvent). The request
        is built before its handler is registered: a make_request that raises leaves nothing behind.
        RuntimeError once closed; QueueFullError (a RuntimeError) with max_queue_size requests waiting,
        as the Executor's enqueue_request."""
        if self.is_closed:
            raise RuntimeError(SHUTTING_DOWN)
        if self.max_queue_size is not None and self._incoming.qsize() >= self.max_queue_size:
            raise QueueFullError(f"the request queue is full (max_queue_size={self.max_queue_size})")
        with self._lock:
            request_id = next(self._next_ids)
        request = make_request(request_id)
        events: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._handlers[request_id] = _Handler(loop, events, return_log_probs)
        self._incoming.put(request)
        return request_id, events

    def cancel(self, request_id: int) -> None:
        """The client went away: forget its handler and stop the request (next poll)."""
        with self._lock:
            if self._handlers.pop(request_id, None) is not None:
                self._stop_ids.add(request_id)
                self._cancelled_ids.add(request_id)

    def num_waiting_handlers(self) -> int:
        with self._lock:
            return len(self._handlers)

    def num_active_requests(self) -> int:
        return self.manager.get_num_active_requests()

    def close(self) -> None:
        """Stop every request, answer waiting handlers with an error, shut the manager down."""
        self.is_closed = True
        with self._lock:
            handlers, self._handlers = self._handlers, {}
            self._stop_ids.update(handlers)
            self._cancelled_ids.update(handlers)
        for handler in handlers.values():
            self._deliver(handler, ResponseEvent([], True, SHUTTING_DOWN))
        self.manager.shutdown()

    # -- manager side (worker thread) -------------------------------------------------------------

    def _get_requests(self, max_num_requests: int) -> list[InferenceRequest]:
        batch = []
        while len(batch) < max_num_requests:
            try:
                request = self._incoming.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                if request.request_id in self._cancelled_ids:  # cancelled before the manager saw it
                    self._cancelled_ids.discard(request.request_id)
                    continue
            batch.append(request)
        return batch

    def _send_response(self, request_id: int, tensors, is_final: bool, err_msg: str) -> None:
        with self._lock:
            handler = self._handlers.pop(request_id, None) if is_final else self._handlers.get(request_id)
            if is_final:
                self._cancelled_ids.discard(request_id)
        if handler is None:  # cancelled: nobody waits for it
            return
        if err_msg:
            self._deliver(handler, ResponseEvent([], is_final, err_msg))
            return
        output = {t.name: t.tensor for t in tensors}
        lengths = output[tn.SEQUENCE_LENGTH][0].tolist()                       # [beam]
        beams = [row[:n] for row, n in zip(output[tn.OUTPUT_IDS][0].tolist(), lengths)]  # [beam][T]
        log_probs = cum_log_prob = None
        if handler.return_log_probs:
            log_probs = output[tn.OUTPUT_LOG_PROBS][0, 0].tolist()[:lengths[0]]
            cum_log_prob = float(output[tn.CUM_LOG_PROBS][0, 0])
        tops = None
        if tn.TOP_LOG_PROBS in output:
            tops = list(zip(output[tn.TOP_LOG_PROBS][0, 0].tolist(), output[tn.TOP_LOG_PROB_IDS][0, 0].tolist()))
        self._deliver(handler, ResponseEvent(beams[0], is_final, "", log_probs, cum_log_prob,
                                             beams if len(beams) > 1 else None, tops))

    def _poll_stop_signals(self) -> set[int]:
        with self._lock:
            stop_ids, self._stop_ids = self._stop_ids, set()
        return stop_ids

    def _report_stats(self, stats_json: str) -> None:
        if self.metrics is not None:
            self.metrics.update(stats_json)

    @staticmethod
    def _deliver(handler: _Handler, event: ResponseEvent) -> None:
        try:
            handler.loop.call_soon_threadsafe(handler.events.put_nowait, event)
        except RuntimeError:  # the handler's loop is closed
            logger.debug("response dropped: event loop closed")
