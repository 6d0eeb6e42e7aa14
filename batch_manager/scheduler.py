"""Two-stage scheduling, as the seed's PyTorch flow: capacity, then micro-batch (ints only).

Each request has computed tokens and a target (its token list); each step hands out a token
budget. The capacity stage decides who may hold KV blocks this iteration (admitting, allocating
and, under MAX_UTILIZATION, pausing); the micro-batch stage picks who runs this step under
max_batch_size and max_num_tokens. Subclass either stage to change a policy.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .kv_cache_manager import KvCacheManager
from .llm_request import LlmRequest, RequestState
from .options import SchedulerPolicy


@dataclass
class CapacityOutput:
    fitting: list[LlmRequest] = field(default_factory=list)  # hold blocks for their next step
    paused: list[LlmRequest] = field(default_factory=list)   # lost their blocks this iteration


class CapacityScheduler:
    """Base: GUARANTEED_NO_EVICT. A request is admitted (FIFO, never skipping the head of the
    queue) only if the worst case of every admitted request, prompt + max_new_tokens, fits."""

    def __init__(self, kv_cache_manager: KvCacheManager, max_num_requests: int):
        self.kv = kv_cache_manager
        self.max_num_requests = max_num_requests
        self._num_starts = 0

    def schedule(self, requests: list[LlmRequest]) -> CapacityOutput:
        """`requests`: active (unfinished) requests in admission order."""
        running = [r for r in requests if r.holds_blocks]
        out = CapacityOutput(fitting=list(running))
        if self.can_admit(running):
            available = self.kv.num_free_blocks - sum(
                self.kv.num_blocks_missing(r.request_id, r.max_num_tokens) for r in running)
            for r in requests:
                if r.state != RequestState.WAITING:
                    continue
                need = self.kv.blocks_for_tokens(r.max_num_tokens)
                if len(out.fitting) >= self.max_num_requests or need > available:
                    break
                available -= need
                self._start(r)
                out.fitting.append(r)
        for r in out.fitting:
            ok = self.kv.allocate(r.request_id, r.num_tokens)
            assert ok, f"request {r.request_id}: reserved KV blocks were not available"
        return out

    def can_admit(self, running: list[LlmRequest]) -> bool:
        return True

    def _start(self, r: LlmRequest) -> None:
        r.set_state(RequestState.CONTEXT)
        r.start_index = self._num_starts
        self._num_starts += 1


class GuaranteedNoEvictScheduler(CapacityScheduler):
    pass


class StaticBatchScheduler(CapacityScheduler):
    """GUARANTEED_NO_EVICT that admits new requests only once the previous batch has finished;
    with `max_num_tokens`, a batch's prompts also fit one context step (V1's lockstep batches)."""

    def __init__(self, kv_cache_manager: KvCacheManager, max_num_requests: int, max_num_tokens: int | None = None):
        super().__init__(kv_cache_manager, max_num_requests)
        self.max_num_tokens = max_num_tokens

    def can_admit(self, running: list[LlmRequest]) -> bool:
        return not running

    def schedule(self, requests: list[LlmRequest]) -> CapacityOutput:
        if self.max_num_tokens is None or any(r.holds_blocks for r in requests):
            return super().schedule(requests)
        budget, admissible = self.max_num_tokens, []
        for r in requests:
            if admissible and r.num_tokens > budget:
                break
            budget -= r.num_tokens
            admissible.append(r)
        return super().schedule(admissible)


class MaxUtilizationScheduler(CapacityScheduler):
    """Admit what fits now. When a running request needs a block and none is free, pause the most
    recently started request (free its blocks; it resumes later by recomputing its tokens)."""

    def schedule(self, requests: list[LlmRequest]) -> CapacityOutput:
        running = sorted((r for r in requests if r.holds_blocks), key=lambda r: r.start_index)
        out = CapacityOutput()
        while running:
            r = running.pop(0)
            while not self.kv.allocate(r.request_id, r.num_tokens):
                victim = running.pop() if running else r
                self.kv.free(victim.request_id)
                victim.pause()
                out.paused.append(victim)
                if victim is r:
                    break
            if r.holds_blocks:
                out.fitting.append(r)
        if out.paused:  # memory is short: admit nothing new this iteration
            return out
        for r in requests:
            if r.state != RequestState.WAITING:
                continue
            if len(out.fitting) >= self.max_num_requests or \
                    self.kv.num_blocks_missing(r.request_id, r.num_tokens) > self.kv.num_free_blocks:
                break
            self._start(r)
            self.kv.allocate(r.request_id, r.num_tokens)
            out.fitting.append(r)
        return out


def make_capacity_scheduler(policy: SchedulerPolicy, kv_cache_manager: KvCacheManager, max_num_requests: int,
                            static_max_num_tokens: int | None = None) -> CapacityScheduler:
    if policy == SchedulerPolicy.MAX_UTILIZATION:
        return MaxUtilizationScheduler(kv_cache_manager, max_num_requests)
    if policy == SchedulerPolicy.STATIC_BATCH:
        return StaticBatchScheduler(kv_cache_manager, max_num_requests, static_max_num_tokens)
    if policy == SchedulerPolicy.GUARANTEED_NO_EVICT:
        return GuaranteedNoEvictScheduler(kv_cache_manager, max_num_requests)
    raise ValueError(f"scheduler policy: unknown {policy!r}")


@dataclass
class MicroBatch:
    context_requests: list[LlmRequest] = field(default_factory=list)
    generation_requests: list[LlmRequest] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return len(self.context_requests) + len(self.generation_requests)

    @property
    def num_context_tokens(self) -> int:
        return sum(r.num_tokens_to_compute for r in self.context_requests)


class MicroBatchScheduler:
    """Generation requests first (one token each), then context requests in order, under
    max_batch_size sequences and max_num_tokens tokens. A context longer than the whole token
    budget runs alone rather than never."""

    def __init__(self, max_batch_size: int, max_num_tokens: int):
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens

    def schedule(self, fitting: list[LlmRequest]) -> MicroBatch:
        batch = MicroBatch()
        num_tokens = 0
        for r in fitting:
            if r.state == RequestState.GENERATION and batch.num_requests < self.max_batch_size \
                    and num_tokens + 1 <= self.max_num_tokens:
                batch.generation_requests.append(r)
                num_tokens += 1
        for r in fitting:
            if r.state != RequestState.CONTEXT or batch.num_requests >= self.max_batch_size:
                continue
            n = r.num_tokens_to_compute
            if num_tokens + n <= self.max_num_tokens or batch.num_requests == 0:
                batch.context_requests.append(r)
                num_tokens += n
        return batch
