"""The Executor bridge of samples.serve (`--api executor`): the same handler-side interface as
`samples.serve.bridge.ManagerBridge`, over an Executor. Requests are built straight from the parsed
body (`build`: `GenerateParams.to_executor_request`) and validated at enqueue (a bad one is a
ValueError naming the body field: a 400, with nothing queued; load beyond the ExecutorConfig's queue
bounds or the TTFT budget is the Executor's QueueFullError); one consumer thread awaits every
response and hands each to its handler's loop; a disconnect cancels the request."""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable

from batch_manager.executor import Executor, ExecutorConfig, Request
from runtime.decoding.fields import SAMPLING_FIELDS
from samples.serve.bridge import SHUTTING_DOWN, ManagerBridge, ResponseEvent, _Handler
from samples.serve.metrics import TritonMetrics
from samples.serve.params import GenerateParams

logger = logging.getLogger(__name__)

# the Executor's field names -> the body's, to lead its errors with the body field
_EXECUTOR_TO_BODY = {"input_token_ids": "input_ids", "max_tokens": "max_new_tokens",
                     **{f"sampling_config.{f.executor_sampling}": f.body for f in SAMPLING_FIELDS
                        if f.executor_sampling is not None and f.body is not None},
                     **{f.executor: f.body for f in SAMPLING_FIELDS if f.executor and "." in f.executor and f.body}}


def name_body_field(message: str) -> str:
    field, sep, rest = message.partition(": ")
    return f"{_EXECUTOR_TO_BODY.get(field, field.removeprefix('sampling_config.'))}{sep}{rest}"


class ExecutorBridge:
    build = staticmethod(GenerateParams.to_executor_request)   # (params, request_id) -> submit's request

    def __init__(self, engine_dir: str, config: ExecutorConfig, metrics: TritonMetrics | None = None,
                 ttft_budget_ms: float | None = None):
        """ttft_budget_ms: every request's Request.ttft_budget_ms (None: no budget)."""
        self.metrics = metrics
        self.ttft_budget_ms = ttft_budget_ms
        self.executor = Executor(engine_dir, executor_config=config)
        self._lock = threading.Lock()
        self._handlers: dict[int, _Handler] = {}
        self.is_closed = False
        self._consumer = threading.Thread(target=self._consume, name="ExecutorBridgeConsumer", daemon=True)
        self._consumer.start()

    # -- handler side (event loop) ----------------------------------------------------------------

    def submit(self, make_request: Callable[[int], Request], return_log_probs: bool,
               loop: asyncio.AbstractEventLoop, num_samples: int = 1) -> tuple[int, asyncio.Queue]:
        """ValueError (the body field first) for a request the Executor refuses: nothing is queued.
        RuntimeError once closed; QueueFullError for load (the ExecutorConfig's max_queue_size,
        max_num_queued_tokens, a request's ttft_budget_ms). num_samples > 1: the Executor's results
        come per sample (`sequence_index`), and so do the events."""
        if self.is_closed:
            raise RuntimeError(SHUTTING_DOWN)
        request = make_request(0)
        request.ttft_budget_ms = self.ttft_budget_ms
        events: asyncio.Queue = asyncio.Queue()
        with self._lock:   # registered before the consumer can see a response of the id
            try:
                request_id = self.executor.enqueue_request(request)
            except ValueError as e:
                raise ValueError(name_body_field(str(e))) from None
            self._handlers[request_id] = _Handler(loop, events, return_log_probs,
                                                  [0] * num_samples if num_samples > 1 else None)
        return request_id, events

    def cancel(self, request_id: int) -> None:
        with self._lock:
            if self._handlers.pop(request_id, None) is None:
                return
        self.executor.cancel_request(request_id)

    def num_waiting_handlers(self) -> int:
        with self._lock:
            return len(self._handlers)

    def num_active_requests(self) -> int:
        return self.executor.get_num_active_requests()

    def close(self) -> None:
        self.is_closed = True
        with self._lock:
            handlers, self._handlers = self._handlers, {}
        for request_id, handler in handlers.items():
            self.executor.cancel_request(request_id)
            ManagerBridge._deliver(handler, ResponseEvent([], True, SHUTTING_DOWN))
        self.executor.shutdown()
        self._consumer.join(10)

    # -- the consumer thread ----------------------------------------------------------------------

    def _consume(self) -> None:
        while not (self.is_closed and not self.executor.can_enqueue_requests()):
            for response in self.executor.await_responses(timeout=0.05):
                self._deliver(response)
            if self.metrics is not None:
                for stats in self.executor.get_latest_iteration_stats():
                    self.metrics.update(stats.to_json_str())

    def _deliver(self, response) -> None:
        is_final = response.has_error() or response.result.is_final
        with self._lock:
            handler = self._handlers.pop(response.request_id, None) if is_final \
                else self._handlers.get(response.request_id)
        if handler is None:   # cancelled: nobody waits for it
            return
        if response.has_error():
            ManagerBridge._deliver(handler, ResponseEvent([], True, response.error_msg))
            return
        result = response.result
        beams = result.output_token_ids
        if handler.sample_cursors is not None:   # one result per sample: its new tokens already
            log_probs = result.log_probs[0].tolist()[:len(beams[0])] if handler.return_log_probs else None
            ManagerBridge._deliver(handler, ResponseEvent(beams[0], result.is_sequence_final, "", log_probs,
                                                          sequence_index=result.sequence_index))
            return
        log_probs = cum_log_prob = None
        if handler.return_log_probs:
            log_probs = result.log_probs[0].tolist()[:len(beams[0])]
            cum_log_prob = float(result.cum_log_probs[0])
        tops = None
        if result.top_log_probs is not None:
            tops = list(zip(result.top_log_probs[0].tolist(), result.top_log_prob_ids[0].tolist()))
        ManagerBridge._deliver(handler, ResponseEvent(beams[0], result.is_final, "", log_probs, cum_log_prob,
                                                      beams if len(beams) > 1 else None, tops))
