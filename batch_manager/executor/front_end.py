"""The Executor's adapter to the worker (`batch_manager.front_end.FrontEnd`): requests validated
on the caller's thread wait in a priority queue, stop ids in a set, results in the response
store, stats in their rings. The caller-side methods are thread-safe; the protocol's methods run
on the worker thread."""
from __future__ import annotations

import threading
from typing import Callable

from ..admission import AdmissionLimits
from ..front_end import Fetched
from ..llm_request import FinishReason as CoreFinishReason
from ..llm_request import LlmRequest, RequestOutput, RequestSpec
from ..responses import StreamCursors
from ..stats import IterationStats as CoreIterationStats
from .conversion import OutputOptions, to_result, to_spec
from .queues import QueuedRequest, RequestQueue, ResponseStore
from .request import Request, Response
from .stats import IterationStats, RequestStatsPerIteration, StatsRings, queued_stats, request_stats


class ExecutorFrontEnd:
    def __init__(self, max_queue_size: int | None, iter_stats_max_iterations: int, request_stats_max_iterations: int,
                 normalize_log_probs: bool, post_processors: dict[str, Callable], has_batched_post_processor: bool,
                 is_static_batching: bool):
        self.requests, self.responses = RequestQueue(max_queue_size), ResponseStore()
        self.stats = StatsRings(iter_stats_max_iterations, request_stats_max_iterations)
        self.limits: AdmissionLimits | None = None     # set once the engine is built
        self._normalize_log_probs = normalize_log_probs
        self._post_processors, self._has_batched = dict(post_processors), has_batched_post_processor
        self._is_static_batching = is_static_batching
        self._options: dict[int, OutputOptions] = {}   # request id -> result shaping, until its final
        self._streams = StreamCursors()
        self._stop_lock, self._stop_ids = threading.Lock(), set()
        self._next_id = 1

    # -- caller side ---------------------------------------------------------------------------------

    def enqueue(self, requests: list[Request], listener: Callable[[], None] | None = None) -> list[int]:
        """Validate every request, then queue them all, or none: ValueError naming the field for
        bad input; RuntimeError once closed; QueueFullError past max_queue_size. `listener`: see
        `ResponseStore.listen` (set before the worker can answer)."""
        converted = [to_spec(request, self.limits, self._normalize_log_probs, self._post_processors,
                             self._has_batched) for request in requests]
        queue = self.requests
        with queue.lock:
            if queue.closed:
                raise RuntimeError("Executor: shut down; no requests can be enqueued")
            if queue.max_size is not None and len(queue) + len(converted) > queue.max_size:
                queue.push_all(converted)   # raises QueueFullError with the size
            ids = list(range(self._next_id, self._next_id + len(converted)))
            self._next_id += len(converted)
            for request_id, (_, options) in zip(ids, converted):
                self._options[request_id] = options
                self.responses.register(request_id, listener)
            queue.push_all([QueuedRequest(request_id, spec) for request_id, (spec, _) in zip(ids, converted)])
        return ids

    def bookkeeping_counts(self) -> dict[str, int]:
        return dict(queued=len(self.requests), result_shaping=len(self._options), streams=len(self._streams),
                    known_ids=self.responses.num_known, ready=self.responses.num_ready())

    def close(self) -> None:
        with self.requests.lock:
            self.requests.closed = True

    def cancel(self, request_id: int) -> None:
        """A queued request is answered at once; an admitted one stops at the worker's next poll."""
        queued = self.requests.remove(request_id)
        if queued is not None:
            output = RequestOutput.empty(request_id, queued.spec.num_sequences)
            output.finish(CoreFinishReason.STOPPED, queued.spec.max_new_tokens)
            self.respond(queued.spec, output, True)
            return
        with self._stop_lock:
            self._stop_ids.add(request_id)

    # -- the worker's side (FrontEnd) ----------------------------------------------------------------

    @property
    def num_pending(self) -> int:
        return len(self.requests)

    @property
    def has_stats(self) -> bool:
        return self.stats.keeps_iterations or self.stats.keeps_requests

    def fetch(self, max_num_requests: int) -> Fetched:
        requests = self.requests.pop(max_num_requests)
        return Fetched(requests, len(requests))

    def admit(self, item: QueuedRequest) -> RequestSpec:
        return item.spec

    def poll_stop_ids(self) -> list[int]:
        with self._stop_lock:
            ids, self._stop_ids = list(self._stop_ids), set()
        return ids

    def respond(self, spec: RequestSpec, output: RequestOutput, is_final: bool) -> None:
        request_id = output.request_id
        start = self._streams.start(output, is_final)
        if start is None:
            return
        result = to_result(spec, output, start, is_final, self._options[request_id])
        self._streams.advance(output, is_final)
        if is_final:
            self._options.pop(request_id, None)
        self.responses.push(Response(request_id, result, client_id=spec.client_id), is_final)

    def respond_error(self, request_id: int, message: str) -> None:
        self._options.pop(request_id, None)
        self._streams.forget(request_id)
        self.responses.push(Response(request_id, error_msg=message), True)

    def report_stats(self, stats: CoreIterationStats, scheduled_ids: frozenset[int], scheduler,
                     finished: list[LlmRequest]) -> None:
        iteration = IterationStats(stats, self._is_static_batching) if self.stats.keeps_iterations else None
        per_request = None
        if self.stats.keeps_requests:
            requests = scheduler.active_requests() + finished
            per_request = RequestStatsPerIteration(stats.iteration, [
                *(request_stats(r, r.request_id in scheduled_ids) for r in requests),
                *(queued_stats(queued.request_id) for queued in self.requests.snapshot())])
        self.stats.add(iteration, per_request)
