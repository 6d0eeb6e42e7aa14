"""The Executor under the Dynamo worker: owns it and one consumer thread that awaits every
response and hands each request's `Result`s to the asyncio queue of the coroutine that enqueued
it. `cancel` stops a request (its final result comes back CANCELLED, its blocks freed); the KV
pool's counts and each iteration's stats are read here for the load snapshot and the metrics."""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable

from batch_manager.executor import Executor, ExecutorConfig, Request, Result

logger = logging.getLogger(__name__)

CONSUMER_POLL_S = 0.05   # how soon the consumer sees a close
SHUT_DOWN = "the engine is shutting down"


class ResultQueue:
    """One request's results: a `Result`, or an error message (str) that ends it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: Result | str) -> None:   # any thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:   # its loop is closed: nobody is left to read it
            logger.debug("a result for a closed event loop dropped")

    async def get(self) -> Result | str:
        return await self.queue.get()


class ExecutorStream:
    def __init__(self, engine_dir: str, config: ExecutorConfig,
                 on_iteration: Callable[[object], None] | None = None):
        """on_iteration(IterationStats): called on the consumer thread for each iteration."""
        self.executor = Executor(engine_dir, executor_config=config)
        self._on_iteration = on_iteration
        self._lock = threading.Lock()
        self._id_to_queue: dict[int, ResultQueue] = {}
        self._is_closed = False
        self._consumer = threading.Thread(target=self._consume, name="DynamoExecutorConsumer", daemon=True)
        self._consumer.start()

    @property
    def limits(self):
        """The engine's AdmissionLimits (max_seq_len, tokens_per_block, the KV pool's size)."""
        return self.executor.front_end.limits

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> tuple[int, ResultQueue]:
        """ValueError (the Executor's, naming its field) for a request it refuses; QueueFullError
        for load; RuntimeError once closed."""
        if self._is_closed:
            raise RuntimeError(SHUT_DOWN)
        results = ResultQueue(loop)
        with self._lock:   # registered before the consumer can see a response of the id
            request_id = self.executor.enqueue_request(request)
            self._id_to_queue[request_id] = results
        return request_id, results

    def cancel(self, request_id: int) -> None:
        """Stop the request; its final (CANCELLED) result still reaches its queue. Idempotent."""
        with self._lock:
            is_live = request_id in self._id_to_queue
        if is_live:
            self.executor.cancel_request(request_id)

    def forget(self, request_id: int) -> None:
        """Nobody reads the request's results any more: cancel it and drop its queue."""
        with self._lock:
            is_live = self._id_to_queue.pop(request_id, None) is not None
        if is_live:
            self.executor.cancel_request(request_id)

    def num_live(self) -> int:
        with self._lock:
            return len(self._id_to_queue)

    def kv_block_counts(self) -> tuple[int, int]:
        """(used, total) blocks of the KV pool; cached free blocks count as free."""
        kv = self.executor.kv_cache_manager
        return kv.num_used_blocks, kv.num_blocks

    def close(self) -> None:
        """Every live request ends with an error result; the Executor shuts down. Idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        with self._lock:
            live, self._id_to_queue = self._id_to_queue, {}
        for request_id, results in live.items():
            self.executor.cancel_request(request_id)
            results.put(SHUT_DOWN)
        self.executor.shutdown()
        self._consumer.join(10)

    # -- the consumer thread ----------------------------------------------------------------------

    def _consume(self) -> None:
        while not (self._is_closed and not self.executor.can_enqueue_requests()):
            for response in self.executor.await_responses(timeout=CONSUMER_POLL_S):
                self._deliver(response)
            if self._on_iteration is not None:
                for stats in self.executor.get_latest_iteration_stats():
                    self._on_iteration(stats)

    def _deliver(self, response) -> None:
        is_final = response.has_error() or response.result.is_final
        with self._lock:
            results = self._id_to_queue.pop(response.request_id, None) if is_final \
                else self._id_to_queue.get(response.request_id)
        if results is not None:
            results.put(response.error_msg if response.has_error() else response.result)
