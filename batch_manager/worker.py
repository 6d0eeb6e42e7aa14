"""The worker loop: owns the active requests and runs one iteration after another on its thread.

Iteration order (API.md): fetch + validate + admit, stop signals, schedule (capacity, then
micro-batch), run the step, send responses, report stats. User callbacks run here; their
exceptions are logged and contained. A failed step fails only that step's requests.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from runtime.kv_cache_manager import KvCacheManager

from .llm_request import FinishReason, LlmRequest
from .model_executor import ModelExecutor, PreparedStep
from .options import TrtGptModelType
from .responses import response_tensors
from .scheduler import CapacityScheduler, MicroBatch, MicroBatchScheduler, free_request_blocks
from .stats import IterationStats, stats_json
from .validation import AdmissionLimits, RequestError, to_llm_request

logger = logging.getLogger(__name__)

# Idle poll interval: bounds the latency an idle manager adds to a new request (~0.5 ms) while
# keeping an idle worker near 0 % CPU.
IDLE_SLEEP_S = 0.0005


@dataclass(frozen=True)
class WorkerConfig:
    model_type: TrtGptModelType
    max_num_sequences: int
    terminate_req_id: int | None
    exclude_input_in_output: bool
    limits: AdmissionLimits
    enable_trt_overlap: bool = False


@dataclass
class _InFlight:
    """A micro-batch whose forward runs on the forward thread (overlap)."""
    batch: MicroBatch
    groups: list[tuple[list[LlmRequest], PreparedStep]]
    future: Future   # -> list[dict of outputs | Exception], one per group


class Worker:
    def __init__(self, config: WorkerConfig, kv: KvCacheManager, capacity: CapacityScheduler,
                 micro_batch: MicroBatchScheduler, executor: ModelExecutor, get_requests: Callable,
                 send_response: Callable, poll_stop_signals: Callable | None, report_stats: Callable | None):
        self.config = config
        self.kv, self.capacity, self.micro_batch, self.executor = kv, capacity, micro_batch, executor
        self._get_requests, self._send_response = get_requests, send_response
        self._poll_stop_signals, self._report_stats = poll_stop_signals, report_stats
        self._active: dict[int, LlmRequest] = {}  # admission order
        self._num_admitted = 0
        self._iteration = 0
        self._static_batch_size = 0
        self._stop_requested = threading.Event()
        self._thread = threading.current_thread()  # run() is called on the thread that built this
        self.memory_usage = executor.memory_usage()
        # Overlap: forwards run on this one thread while the worker does the host work of the other
        # micro-batch (torch releases the GIL inside its kernels).
        self._forward_pool = ThreadPoolExecutor(1, thread_name_prefix="GptManagerForward") \
            if config.enable_trt_overlap else None
        self._in_flight: _InFlight | None = None
        # Fault-injection test hook (tests, samples.chaos_soak): fault_injector(group) is called on
        # the worker thread with each request group of a step before the group is prepared; what
        # it raises fails exactly that group's requests, as a failing model step would.
        self.fault_injector: Callable[[list[LlmRequest]], None] | None = None

    @property
    def num_active_requests(self) -> int:
        return len(self._active)

    def run(self) -> None:
        """The worker loop; returns after shutdown or the terminate request id."""
        self._run()

    def shutdown(self) -> None:
        self._stop_requested.set()
        self.join()

    def join(self) -> None:
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    # -- the loop ---------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not (self._stop_requested.is_set() and not self._active):
                fetched = 0
                if not self._stop_requested.is_set():
                    fetched, terminate = self._fetch_new_requests()
                    if terminate:
                        self._fail_all("terminated: the terminate request id was received")
                        return
                self._apply_stop_signals()
                if not self._active:
                    if not fetched:
                        self._stop_requested.wait(IDLE_SLEEP_S)
                    continue
                if self._forward_pool is None:
                    batch, num_paused = self._schedule()
                    self._run_step(batch)
                    self._iteration += 1
                    self._send_responses(batch)
                else:
                    batch, num_paused = self._overlapped_step()
                self._send_stats(batch, num_paused)
        except BaseException:  # an internal bug: fail what is in flight rather than hang the users
            logger.exception("GptManager worker crashed")
            self._fail_all("internal error in the batch manager worker (see the log)")
        finally:
            if self._forward_pool is not None:
                self._forward_pool.shutdown(wait=True)

    def _fetch_new_requests(self) -> tuple[int, bool]:
        capacity = max(self.config.max_num_sequences - len(self._active), 0)
        try:
            requests = list(self._call("get_inference_requests_cb", self._get_requests, capacity) or ())
        except TypeError:
            logger.error("get_inference_requests_cb returned a non-iterable; ignored")
            requests = []
        for i, request in enumerate(requests):
            if self.config.terminate_req_id is not None and request.request_id == self.config.terminate_req_id:
                for later in requests[i + 1:]:
                    self._send(later.request_id, [], True, "terminated: the terminate request id was received")
                return len(requests), True
            self._admit(request)
        return len(requests), False

    def _admit(self, request) -> None:
        request_id = getattr(request, "request_id", None)
        try:
            if not isinstance(request_id, int) or isinstance(request_id, bool) or not 0 <= request_id < 1 << 64:
                raise RequestError(f"request_id: expected an integer in [0, 2**64), got {request_id!r}")
            if request_id in self._active:
                raise RequestError(f"request_id: {request_id} already exists among the active requests")
            llm_request = to_llm_request(request, self.config.limits, self._num_admitted)
        except Exception as e:  # noqa: BLE001 - any bad input becomes that request's error
            self._send(request_id, [], True, f"Cannot process new request: {e}")
            return
        self._num_admitted += 1
        self._active[request_id] = llm_request

    def _apply_stop_signals(self) -> None:
        if self._poll_stop_signals is None:
            return
        try:
            stop_ids = list(self._call("poll_stop_signal_cb", self._poll_stop_signals) or ())
        except TypeError:
            logger.error("poll_stop_signal_cb returned a non-iterable; ignored")
            return
        for request_id in stop_ids:
            r = self._active.get(request_id) if isinstance(request_id, int) else None
            if r is not None and not r.is_finished:
                r.finish(FinishReason.STOPPED)
                if not self._is_in_flight(r):   # else completed once its forward is done
                    self._complete(r)

    def _is_in_flight(self, r: LlmRequest) -> bool:
        return self._in_flight is not None and any(r in group for group, _ in self._in_flight.groups)

    def _schedule(self, in_flight: frozenset[LlmRequest] = frozenset(),
                  max_batch_size: int | None = None) -> tuple[MicroBatch, int]:
        capacity = self.capacity.schedule(list(self._active.values()), in_flight)
        return self.micro_batch.schedule(capacity.fitting, max_batch_size), len(capacity.paused)

    # -- the step: prepare, forward, update -------------------------------------------------------

    def _run_step(self, batch: MicroBatch) -> None:
        groups = self._prepare_groups(batch)
        self._update_groups(groups, self._forward_groups(groups))

    def _overlapped_step(self) -> tuple[MicroBatch, int]:
        """Schedule and prepare this micro-batch while the other one's forward runs; then start
        this forward and, while it runs, decode the other one and send its responses."""
        in_flight = frozenset(r for group, _ in self._in_flight.groups for r in group) \
            if self._in_flight is not None else frozenset()
        # Half the active requests per micro-batch, so that the two alternate.
        batch, num_paused = self._schedule(in_flight, max(1, -(-len(self._active) // 2)))
        groups = self._prepare_groups(batch)
        previous, self._in_flight = self._in_flight, None
        previous_results = previous.future.result() if previous is not None else None
        if groups:
            self._in_flight = _InFlight(batch, groups, self._forward_pool.submit(self._forward_groups, groups))
        self._iteration += 1
        for r in batch.requests:   # failed while preparing
            if r.is_finished:
                self._complete(r)
        if previous is not None:
            self._update_groups(previous.groups, previous_results)
            self._send_responses(previous.batch)
        return batch, num_paused

    def _prepare_groups(self, batch: MicroBatch) -> list[tuple[list[LlmRequest], PreparedStep]]:
        if self.config.model_type == TrtGptModelType.InflightFusedBatching:
            groups = [batch.generation_requests + batch.context_requests]
        else:
            groups = [batch.context_requests, batch.generation_requests]
        prepared = []
        for group in groups:
            if not group:
                continue
            try:
                if self.fault_injector is not None:
                    self.fault_injector(group)
                prepared.append((group, self.executor.prepare(group)))
            except Exception as e:  # noqa: BLE001
                self._fail_group(group, e)
        return prepared

    def _forward_groups(self, groups: list[tuple[list[LlmRequest], PreparedStep]]) -> list:
        """Runs on the forward thread under overlap: touches no manager state."""
        results = []
        for _, prepared in groups:
            try:
                results.append(self.executor.forward(prepared))
            except Exception as e:  # noqa: BLE001
                results.append(e)
        return results

    def _update_groups(self, groups: list[tuple[list[LlmRequest], PreparedStep]], results: list) -> None:
        for (group, prepared), result in zip(groups, results):
            try:
                if isinstance(result, Exception):
                    raise result
                self.executor.update(prepared, result)
            except Exception as e:  # noqa: BLE001
                self._fail_group(group, e)

    @staticmethod
    def _fail_group(group: list[LlmRequest], e: Exception) -> None:
        logger.error("model step failed for requests %s", [r.request_id for r in group], exc_info=e)
        for r in group:
            if not r.is_finished:
                r.finish(FinishReason.ERROR, f"Encountered an error in the model step: {e!r}")

    def _send_responses(self, batch: MicroBatch) -> None:
        for r in batch.context_requests + batch.generation_requests:
            if self._active.get(r.request_id) is not r:   # completed already (failed while prepared)
                continue
            if r.is_finished:
                self._complete(r)
            elif r.is_streaming and len(r.generated) > r.num_sent_tokens:
                tensors = self._response_tensors(r)
                if tensors is None:
                    self._complete(r)
                else:
                    self._send(r.request_id, tensors, False, "")

    def _complete(self, r: LlmRequest) -> None:
        """Send the final response and release everything the request holds."""
        free_request_blocks(self.kv, r)
        self.executor.decoder.release(r)
        del self._active[r.request_id]
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
            if r.is_finished:
                r.finish_reason, r.error = FinishReason.ERROR, f"failed to build the response: {e!r}"
            else:
                r.finish(FinishReason.ERROR, f"failed to build the response: {e!r}")
            return None

    def _fail_all(self, message: str) -> None:
        if self._in_flight is not None:   # let its forward end before the blocks are freed
            self._in_flight.future.exception()
            self._in_flight = None
        for r in list(self._active.values()):
            if not r.is_finished:
                r.finish(FinishReason.ERROR, message)
            self._complete(r)

    def _send_stats(self, batch: MicroBatch, num_paused: int) -> None:
        if self._report_stats is None or not self._active:
            return
        cpu, gpu, pinned = self.memory_usage
        is_v1 = self.config.model_type == TrtGptModelType.V1
        if is_v1 and batch.context_requests:  # a new static batch: its slots stay until all finish
            self._static_batch_size = batch.num_requests
        stats = IterationStats(
            iteration=self._iteration, num_active=len(self._active),
            max_num_requests=self.config.max_num_sequences, cpu_memory_bytes=cpu, gpu_memory_bytes=gpu,
            pinned_memory_bytes=pinned, max_blocks=self.kv.num_blocks, free_blocks=self.kv.num_free_blocks,
            used_blocks=self.kv.num_used_blocks, tokens_per_block=self.kv.tokens_per_block,
            allocated_total_blocks=self.kv.num_allocated_total, allocated_new_blocks=self.kv.num_allocated_new,
            reused_blocks=self.kv.num_reused, num_scheduled=batch.num_requests, num_context=len(batch.context_requests),
            num_generation=len(batch.generation_requests), num_context_tokens=batch.num_context_tokens,
            num_generation_tokens=len(batch.generation_requests), num_paused=num_paused,
            num_empty_generation_slots=max(0, self._static_batch_size - batch.num_requests) if is_v1 else 0,
            micro_batch_id=self._iteration % 2 if self._forward_pool is not None else 0)
        self._call("return_batch_manager_stats_cb", self._report_stats, stats_json(stats, is_v1))

    # -- callbacks --------------------------------------------------------------------------------

    def _send(self, request_id, tensors, is_final: bool, err_msg: str) -> None:
        self._call("send_response_cb", self._send_response, request_id, tensors, is_final, err_msg)

    @staticmethod
    def _call(name: str, fn: Callable, *args):
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001 - a user callback never kills the worker
            logger.exception("user callback %s raised", name)
            return None

