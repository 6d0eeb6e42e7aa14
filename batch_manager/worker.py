"""The worker loop: one iteration after another on its thread, in API.md's order: fetch, admit,
stop signals, schedule, execute, update, respond, report stats. It owns the queue of fetched
requests and the response bookkeeping; the scheduler owns request states and KV blocks, the
executor the runtime. User code is called only through `UserCallbacks`.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from .callbacks import UserCallbacks
from .inference_request import InferenceRequest
from .llm_request import FinishReason, LlmRequest
from .model_executor import ModelExecutor
from .options import TrtGptModelType
from .responses import response_tensors
from .scheduler import Scheduler
from .stats import IterationStats, stats_json
from .step import ScheduledStep, StepResult
from .validation import AdmissionLimits, RequestError, to_llm_request

logger = logging.getLogger(__name__)

# Idle poll interval: bounds the latency an idle manager adds to a new request (~0.5 ms) while
# keeping an idle worker near 0 % CPU.
IDLE_SLEEP_S = 0.0005
_TERMINATED = "terminated: the terminate request id was received"


@dataclass(frozen=True)
class WorkerConfig:
    model_type: TrtGptModelType
    max_num_sequences: int
    terminate_req_id: int | None
    exclude_input_in_output: bool
    limits: AdmissionLimits
    enable_trt_overlap: bool = False
    normalize_log_probs: bool = True


@dataclass(frozen=True)
class _InFlight:
    """A step whose execution runs on the forward thread (overlap)."""
    step: ScheduledStep
    future: Future   # -> StepResult

    @property
    def request_ids(self) -> frozenset[int]:
        return frozenset(r.request_id for r in self.step.requests)


class Worker:
    def __init__(self, config: WorkerConfig, scheduler: Scheduler, executor: ModelExecutor,
                 callbacks: UserCallbacks):
        self.config, self.scheduler, self.executor, self.callbacks = config, scheduler, executor, callbacks
        self._queued: deque[InferenceRequest] = deque()  # fetched beyond max_num_sequences, unchecked
        self.fatal_error: str | None = None  # set when the loop died of an internal error
        self._num_admitted = 0
        self._static_batch_size = 0
        self._stop_requested = threading.Event()
        self._thread = threading.current_thread()  # run() is called on the thread that built this
        self.memory_usage = executor.memory_usage()
        # Overlap: a step executes on this one thread while the worker schedules, updates and
        # answers the other micro-batch (torch releases the GIL inside its kernels).
        self._forward_pool = ThreadPoolExecutor(1, thread_name_prefix="GptManagerForward") \
            if config.enable_trt_overlap else None
        self._in_flight: _InFlight | None = None

    @property
    def num_active_requests(self) -> int:
        """Admitted requests plus those fetched and queued for admission."""
        return self.scheduler.num_active + len(self._queued)

    @property
    def is_running(self) -> bool:
        return self.fatal_error is None and self._thread.is_alive() and not self._stop_requested.is_set()

    def run(self) -> None:
        """The worker loop; returns after shutdown or the terminate request id. Should the loop die
        of an internal error, everything it held fails and later requests get an error response."""
        try:
            self._run()
        except BaseException as e:  # an internal bug: fail what is in flight rather than hang the users
            logger.exception("GptManager worker crashed")
            self.fatal_error = f"internal error in the batch manager worker: {e!r}"
            self._fail_all(f"{self.fatal_error} (see the log)")
            self._serve_failed()
        finally:
            if self._forward_pool is not None:
                self._forward_pool.shutdown(wait=True)

    def shutdown(self) -> None:
        self._stop_requested.set()
        self.join()

    def join(self) -> None:
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    # -- the loop ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while not (self._stop_requested.is_set() and not self.num_active_requests):
            num_fetched, terminate = self._fetch_new_requests()
            if terminate:
                self._fail_all(_TERMINATED)
                return
            self._admit_queued()
            self._apply_stop_signals()
            self._send_final_responses()
            if not self.scheduler.num_active:
                if not num_fetched:
                    self._stop_requested.wait(IDLE_SLEEP_S)
                continue
            if self._forward_pool is None:
                step, num_paused = self.scheduler.schedule()
                self.scheduler.update(step, self.executor.execute(step))
                self._send_responses(step)
            else:
                step, num_paused = self._overlapped_step()
            self._send_stats(step, num_paused)

    def _overlapped_step(self) -> tuple[ScheduledStep, int]:
        """Schedule this micro-batch while the other one executes; start it, then apply and
        answer the other one while this one runs."""
        in_flight_ids = self._in_flight.request_ids if self._in_flight is not None else frozenset()
        # Half the active requests per micro-batch, so that the two alternate.
        step, num_paused = self.scheduler.schedule(in_flight_ids, max(1, -(-self.scheduler.num_active // 2)))
        previous, self._in_flight = self._in_flight, None
        previous_result = previous.future.result() if previous is not None else None
        if step.requests:
            self._in_flight = _InFlight(step, self._forward_pool.submit(self.executor.execute, step))
        if previous is not None:
            self.scheduler.update(previous.step, previous_result)
            self._send_responses(previous.step)
        return step, num_paused

    def _serve_failed(self) -> None:
        """After a crash: keep polling, and answer every new request with the fatal error."""
        while not self._stop_requested.is_set():
            items = self.callbacks.get_requests(self.config.max_num_sequences)
            for item in items:
                if isinstance(item, InferenceRequest):
                    self._send(item.request_id, [], True, f"{self.fatal_error} (see the log)")
                else:
                    _log_dropped(item)
            if not items:
                self._stop_requested.wait(IDLE_SLEEP_S)

    # -- admission and stop signals -----------------------------------------------------------------

    def _fetch_new_requests(self) -> tuple[int, bool]:
        """Queue what the callback hands over, up to the terminate id. -> (items, terminate?)"""
        if self._stop_requested.is_set():
            return 0, False
        items = self.callbacks.get_requests(max(self.config.max_num_sequences - self.num_active_requests, 0))
        for i, item in enumerate(items):
            if not isinstance(item, InferenceRequest):
                _log_dropped(item)
            elif self._is_terminate(item):
                for later in items[i + 1:]:
                    if isinstance(later, InferenceRequest):
                        self._send(later.request_id, [], True, _TERMINATED)
                return len(items), True
            else:
                self._queued.append(item)
        return len(items), False

    def _is_terminate(self, request: InferenceRequest) -> bool:
        terminate_id = self.config.terminate_req_id
        return terminate_id is not None and type(request.request_id) is int and request.request_id == terminate_id

    def _admit_queued(self) -> None:
        """Admit queued requests in arrival order while fewer than max_num_sequences are active."""
        while self._queued and self.scheduler.num_active < self.config.max_num_sequences:
            request = self._queued.popleft()
            request_id = request.request_id
            try:
                if type(request_id) is not int or not 0 <= request_id < 1 << 64:
                    raise RequestError(f"request_id: expected an integer in [0, 2**64), got {request_id!r}")
                if request_id in self.scheduler:
                    raise RequestError(f"request_id: {request_id} already exists among the active requests")
                llm_request = to_llm_request(request, self.config.limits, self._num_admitted,
                                             self.config.normalize_log_probs)
            except Exception as e:  # noqa: BLE001 - any bad input becomes that request's error
                self._send(request_id, [], True, f"Cannot process new request: {e}")
                continue
            self._num_admitted += 1
            self.scheduler.add(llm_request)

    def _apply_stop_signals(self) -> None:
        for request_id in self.callbacks.poll_stop_signals():
            if type(request_id) is int:
                self.scheduler.stop(request_id)

    # -- responses and stats ------------------------------------------------------------------------

    def _send_responses(self, step: ScheduledStep) -> None:
        """Streamed tokens of the step's unfinished requests, then every final response."""
        for scheduled in step.requests:
            r = self.scheduler.get(scheduled.request_id)
            if r is not None and r.is_streaming and not r.is_finished and len(r.generated) > r.num_sent_tokens:
                tensors = self._response_tensors(r)
                if tensors is not None:
                    self._send(r.request_id, tensors, False, "")
        self._send_final_responses()

    def _send_final_responses(self) -> None:
        in_flight_ids = self._in_flight.request_ids if self._in_flight is not None else frozenset()
        for r in self.scheduler.pop_finished(in_flight_ids):
            tensors = None if r.finish_reason == FinishReason.ERROR else self._response_tensors(r)
            if tensors is None:
                self._send(r.request_id, [], True, r.error or "error")
            else:
                self._send(r.request_id, tensors, True, "")

    def _response_tensors(self, r: LlmRequest) -> list | None:
        """The response's tensors; None (and `r` failed) when they cannot be built: one bad
        request must not take the worker down."""
        try:
            return response_tensors(r, self.config.exclude_input_in_output)
        except Exception as e:  # noqa: BLE001
            logger.exception("building the response of request %s failed", r.request_id)
            if r.request_id in self.scheduler:
                self.scheduler.fail(r.request_id, f"failed to build the response: {e!r}")
            else:
                r.error = f"failed to build the response: {e!r}"
            return None

    def _fail_all(self, message: str) -> None:
        """Fail every active and queued request. Also runs after a crash, over state that may be
        inconsistent: each request is answered even when releasing its resources fails."""
        if self._in_flight is not None:   # let its forward end before the blocks are freed
            self._in_flight.future.exception()
            self._in_flight = None
        try:
            self.scheduler.fail_all(message)
            self._send_final_responses()
        except Exception:  # noqa: BLE001
            logger.exception("releasing the active requests failed")
        for request_id in self.scheduler.abandon_all():   # whatever could not be released
            self._send(request_id, [], True, message)
        while self._queued:
            self._send(self._queued.popleft().request_id, [], True, message)

    def _send_stats(self, step: ScheduledStep, num_paused: int) -> None:
        if not self.callbacks.has_stats or not self.scheduler.num_active:
            return
        kv, cpu, gpu, pinned = self.scheduler.kv, *self.memory_usage
        is_v1 = self.config.model_type == TrtGptModelType.V1
        num_scheduled = len(step.requests)
        if is_v1 and step.context_requests:  # a new static batch: its slots stay until all finish
            self._static_batch_size = num_scheduled
        stats = IterationStats(
            iteration=step.iteration + 1, num_active=self.scheduler.num_active,
            max_num_requests=self.config.max_num_sequences, cpu_memory_bytes=cpu, gpu_memory_bytes=gpu,
            pinned_memory_bytes=pinned, max_blocks=kv.num_blocks, free_blocks=kv.num_free_blocks,
            used_blocks=kv.num_used_blocks, tokens_per_block=kv.tokens_per_block,
            allocated_total_blocks=kv.num_allocated_total, allocated_new_blocks=kv.num_allocated_new,
            reused_blocks=kv.num_reused, num_scheduled=num_scheduled, num_context=len(step.context_requests),
            num_generation=len(step.generation_requests),
            num_context_tokens=sum(r.num_step_tokens * r.num_beams for r in step.context_requests),
            num_generation_tokens=len(step.generation_requests), num_paused=num_paused,
            num_empty_generation_slots=max(0, self._static_batch_size - num_scheduled) if is_v1 else 0,
            micro_batch_id=(step.iteration + 1) % 2 if self._forward_pool is not None else 0)
        self.callbacks.report_stats(stats_json(stats, is_v1))

    def _send(self, request_id, tensors, is_final: bool, err_msg: str) -> None:
        self.callbacks.send_response(request_id, tensors, is_final, err_msg)


def _log_dropped(item) -> None:
    logger.warning("get_inference_requests_cb returned a %s, not an InferenceRequest; dropped", type(item).__name__)
