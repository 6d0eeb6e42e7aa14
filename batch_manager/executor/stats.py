"""The Executor's statistics: per-iteration stats (the legacy keys of GptManager's JSON) and
per-request stats, each kept in a ring of the newest N iterations that the getters drain."""
from __future__ import annotations

import enum
import threading
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from ..scheduling.llm_request import LlmRequest, RequestState
from ..stats import IterationStats as CoreIterationStats
from ..stats import stats_json


class IterationStats:
    """One iteration: the fields of batch_manager.stats.IterationStats as attributes."""

    def __init__(self, stats: CoreIterationStats, is_static_batching: bool):
        self._stats, self._is_static_batching = stats, is_static_batching

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_stats"], name)

    def to_json_str(self) -> str:
        return stats_json(self._stats, self._is_static_batching)

    def __repr__(self) -> str:
        return f"IterationStats({self._stats!r})"


class RequestStage(str, enum.Enum):
    QUEUED = "queued"          # not yet holding KV blocks (never started)
    CONTEXT = "context"        # computing its prompt (or recomputing it after a pause)
    GENERATION = "generation"
    FINISHED = "finished"      # answered in this iteration


@dataclass(frozen=True)
class RequestStats:
    id: int
    stage: RequestStage
    context_prefill_position: int   # tokens whose KV is computed (prompt and, after a pause, generated)
    num_generated_tokens: int
    scheduled: bool                 # ran in this iteration
    paused: bool                    # lost its blocks to a higher-priority or older request; waits
    num_reused_blocks: int          # cached prefix blocks it took over

    def to_json_str(self) -> str:
        return orjson.dumps(_json_dict(self)).decode()


@dataclass(frozen=True)
class RequestStatsPerIteration:
    iter: int
    request_stats: list[RequestStats]

    def to_json_str(self) -> str:
        return orjson.dumps({"iter": self.iter, "request_stats": [_json_dict(s) for s in self.request_stats]}).decode()


def _json_dict(s: RequestStats) -> dict:
    d = asdict(s)
    d["stage"] = s.stage.value
    return d


def request_stats(r: LlmRequest, scheduled: bool) -> RequestStats:
    if r.is_finished:
        stage = RequestStage.FINISHED
    elif r.state == RequestState.GENERATION:
        stage = RequestStage.GENERATION
    elif r.state == RequestState.CONTEXT or r.num_pauses:
        stage = RequestStage.CONTEXT
    else:
        stage = RequestStage.QUEUED
    return RequestStats(id=r.request_id, stage=stage, context_prefill_position=r.num_computed_tokens,
                        num_generated_tokens=len(r.generated), scheduled=scheduled,
                        paused=r.state == RequestState.WAITING and r.num_pauses > 0,
                        num_reused_blocks=r.num_reused_blocks)


def queued_stats(request_id: int) -> RequestStats:
    """A request still in the Executor's queue."""
    return RequestStats(id=request_id, stage=RequestStage.QUEUED, context_prefill_position=0,
                        num_generated_tokens=0, scheduled=False, paused=False, num_reused_blocks=0)


class StatsRings:
    """Written on the worker thread, drained by the getters on any thread."""

    def __init__(self, max_iterations: int, max_request_iterations: int):
        self._lock = threading.Lock()
        self._iterations: deque[IterationStats] = deque(maxlen=max_iterations or 1)
        self._requests: deque[RequestStatsPerIteration] = deque(maxlen=max_request_iterations or 1)
        self.keeps_iterations, self.keeps_requests = max_iterations > 0, max_request_iterations > 0

    def add(self, iteration: IterationStats | None, requests: RequestStatsPerIteration | None) -> None:
        with self._lock:
            if iteration is not None:
                self._iterations.append(iteration)
            if requests is not None:
                self._requests.append(requests)

    def drain_iterations(self) -> list[IterationStats]:
        with self._lock:
            out = list(self._iterations)
            self._iterations.clear()
            return out

    def drain_requests(self) -> list[RequestStatsPerIteration]:
        with self._lock:
            out = list(self._requests)
            self._requests.clear()
            return out
