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

import orjson

from batch_manager import GptManager, InferenceRequest, TrtGptModelType, tensor_names as tn
from samples.serve.load_admission import BridgeAdmission
from samples.serve.metrics import TritonMetrics
from samples.serve.params import GenerateParams

logger = logging.getLogger(__name__)

VALIDATION_ERROR_PREFIX = "Cannot process new request"  # GptManager's admission errors
SHUTTING_DOWN = "the server is shutting down"
GUIDE_ERROR_PREFIX = "guided_decoding_params"            # the grammar compiler's errors


@dataclass(frozen=True)
class ResponseEvent:
    output_ids: list[int]           # beam 0 (or sample sequence_index). Streaming: this response's new
                                    # tokens; else every generated token
    is_final: bool                  # the last event of its sequence (samples: each gets one)
    error: str = ""
    log_probs: list[float] | None = None   # per token of output_ids, when return_log_probs
    cum_log_prob: float | None = None
    beams: list[list[int]] | None = None   # every beam's output_ids, when beam_width > 1
    # per token of output_ids, when num_top_log_probs k: (k log probs, descending; their k ids)
    top_log_probs: list[tuple[list[float], list[int]]] | None = None
    sequence_index: int = 0         # num_return_sequences n > 1: which sample (0 <= index < n)

    @property
    def is_bad_request(self) -> bool:
        """Refused at admission, or a guide that failed to compile while the request waited."""
        return self.error.startswith((VALIDATION_ERROR_PREFIX, GUIDE_ERROR_PREFIX))


@dataclass
class _Handler:
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue           # of ResponseEvent
    return_log_probs: bool
    # num_return_sequences n > 1: tokens already handed over per sample (responses carry each
    # sample whole; the handler gets one event per sample with its new tokens)
    sample_cursors: list[int] | None = None


def sample_events(handler: _Handler, sequences: list[list[int]], log_probs: list[list[float]] | None,
                  is_final: bool) -> list[ResponseEvent]:
    """Per sample with new tokens (every sample when final): its event, the new tokens only."""
    events = []
    for i, tokens in enumerate(sequences):
        start = handler.sample_cursors[i]
        if len(tokens) <= start and not is_final:
            continue
        handler.sample_cursors[i] = len(tokens)
        events.append(ResponseEvent(tokens[start:], is_final, "", log_probs[i][start:len(tokens)]
                                    if log_probs is not None else None, sequence_index=i))
    return events


class ManagerBridge:
    build = staticmethod(GenerateParams.to_inference_request)   # (params, request_id) -> submit's request

    def __init__(self, engine_dir: str, model_type: TrtGptModelType, max_beam_width: int, scheduler_policy,
                 optional_params, metrics: TritonMetrics | None = None, max_queue_size: int | None = None,
                 max_num_queued_tokens: int | None = None, ttft_budget_ms: float | None = None):
        """max_queue_size / max_num_queued_tokens: requests / prompt tokens submitted and not yet
        fetched by the manager (None: unbounded); ttft_budget_ms: every request's time-to-first-token
        budget (load_admission)."""
        self.metrics = metrics
        self.admission = BridgeAdmission(max_queue_size, max_num_queued_tokens, ttft_budget_ms)
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
               loop: asyncio.AbstractEventLoop, num_samples: int = 1) -> tuple[int, asyncio.Queue]:
        """Queue a request built with a fresh id; returns (id, queue of ResponseEvent). The request
        is built before its handler is registered: a make_request that raises leaves nothing behind.
        RuntimeError once closed; QueueFullError (a RuntimeError, with retry_after_s) for load, as
        the Executor's enqueue_request (BridgeAdmission). num_samples: the request's
        num_return_sequences (events per sample, `sequence_index`)."""
        if self.is_closed:
            raise RuntimeError(SHUTTING_DOWN)
        with self._lock:
            request_id = next(self._next_ids)
        request = make_request(request_id)
        self.admission.admit(request_id, int(request.input_tensors[tn.INPUT_IDS].numel()))
        events: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._handlers[request_id] = _Handler(loop, events, return_log_probs,
                                                  [0] * num_samples if num_samples > 1 else None)
        self._incoming.put(request)
        return request_id, events

    def cancel(self, request_id: int) -> None:
        """The client went away: forget its handler and stop the request (next poll)."""
        with self._lock:
            if self._handlers.pop(request_id, None) is not None:
                self._stop_ids.add(request_id)
                self._cancelled_ids.add(request_id)
        self.admission.cancelled(request_id)

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
        self.admission.step_began()   # called at the start of each of the manager's iterations
        batch = []
        while len(batch) < max_num_requests:
            try:
                request = self._incoming.get_nowait()
            except queue.Empty:
                break
            self.admission.fetched(request.request_id)
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
        self.admission.first_token(request_id)
        if handler is None:  # cancelled: nobody waits for it
            return
        if err_msg:
            self._deliver(handler, ResponseEvent([], is_final, err_msg))
            return
        output = {t.name: t.tensor for t in tensors}
        lengths = output[tn.SEQUENCE_LENGTH][0].tolist()                       # [beam]
        beams = [row[:n] for row, n in zip(output[tn.OUTPUT_IDS][0].tolist(), lengths)]  # [beam][T]
        if handler.sample_cursors is not None:
            rows = output[tn.OUTPUT_LOG_PROBS][0].tolist() if handler.return_log_probs else None
            for event in sample_events(handler, beams, rows, is_final):
                self._deliver(handler, event)
            return
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
        self.admission.step_ended(orjson.loads(stats_json).get("Total Context Tokens", 0))
        if self.metrics is not None:
            self.metrics.update(stats_json)

    @staticmethod
    def _deliver(handler: _Handler, event: ResponseEvent) -> None:
        try:
            handler.loop.call_soon_threadsafe(handler.events.put_nowait, event)
        except RuntimeError:  # the handler's loop is closed
            logger.debug("response dropped: event loop closed")
