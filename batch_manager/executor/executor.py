"""Executor: the seeds' enqueue / await / cancel front-end over the engine core (the same worker
loop, scheduler and model executor as GptManager, built by the same builder). A thin facade: the
worker owns the state, `ExecutorFrontEnd` the queues between it and the callers."""
from __future__ import annotations

import asyncio
import logging
import os
from datetime import timedelta
from typing import AsyncIterator

from ..distributed import Follower
from ..engine_builder import build_engine_core, start_worker
from ..worker import Worker
from .config import ExecutorConfig, ModelType, core_params
from .disaggregated import KvTransfer
from .front_end import ExecutorFrontEnd
from .kv_events import KvCacheEvent, KvEventBuffer, joined_sinks
from .request import Request, Response, Result
from .stats import IterationStats, RequestStatsPerIteration
from .waits import timeout_seconds

logger = logging.getLogger(__name__)


def _request_ids(id_or_ids) -> list[int]:
    ids = list(id_or_ids) if isinstance(id_or_ids, (list, tuple)) else [id_or_ids]
    for request_id in ids:
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            raise ValueError(f"id_or_ids: expected request ids (ints), got {request_id!r}")
    return ids


class Executor:
    def __init__(self, model_path: str | os.PathLike, model_type: ModelType = ModelType.DECODER_ONLY,
                 executor_config: ExecutorConfig | None = None):
        ModelType(model_type)
        config = executor_config if executor_config is not None else ExecutorConfig()
        core_model_type, policy, params = core_params(config)
        post = config.logits_post_processor_config
        front_end = ExecutorFrontEnd(
            config.max_queue_size, config.iter_stats_max_iterations, config.request_stats_max_iterations,
            bool(config.normalize_log_probs), (post.processor_map or {}) if post is not None else {},
            post is not None and post.processor_batched is not None, core_model_type.name == "V1",
            config.max_num_queued_tokens)
        num_events = config.kv_cache_config.event_buffer_max_size if hasattr(
            config.kv_cache_config, "event_buffer_max_size") else 0
        kv_events = KvEventBuffer(num_events) if num_events else None
        max_beam_width = config.max_beam_width
        kv_transfer_address, kv_transfer_timeout_s = config.kv_transfer_address, config.kv_transfer_timeout_ms / 1000

        def build() -> Worker | Follower:   # on the worker thread; no reference to the Executor (collectable)
            core = build_engine_core(model_path, core_model_type, max_beam_width, policy, params)
            if isinstance(core, Follower):   # a rank > 0 of a tensor-parallel world
                front_end.close()
                return core
            core.scheduler.kv.event_sink = joined_sinks(core.scheduler.kv.event_sink, kv_events)
            front_end.limits = core.limits
            front_end.kv_transfer = KvTransfer(core.executor.runner, kv_transfer_address, kv_transfer_timeout_s)
            core.scheduler.kv_exports = front_end.kv_transfer.exports
            return Worker(core.worker_config, core.scheduler, core.executor, front_end, core.kv_events)

        self._front_end, self._kv_events = front_end, kv_events
        self._worker = start_worker(build, "ExecutorWorker")

    # -- requests --------------------------------------------------------------------------------------

    def enqueue_request(self, request: Request) -> int:
        """-> the request's id. ValueError naming the field for bad input (nothing is queued);
        QueueFullError (a RuntimeError, with retry_after_s) for load: max_queue_size requests or
        max_num_queued_tokens prompt tokens waiting, or a predicted time to first token past the
        request's ttft_budget_ms; RuntimeError after shutdown, or on a rank > 0 of a
        tensor-parallel world (requests go to rank 0)."""
        self._check_leader()
        return self._front_end.enqueue([request])[0]

    def enqueue_requests(self, requests: list[Request]) -> list[int]:
        """All or nothing: one bad request raises and none is queued."""
        self._check_leader()
        return self._front_end.enqueue(list(requests))

    def cancel_request(self, request_id: int) -> None:
        """The request ends with what it has; its final result has FinishReason.CANCELLED."""
        self._front_end.cancel(request_id)

    def await_responses(self, id_or_ids=None, timeout=None):
        """await_responses(timeout=None) -> the ready responses of any request (waits for one);
        await_responses(id, timeout) -> those of one request (an error response for an unknown
        id, at once); await_responses([ids], timeout) -> a list per id. timeout: timedelta, finite
        seconds >= 0, or None (until ready or shutdown); [] when it passes. An any-id call leaves
        the responses of ids that another call awaits by id (or `generate_async` reads) to that
        call. After shutdown no call waits."""
        if isinstance(id_or_ids, timedelta):
            id_or_ids, timeout = None, id_or_ids
        timeout_s = timeout_seconds(timeout)
        store = self._front_end.responses
        if id_or_ids is None:
            return store.await_any(timeout_s)
        per_id = store.await_ids(_request_ids(id_or_ids), timeout_s)
        return per_id if isinstance(id_or_ids, (list, tuple)) else per_id[0]

    def get_num_responses_ready(self, request_id: int | None = None) -> int:
        return self._front_end.responses.num_ready(request_id)

    async def generate_async(self, request: Request) -> AsyncIterator[Result]:
        """The results of one request as they come; raises RuntimeError with an error response's
        message. Cancelling the task (or closing the generator early) cancels the request."""
        loop, ready = asyncio.get_running_loop(), asyncio.Event()
        self._check_leader()
        request_id = self._front_end.enqueue([request], lambda: loop.call_soon_threadsafe(ready.set))[0]
        store = self._front_end.responses
        done = False
        try:
            while not done:
                was_closed = store.closed   # read first: every response comes before the close
                [responses] = store.await_ids([request_id], 0)
                if not responses:
                    if was_closed:
                        raise RuntimeError(f"request {request_id}: the executor shut down before its final result")
                    await ready.wait()
                    ready.clear()
                    continue
                for response in responses:
                    if response.has_error():
                        done = True
                        raise RuntimeError(f"request {request_id}: {response.error_msg}")
                    done = response.result.is_final
                    yield response.result
        finally:
            if not done:
                self.cancel_request(request_id)
                store.abandon(request_id)
            store.listen(request_id, None)

    # -- state and statistics ---------------------------------------------------------------------

    def _check_leader(self) -> None:
        if isinstance(self._worker, Follower):
            raise RuntimeError(f"rank {self._worker.tp.global_rank} of a tensor-parallel world: only rank 0 takes "
                               "requests (can_enqueue_requests() is False here)")

    def can_enqueue_requests(self) -> bool:
        """False on ranks > 0 of a tensor-parallel world, after shutdown, or after a fatal error."""
        return not isinstance(self._worker, Follower) and not self._front_end.requests.closed and self._worker.is_running

    @property
    def fatal_error(self) -> str | None:
        return self._worker.fatal_error

    def get_num_active_requests(self) -> int:
        """Requests enqueued and not yet finished: waiting in the queue or admitted."""
        if isinstance(self._worker, Follower):
            return 0
        return self._worker.num_active_requests + self._front_end.num_pending

    @property
    def kv_cache_manager(self):
        """The KV block manager (runtime.cache.KvCacheManager), for reading: free blocks, reuse,
        `check_invariants()`. Rank 0 only; it changes on the worker thread."""
        self._check_leader()
        return self._worker.scheduler.kv

    @property
    def front_end(self) -> ExecutorFrontEnd:
        """The request side (`requests`, `responses`, `throughput`, `pending_context`, `kv_transfer`),
        for tests and benchmarks; the worker thread changes it."""
        return self._front_end

    def get_bookkeeping_counts(self) -> dict[str, int]:
        """What the Executor still holds for requests: every count is 0 once each request has
        ended and its final response was handed over (a leak check for soak tests), except
        `kv_exports`: context-only requests' blocks kept until fetched or timed out."""
        counts = self._front_end.bookkeeping_counts()
        counts["active"] = 0 if isinstance(self._worker, Follower) else self._worker.num_active_requests
        transfer = self._front_end.kv_transfer
        counts["kv_exports"] = 0 if transfer is None else transfer.exports.num_reserved
        return counts

    def get_latest_iteration_stats(self) -> list[IterationStats]:
        """The iterations since the last call (at most iter_stats_max_iterations, newest last)."""
        return self._front_end.stats.drain_iterations()

    def get_latest_request_stats(self) -> list[RequestStatsPerIteration]:
        """Per iteration since the last call, the stats of every request (request_stats_max_iterations > 0)."""
        return self._front_end.stats.drain_requests()

    def get_latest_kv_cache_events(self, timeout=None) -> list[KvCacheEvent]:
        """The events since the last call, after waiting up to `timeout` (as in await_responses)
        for the first; [] when it passes or after shutdown."""
        if self._kv_events is None:
            raise RuntimeError("KV-cache events are off: set KvCacheConfig(event_buffer_max_size=N)")
        return self._kv_events.get_latest(timeout_seconds(timeout))

    def shutdown(self) -> None:
        """Refuse new requests, finish every queued and running one, join the worker, then wake
        every wait (they return what is ready). Idempotent. On a rank > 0 of a tensor-parallel
        world: wait until rank 0 ends the run."""
        self._front_end.close()
        if self._front_end.kv_transfer is not None:   # no peer may hold a generation-only request past this
            self._front_end.kv_transfer.cancel_fetches()
        try:
            self._worker.shutdown()
        finally:
            self._front_end.responses.close()
            if self._front_end.kv_transfer is not None:
                self._front_end.kv_transfer.close()
            if self._kv_events is not None:
                self._kv_events.close()

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if getattr(self, "_worker", None) is not None:
            self.shutdown()
