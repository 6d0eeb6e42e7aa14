"""Admission by a time-to-first-token budget: the context tokens per second the engine computes,
measured step by step on the worker thread, and the context tokens not yet computed of every
request that has no first token yet. The Executor's front end (and the serving sample's
GptManager bridge) own one of each; `predict_ttft_ms` is the prediction their enqueue refuses by.

Prediction: a new request's first token comes once the context tokens ahead of it (those of
waiting or running requests of at least its priority that have no first token yet) and its own
are computed: (ahead + own) / measured context tokens per second.
NOTE: conservative where it errs: a step's whole time is charged to its context tokens (the
generation tokens batched with them make the rate lower than a pure context step's), and a
prompt's cached prefix blocks (block reuse) still count as work.
Warm-up: the first context step after the start is not measured (first calls, allocations), and
nothing is refused by the budget until `min_steps` more have been."""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

WINDOW_STEPS = 32      # the rate is over the last this-many steps that computed context tokens
WARM_UP_STEPS = 2      # measured context steps before the first prediction
SKIPPED_STEPS = 1      # context steps not measured at the start


class ContextThroughput:
    """Context tokens per second over the last `window` steps that computed any. Thread-safe."""

    def __init__(self, window: int = WINDOW_STEPS, min_steps: int = WARM_UP_STEPS,
                 num_skipped: int = SKIPPED_STEPS):
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)   # (context tokens, seconds)
        self.min_steps, self._num_to_skip = min_steps, num_skipped
        self._lock = threading.Lock()

    def observe(self, num_context_tokens: int, step_s: float) -> None:
        """One step: its context tokens and its duration (fetch to stats, idle time excluded)."""
        if num_context_tokens <= 0 or step_s <= 0:
            return
        with self._lock:
            if self._num_to_skip:
                self._num_to_skip -= 1
                return
            self._steps.append((num_context_tokens, step_s))

    @property
    def tokens_per_s(self) -> float | None:
        """None while warming up."""
        with self._lock:
            if len(self._steps) < self.min_steps:
                return None
            return sum(n for n, _ in self._steps) / sum(s for _, s in self._steps)


@dataclass
class _Pending:
    num_tokens: int     # context tokens not yet computed
    priority: float
    is_running: bool    # admitted by the worker (ahead of any new request, whatever its priority)


class PendingContext:
    """request id -> its context tokens not yet computed, from enqueue until its first token (or
    its end). Thread-safe: enqueue adds, the worker side updates and removes."""

    def __init__(self):
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def add(self, request_id: int, num_tokens: int, priority: float = 0.5) -> None:
        with self._lock:
            self._pending[request_id] = _Pending(num_tokens, priority, False)

    def request_ids(self) -> list[int]:
        with self._lock:
            return list(self._pending)

    def update(self, request_id: int, num_tokens: int) -> None:
        """A running request: `num_tokens` of its context left."""
        with self._lock:
            pending = self._pending.get(request_id)
            if pending is not None:
                pending.num_tokens, pending.is_running = num_tokens, True

    def remove(self, request_id: int) -> None:
        with self._lock:
            self._pending.pop(request_id, None)

    def num_tokens_ahead(self, priority: float = 0.5) -> int:
        """Context tokens a new request of `priority` waits for: every running request's, and
        those of waiting requests of at least its priority (admission is by priority)."""
        with self._lock:
            return sum(p.num_tokens for p in self._pending.values() if p.is_running or p.priority >= priority)


def predict_ttft_ms(num_tokens_ahead: int, num_own_tokens: int, tokens_per_s: float) -> float:
    return (num_tokens_ahead + num_own_tokens) / tokens_per_s * 1000.0


def ttft_refusal(budget_ms: float, num_tokens_ahead: int, num_own_tokens: int,
                 throughput: ContextThroughput) -> tuple[str, float] | None:
    """(message, seconds until the prediction fits) when the predicted time to first token
    exceeds `budget_ms`; None when it fits or while the rate is still unmeasured."""
    rate = throughput.tokens_per_s
    if rate is None:
        return None
    predicted_ms = predict_ttft_ms(num_tokens_ahead, num_own_tokens, rate)
    if predicted_ms <= budget_ms:
        return None
    return (f"ttft_budget_ms: the predicted time to first token, {predicted_ms:.0f} ms ({num_tokens_ahead} context "
            f"tokens ahead and {num_own_tokens} of its own at {rate:.0f} context tokens/s), exceeds the budget of "
            f"{budget_ms:g} ms", (predicted_ms - budget_ms) / 1000.0)
