"""Admission by load for the GptManager bridge (samples.serve `--api gpt_manager`): the same rules
as the Executor's enqueue (batch_manager.executor, API.md "Admission") over the bridge's own
queue: requests and prompt tokens waiting for the manager's get-requests callback, and the
predicted time to first token (batch_manager.executor.ttft) against the server's budget. The
handlers call `admit` / `cancelled`; the manager's callbacks `step_began`, `fetched`,
`first_token` and `step_ended`. Thread-safe."""
from __future__ import annotations

import threading
import time

from batch_manager.executor import QueueFullError
from batch_manager.executor.ttft import ContextThroughput, PendingContext, ttft_refusal


class BridgeAdmission:
    def __init__(self, max_queue_size: int | None = None, max_num_queued_tokens: int | None = None,
                 ttft_budget_ms: float | None = None):
        self.max_queue_size, self.max_num_queued_tokens = max_queue_size, max_num_queued_tokens
        self.ttft_budget_ms = ttft_budget_ms
        self.throughput, self.pending = ContextThroughput(), PendingContext()
        self._lock = threading.Lock()
        self._queued: dict[int, int] = {}   # request id -> prompt tokens, submitted and not yet fetched
        self._num_queued_tokens = 0
        self._step_start_s = time.monotonic()

    def admit(self, request_id: int, num_tokens: int) -> None:
        """Queue the request's tokens, or raise QueueFullError (with retry_after_s) for load;
        ValueError for a prompt longer than max_num_queued_tokens."""
        rate = self.throughput.tokens_per_s
        with self._lock:
            if self.max_queue_size is not None and len(self._queued) >= self.max_queue_size:
                raise QueueFullError(f"the request queue is full (max_queue_size={self.max_queue_size})",
                                     self._num_queued_tokens / rate if rate else None)
            limit = self.max_num_queued_tokens
            if limit is not None and num_tokens > limit:
                raise ValueError(f"input_ids: {num_tokens} tokens, more than this server's max_num_queued_tokens "
                                 f"{limit}: it could never be queued")
            if limit is not None and self._num_queued_tokens + num_tokens > limit:
                over = self._num_queued_tokens + num_tokens - limit
                raise QueueFullError(f"the request queue is full (max_num_queued_tokens={limit}, "
                                     f"{self._num_queued_tokens} prompt tokens waiting, {num_tokens} more asked)",
                                     over / rate if rate else None)
            if self.ttft_budget_ms is not None:
                refusal = ttft_refusal(self.ttft_budget_ms, self.pending.num_tokens_ahead(), num_tokens,
                                       self.throughput)
                if refusal is not None:
                    raise QueueFullError(*refusal)
            self._queued[request_id] = num_tokens
            self._num_queued_tokens += num_tokens
            self.pending.add(request_id, num_tokens)

    def cancelled(self, request_id: int) -> None:
        self.pending.remove(request_id)

    def step_began(self) -> None:
        self._step_start_s = time.monotonic()

    def fetched(self, request_id: int) -> None:
        """Handed to the manager (or dropped, cancelled)."""
        with self._lock:
            num_tokens = self._queued.pop(request_id, 0)
            self._num_queued_tokens -= num_tokens
        self.pending.update(request_id, num_tokens)

    def first_token(self, request_id: int) -> None:
        """Its first response (or its end): no context of its own left."""
        self.pending.remove(request_id)

    def step_ended(self, num_context_tokens: int) -> None:
        self.throughput.observe(num_context_tokens, time.monotonic() - self._step_start_s)
