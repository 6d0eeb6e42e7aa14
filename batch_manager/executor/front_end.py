"""The Executor's adapter to the worker (`batch_manager.doors.front_end.FrontEnd`): requests validated
on the caller's thread wait in a priority queue, stop ids in a set, results in the response
store, stats in their rings. The caller-side methods are thread-safe; the protocol's methods run
on the worker thread. Admission by load (queue bounds, the time-to-first-token budget) happens at
enqueue, from the context rate and pending context this front end measures (ttft.py)."""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Callable

from runtime.request import AdmissionLimits, RequestOutput, RequestSpec, clamped_new_tokens
from runtime.request import FinishReason as CoreFinishReason

from ..doors.front_end import Fetched
from ..doors.rendering import StreamCursors
from ..scheduling.llm_request import LlmRequest
from ..stats import IterationStats as CoreIterationStats
from .conversion import OutputOptions, is_samples, to_result, to_sequence_results, to_spec
from .deadlines import Deadlines, check_allotted_time_ms, check_milliseconds
from .disaggregated import ContextOnly, KvTransfer, check_request_type
from .queues import QueuedRequest, QueueFullError, RequestQueue, ResponseStore
from .request import FinishReason, Request, Response, Result
from .stats import IterationStats, RequestStatsPerIteration, StatsRings, queued_stats, request_stats
from .ttft import ContextThroughput, PendingContext, ttft_refusal

if TYPE_CHECKING:
    from ..kv_transport.kv_handoff import ExportedKv


# The longest an idle worker blocks without news: the heartbeat to the other ranks and timed
# bookkeeping (KV handed to a generation instance, expired) go on while nothing arrives.
IDLE_BLOCK_S = 0.5


class ExecutorFrontEnd:
    def __init__(self, max_queue_size: int | None, iter_stats_max_iterations: int, request_stats_max_iterations: int,
                 normalize_log_probs: bool, post_processors: dict[str, Callable], has_batched_post_processor: bool,
                 is_static_batching: bool, max_num_queued_tokens: int | None = None):
        self.requests, self.responses = RequestQueue(max_queue_size, max_num_queued_tokens), ResponseStore()
        self.throughput, self.pending_context = ContextThroughput(), PendingContext()
        self.deadlines = Deadlines()
        self._step_start_s = time.monotonic()   # when the worker's current iteration began (its fetch)
        self.stats = StatsRings(iter_stats_max_iterations, request_stats_max_iterations)
        self.limits: AdmissionLimits | None = None     # set once the engine is built
        self.kv_transfer: KvTransfer | None = None      # likewise (disaggregated requests)
        self._normalize_log_probs = normalize_log_probs
        self._post_processors, self._has_batched = dict(post_processors), has_batched_post_processor
        self._is_static_batching = is_static_batching
        self._options: dict[int, OutputOptions] = {}   # request id -> result shaping, until its final
        self._streams = StreamCursors()
        self._sample_cursors: dict[int, list[int]] = {}   # request id -> tokens sent per sequence (samples)
        self._context_only: dict[int, ContextOnly] = {}   # request id -> what its params record, until its final
        self._stop_lock, self._stop_ids = threading.Lock(), set()
        self._next_id = 1
        self._work = threading.Event()   # set when a request, a cancel or the shutdown arrives

    # -- caller side ---------------------------------------------------------------------------------

    def enqueue(self, requests: list[Request], listener: Callable[[], None] | None = None) -> list[int]:
        """Validate every request, then queue them all, or none: ValueError naming the field for
        bad input; RuntimeError once closed; QueueFullError for load (max_queue_size,
        max_num_queued_tokens, a predicted first token past ttft_budget_ms). `listener`: see
        `ResponseStore.listen` (set before the worker can answer)."""
        converted = [self._convert(request) for request in requests]
        specs = [spec for spec, _, _ in converted]
        times = [(check_allotted_time_ms(r.allotted_time_ms), _ttft_budget_ms(r.ttft_budget_ms)) for r in requests]
        queue = self.requests
        if queue.max_num_tokens is not None:
            for spec in specs:
                if len(spec.prompt) > queue.max_num_tokens:
                    raise ValueError(f"input_token_ids: {len(spec.prompt)} tokens, more than the executor's "
                                     f"max_num_queued_tokens {queue.max_num_tokens}: it could never be queued")
        with queue.lock:
            if queue.closed:
                raise RuntimeError("Executor: shut down; no requests can be enqueued")
            queue.check_room(specs, self.throughput.tokens_per_s)
            self._check_ttft(specs, [budget for _, budget in times])
            ids = list(range(self._next_id, self._next_id + len(converted)))
            self._next_id += len(converted)
            for request_id, (spec, options, context_only), (allotted_ms, _) in zip(ids, converted, times):
                self._options[request_id] = options
                if context_only is not None:
                    self._context_only[request_id] = context_only
                self.pending_context.add(request_id, _num_context_tokens(spec), spec.priority)
                if allotted_ms is not None:
                    self.deadlines.add(request_id, allotted_ms)
                self.responses.register(request_id, listener)
            queue.push_all([QueuedRequest(request_id, spec, self._exports_kv(spec, context_only))
                            for request_id, (spec, _, context_only) in zip(ids, converted)])
        self._work.set()
        return ids

    def _convert(self, request: Request) -> tuple[RequestSpec, OutputOptions, ContextOnly | None]:
        """A request's spec and result shaping; for a context-only one, what its params record."""
        _, disaggregated = check_request_type(request, self.limits, self.kv_transfer)
        context_only = disaggregated if isinstance(disaggregated, ContextOnly) else None
        spec, options = to_spec(request, self.limits, self._normalize_log_probs, self._post_processors,
                                self._has_batched, None if context_only else disaggregated, context_only is not None)
        return spec, options, context_only

    def _exports_kv(self, spec: RequestSpec, context_only: ContextOnly | None) -> bool:
        """A context-only request leaves its prompt's KV unless its first token ends it (the length
        it asked for, clamped to max_seq_len, is one)."""
        return context_only is not None and clamped_new_tokens(self.limits, len(spec.prompt), context_only.max_tokens) > 1

    def _check_ttft(self, specs: list[RequestSpec], budgets_ms: list[float | None]) -> None:
        """QueueFullError for the first request whose predicted first token is later than its budget
        (the requests before it in the same call count as ahead of it)."""
        num_before = 0
        for spec, budget_ms in zip(specs, budgets_ms):
            own = _num_context_tokens(spec)
            if budget_ms is not None:
                ahead = self.pending_context.num_tokens_ahead(spec.priority) + num_before
                refusal = ttft_refusal(budget_ms, ahead, own, self.throughput)
                if refusal is not None:
                    raise QueueFullError(f"Executor: {refusal[0]}", refusal[1])
            num_before += own

    def bookkeeping_counts(self) -> dict[str, int]:
        return dict(queued=len(self.requests), result_shaping=len(self._options),
                    streams=len(self._streams) + len(self._sample_cursors),
                    known_ids=len(self.responses.known_ids), ready=self.responses.num_ready(),
                    pending_context=len(self.pending_context), deadlines=len(self.deadlines))

    def close(self) -> None:
        with self.requests.lock:
            self.requests.closed = True
        self._work.set()

    def cancel(self, request_id: int) -> None:
        """A queued request is answered at once; an admitted one stops at the worker's next poll."""
        queued = self.requests.remove(request_id)
        if queued is not None:
            output = RequestOutput(request_id, queued.spec.prompt, queued.spec.num_sequences)
            output.finish(CoreFinishReason.STOPPED, queued.spec.max_new_tokens)
            self.respond(queued.spec, output, True)
            return
        with self._stop_lock:
            self._stop_ids.add(request_id)
        self._work.set()

    # -- the worker's side (FrontEnd) ----------------------------------------------------------------

    def wait_for_work(self, stop: threading.Event, poll_s: float) -> None:
        """Blocks until a request, a cancel or the shutdown arrives (`wake`), at most
        IDLE_BLOCK_S: an idle executor costs no CPU."""
        self._work.wait(IDLE_BLOCK_S)
        self._work.clear()   # before the fetch that follows: what arrives later sets it again

    def wake(self) -> None:
        self._work.set()

    @property
    def num_pending(self) -> int:
        return len(self.requests)

    @property
    def has_stats(self) -> bool:
        return True   # every step measures the context rate (ttft.py), whatever the rings keep

    def fetch(self, max_num_requests: int) -> Fetched:
        self._step_start_s = time.monotonic()   # the worker's iteration begins here
        requests = self.requests.pop(max_num_requests)
        for item in requests:   # fetched: ahead of any request enqueued from now on
            self.pending_context.update(item.request_id, _num_context_tokens(item.spec))
        return Fetched(requests, len(requests))

    def admit(self, item: QueuedRequest, arrival_index: int) -> LlmRequest:
        """A generation-only request starts fetching its prompt's KV (it is scheduled once fetched)."""
        resumed = item.spec.resumed
        return LlmRequest(item.request_id, item.spec, arrival_index, exports_kv=item.exports_kv,
                          kv_import=None if resumed is None else self.kv_transfer.fetch(resumed.source))

    def poll_stop_ids(self) -> list[int]:
        for request_id in self.deadlines.pop_expired():   # allotted_time_ms passed: ends as if cancelled
            self.cancel(request_id)
        with self._stop_lock:
            ids, self._stop_ids = list(self._stop_ids), set()
        return ids

    def respond(self, spec: RequestSpec, output: RequestOutput, is_final: bool,
                kv_export: ExportedKv | None = None) -> None:
        request_id = output.request_id
        if is_final or output.num_generated:
            self.pending_context.remove(request_id)
        if is_samples(spec):
            self._respond_samples(spec, output, is_final)
            return
        start = self._streams.start(output, is_final)
        if start is None:
            return
        result = to_result(spec, output, start, is_final, self._options[request_id], kv_export is not None)
        if is_final and kv_export is not None:
            result.context_phase_params = self._context_only[request_id].params(request_id, output, kv_export,
                                                                                self.kv_transfer)
        self._streams.advance(output, is_final)
        if is_final:
            self._options.pop(request_id, None)
            self._context_only.pop(request_id, None)
            self._mark_timed_out(request_id, [result])
        self.responses.push(Response(request_id, result, client_id=spec.client_id), is_final)

    def _respond_samples(self, spec: RequestSpec, output: RequestOutput, is_final: bool) -> None:
        request_id = output.request_id
        sent = self._sample_cursors.get(request_id) or [0] * len(output.sequences)
        results = to_sequence_results(spec, output, sent, is_final, self._options[request_id])
        if is_final:
            self._options.pop(request_id, None)
            self._sample_cursors.pop(request_id, None)
            self._mark_timed_out(request_id, results)
        else:
            self._sample_cursors[request_id] = [len(s.tokens) for s in output.sequences]
        for result in results:
            self.responses.push(Response(request_id, result, client_id=spec.client_id), result.is_final)

    def _mark_timed_out(self, request_id: int, results: list[Result]) -> None:
        """A request stopped because its allotted_time_ms passed: TIMED_OUT, not CANCELLED."""
        if self.deadlines.forget(request_id):
            for result in results:
                result.finish_reasons = [FinishReason.TIMED_OUT if reason == FinishReason.CANCELLED else reason
                                         for reason in result.finish_reasons]

    def refuse(self, request_id: int, message: str) -> None:
        self.respond_error(request_id, message)   # the executor's ids are its own: never a duplicate

    def respond_error(self, request_id: int, message: str) -> None:
        self.pending_context.remove(request_id)
        self.deadlines.forget(request_id)
        self._options.pop(request_id, None)
        self._context_only.pop(request_id, None)
        self._streams.forget(request_id)
        self._sample_cursors.pop(request_id, None)
        self.responses.push(Response(request_id, error_msg=message), True)

    def report_stats(self, stats: CoreIterationStats, scheduled_ids: frozenset[int], scheduler,
                     finished: list[LlmRequest]) -> None:
        self.throughput.observe(stats.num_context_tokens, time.monotonic() - self._step_start_s)
        # The context still to compute of the admitted requests without a first token: only those
        # (none in a steady generation phase), not every active request each step; one with its
        # first token leaves (a non-streamed one answers only at its end).
        for request_id in self.pending_context.request_ids():
            r = scheduler.get(request_id)
            if r is None:   # still queued
                continue
            if r.generated or r.is_finished:
                self.pending_context.remove(request_id)
            else:
                self.pending_context.update(request_id, max(r.prompt_len - r.num_computed_tokens, 0))
        iteration = IterationStats(stats, self._is_static_batching) if self.stats.keeps_iterations else None
        per_request = None
        if self.stats.keeps_requests:
            requests = scheduler.active_requests() + finished
            per_request = RequestStatsPerIteration(stats.iteration, [
                *(request_stats(r, r.request_id in scheduled_ids) for r in requests),
                *(queued_stats(queued.request_id) for queued in self.requests.snapshot())])
        self.stats.add(iteration, per_request)


def _ttft_budget_ms(value) -> float | None:
    """Request.ttft_budget_ms: ValueError naming the field unless None or a finite number > 0."""
    return check_milliseconds("ttft_budget_ms", value)


def _num_context_tokens(spec: RequestSpec) -> int:
    """The context a request computes before its first token: none for a generation-only request
    (its prompt's KV comes from the context side)."""
    return 0 if spec.resumed is not None else len(spec.prompt)
