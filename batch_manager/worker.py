"""The worker loop: one iteration after another on its thread, in API.md's order: fetch, admit,
stop signals, schedule, execute, update, respond, report stats. It owns the queue of fetched
requests and the response bookkeeping; the scheduler owns request states and KV blocks, the
executor the runtime. Requests come from, and answers go to, a `FrontEnd` (GptManager's
callbacks or the Executor's queues).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Callable

from runtime.request import FinishReason, RequestError

from .doors.front_end import TERMINATED, FrontEnd
from .scheduling.llm_request import LlmRequest
from .model_executor import DistributedError, ModelExecutor
from .options import TrtGptModelType
from .scheduling.scheduler import Scheduler
from .stats import IterationStats
from .scheduling.step import ScheduledStep, StepResult

logger = logging.getLogger(__name__)

# Idle poll interval of a front end that must be polled (GptManager's get-requests callback):
# bounds the latency an idle manager adds to a new request, 0.5 ms while requests came in the
# last IDLE_BACKOFF_AFTER_S, then 5 ms (a poll costs ~30 us: ~6 % of a core at 0.5 ms, under 1 %
# at 5 ms). The Executor's front end blocks instead until a request arrives.
IDLE_SLEEP_S = 0.0005
IDLE_BACKOFF_SLEEP_S = 0.005
IDLE_BACKOFF_AFTER_S = 0.1
WAITING_SLEEP_S = 0.005   # active requests, none of them schedulable yet


@dataclass(frozen=True)
class WorkerConfig:
    model_type: TrtGptModelType
    max_num_sequences: int
    enable_trt_overlap: bool = False
    uses_drafts: bool = False   # draft tokens accepted or proposed: the stats report them
    # Up to this many generation steps per iteration while every active request is plain greedy
    # and none waits to be admitted (options.DecodingConfig.max_decode_steps); one step per
    # iteration with overlap or pipeline micro-batches.
    max_decode_steps: int = 1


@dataclass(frozen=True)
class _InFlight:
    """A step still executing: on the forward thread (overlap), or in the later pipeline stages."""
    step: ScheduledStep
    result: Callable[[], StepResult]   # waits for it

    @property
    def request_ids(self) -> frozenset[int]:
        return frozenset(r.request_id for r in self.step.requests)


class Worker:
    def __init__(self, config: WorkerConfig, scheduler: Scheduler, executor: ModelExecutor,
                 front_end: FrontEnd, kv_events=None):
        self.config, self.scheduler, self.executor, self.front_end = config, scheduler, executor, front_end
        self.kv_events = kv_events   # kv_events_publisher.KvEventPublisher (kv_events_config) or None
        self._queued: deque = deque()  # fetched beyond max_num_sequences, unchecked
        self.fatal_error: str | None = None  # set when the loop died of an internal error
        self._num_admitted = 0
        self._static_batch_size = 0
        self._stop_requested = threading.Event()
        self.thread = threading.current_thread()  # run() is called on the thread that built this
        self.memory_usage = executor.memory_usage()
        # Micro-batches in flight. Pipeline parallelism: one per stage, launched on this thread
        # (rank 0 runs the first stage; the others compute the earlier micro-batches meanwhile).
        # Overlap: a step executes on the one forward thread while the worker schedules, updates
        # and answers the other micro-batch (torch releases the GIL inside its kernels).
        pipeline_depth = executor.pipeline_depth
        self.forward_pool = ThreadPoolExecutor(1, thread_name_prefix="GptManagerForward") \
            if config.enable_trt_overlap and pipeline_depth == 1 else None
        self._num_in_flight = pipeline_depth if pipeline_depth > 1 else \
            2 if self.forward_pool is not None else 1
        self._in_flight: deque[_InFlight] = deque()   # oldest first
        self._finished: list[LlmRequest] = []   # answered in this iteration (request stats)
        self._last_busy_s = time.monotonic()     # when requests last came in or ran (idle polling)

    @property
    def num_active_requests(self) -> int:
        """Admitted requests plus those fetched and queued for admission."""
        return self.scheduler.num_active + len(self._queued)

    @property
    def is_running(self) -> bool:
        return self.fatal_error is None and self.thread.is_alive() and not self._stop_requested.is_set()

    def run(self) -> None:
        """The worker loop; returns after shutdown or the terminate request id. Should the loop die
        of an internal error, everything it held fails and later requests get an error response."""
        try:
            self._run()
            self.executor.close()
        except BaseException as e:  # an internal bug: fail what is in flight rather than hang the users
            broken = isinstance(e, DistributedError)
            if broken:
                logger.error("GptManager worker stopped: %s", e)
                self.fatal_error = f"the tensor-parallel run failed: {e}"
            else:
                logger.exception("GptManager worker crashed")
                self.fatal_error = f"internal error in the batch manager worker: {e!r}"
            self.executor.close(self.fatal_error)
            self._fail_all(f"{self.fatal_error} (see the log)", wait_in_flight=not broken)
            self._serve_failed()
        finally:
            if self.forward_pool is not None:
                self.forward_pool.shutdown(wait=True)
            if self.kv_events is not None:
                self.kv_events.close()

    def shutdown(self) -> None:
        self._stop_requested.set()
        self.front_end.wake()
        self.join()

    def join(self) -> None:
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join()

    # -- the loop ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while not (self._stop_requested.is_set() and not self.num_active_requests
                   and not self.front_end.num_pending):
            num_fetched, terminate = self._fetch_new_requests()
            if terminate:
                self._fail_all(TERMINATED)
                return
            self._admit_queued()
            self._apply_stop_signals()
            self._send_final_responses()
            if self.kv_events is not None:   # the last iteration's stores and evictions: one message
                self.kv_events.publish()
            if not self.scheduler.num_active:
                if not self._in_flight:   # collectives run on one thread at a time
                    self.executor.heartbeat()
                if num_fetched:
                    self._last_busy_s = time.monotonic()
                else:
                    idle_s = time.monotonic() - self._last_busy_s
                    self.front_end.wait_for_work(
                        self._stop_requested, IDLE_SLEEP_S if idle_s < IDLE_BACKOFF_AFTER_S else IDLE_BACKOFF_SLEEP_S)
                continue
            self._last_busy_s = time.monotonic()
            if self._num_in_flight == 1:
                step, num_paused = self.scheduler.schedule(max_decode_steps=self._max_decode_steps())
                self.scheduler.update(step, self.executor.execute(step))
                self._send_responses(step)
                if not step.requests:   # all waiting (for a grammar to compile, say): poll, do not spin
                    self.executor.heartbeat()
                    self._stop_requested.wait(WAITING_SLEEP_S)
                    continue
            else:
                step, num_paused = self._micro_batched_step()
                if not step.requests and not self._in_flight:   # all waiting (see above)
                    self.executor.heartbeat()
                    self._stop_requested.wait(WAITING_SLEEP_S)
                    continue
            self._send_stats(step, num_paused)

    def _max_decode_steps(self) -> int:
        """Several steps per iteration only while nothing waits to be admitted: a request that
        arrives meanwhile waits for the call to end (at most max_decode_steps steps)."""
        n = self.config.max_decode_steps
        return n if n > 1 and not self._queued and not self.front_end.num_pending else 1

    def _in_flight_ids(self) -> frozenset[int]:
        return frozenset().union(*(f.request_ids for f in self._in_flight))

    def _micro_batched_step(self) -> tuple[ScheduledStep, int]:
        """Schedule a micro-batch of the requests not in flight and start it; then, once
        `_num_in_flight` are (or nothing new could start), apply and answer the oldest while the
        others run. A request is not scheduled again until its micro-batch's tokens are back."""
        # An equal share of the active requests per micro-batch, so that they take turns.
        max_batch_size = max(1, -(-self.scheduler.num_active // self._num_in_flight))
        step, num_paused = self.scheduler.schedule(self._in_flight_ids(), max_batch_size)
        if step.requests:
            if self.forward_pool is not None:
                result = self.forward_pool.submit(self.executor.execute, step).result
            else:
                result = partial(self.executor.complete, self.executor.launch(step))
            self._in_flight.append(_InFlight(step, result))
        if self._in_flight and (len(self._in_flight) >= self._num_in_flight or not step.requests):
            oldest = self._in_flight.popleft()
            self.scheduler.update(oldest.step, oldest.result())
            self._send_responses(oldest.step)
        return step, num_paused

    def _serve_failed(self) -> None:
        """After a crash: keep polling, and answer every new request with the fatal error."""
        while not self._stop_requested.is_set() or self.front_end.num_pending:
            fetched = self.front_end.fetch(self.config.max_num_sequences)
            for item in fetched.requests:
                self.front_end.refuse(item.request_id, f"{self.fatal_error} (see the log)")
            if not fetched.num_items:
                self._stop_requested.wait(IDLE_SLEEP_S)

    # -- admission and stop signals -----------------------------------------------------------------

    def _fetch_new_requests(self) -> tuple[int, bool]:
        """Queue what the callback hands over, up to the terminate id. -> (items, terminate?)"""
        if self._stop_requested.is_set() and not self.front_end.num_pending:
            return 0, False
        fetched = self.front_end.fetch(max(self.config.max_num_sequences - self.num_active_requests, 0))
        self._queued.extend(fetched.requests)
        return fetched.num_items, fetched.terminate

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
                admitted = self.front_end.admit(request, self._num_admitted)
            except Exception as e:  # noqa: BLE001 - any bad input becomes that request's error
                self.front_end.refuse(request_id, f"Cannot process new request: {e}")
                continue
            self.scheduler.add(admitted)
            self._num_admitted += 1

    def _apply_stop_signals(self) -> None:
        for request_id in self.front_end.poll_stop_ids():
            if type(request_id) is int:
                self.scheduler.stop(request_id)

    # -- responses and stats ------------------------------------------------------------------------

    def _send_responses(self, step: ScheduledStep) -> None:
        """Streamed tokens of the step's unfinished requests, then every final response."""
        for scheduled in step.requests:
            r = self.scheduler.get(scheduled.request_id)
            if r is not None and r.spec.is_streaming and not r.is_finished:
                error = self._respond(r, False)
                if error is not None:
                    self.scheduler.fail(r.request_id, error)
        self._send_final_responses()

    def _send_final_responses(self) -> None:
        for r in self.scheduler.pop_finished(self._in_flight_ids()):
            if self.front_end.has_stats:
                self._finished.append(r)
            if r.output.finish_reason == FinishReason.ERROR:
                error = r.output.error or "error"
            else:
                error = self._respond(r, True)
            if error is not None:
                self.front_end.respond_error(r.request_id, error)

    def _respond(self, r: LlmRequest, is_final: bool) -> str | None:
        """-> the error when its response cannot be built (nothing was sent then): one bad request
        must not take the worker down."""
        try:
            self.front_end.respond(r.spec, r.output, is_final, r.kv_export)
            return None
        except Exception as e:  # noqa: BLE001
            logger.exception("building the response of request %s failed", r.request_id)
            return f"failed to build the response: {e!r}"

    def _fail_all(self, message: str, wait_in_flight: bool = True) -> None:
        """Fail every active and queued request. Also runs after a crash, over state that may be
        inconsistent: each request is answered even when releasing its resources fails.
        wait_in_flight: let the forwards in flight end before their blocks are freed (not when
        the ranks are out of touch: they may never end)."""
        while self._in_flight:
            in_flight = self._in_flight.popleft()
            if wait_in_flight:
                try:
                    in_flight.result()
                except Exception:  # noqa: BLE001 - its requests fail below anyway
                    pass
        try:
            self.scheduler.fail_all(message)
            self._send_final_responses()
        except Exception:  # noqa: BLE001
            logger.exception("releasing the active requests failed")
        for request_id in self.scheduler.abandon_all():   # whatever could not be released
            self.front_end.respond_error(request_id, message)
        while self._queued:
            self.front_end.refuse(self._queued.popleft().request_id, message)

    def _send_stats(self, step: ScheduledStep, num_paused: int) -> None:
        finished, self._finished = self._finished, []
        if not self.front_end.has_stats:
            return
        kv, cpu, gpu, pinned = self.scheduler.kv, *self.memory_usage
        peft = self.scheduler.capacity.peft_cache
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
            num_generation_tokens=sum(r.num_decode_steps for r in step.generation_requests), num_paused=num_paused,
            num_empty_generation_slots=max(0, self._static_batch_size - num_scheduled) if is_v1 else 0,
            micro_batch_id=(step.iteration + 1) % self._num_in_flight,
            num_lora_adapters=peft.num_cached if peft is not None else 0,
            num_lora_evictions=peft.num_evictions if peft is not None else 0,
            **({"num_draft_tokens_proposed": self.scheduler.num_draft_tokens_proposed,
                "num_draft_tokens_accepted": self.scheduler.num_draft_tokens_accepted}
               if self.config.uses_drafts else {}),
            **({"num_kv_events_published": self.kv_events.num_published,
                "num_kv_events_dropped": self.kv_events.num_dropped} if self.kv_events is not None else {}))
        self.front_end.report_stats(stats, frozenset(r.request_id for r in step.requests), self.scheduler, finished)
