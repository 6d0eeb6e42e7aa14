"""The capacity stage of scheduling (ints only): who may hold KV blocks this iteration, by policy
(admitting, allocating and, under MAX_UTILIZATION, pausing). Called by `Scheduler`; subclass a
policy to change it."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from runtime.cache.beam_blocks import beam_holder, free_beams, max_beam_blocks, prepare_beam_writes
from runtime.cache.kv_cache_manager import KvCacheManager

from ..kv_transport.kv_handoff import import_blocks
from runtime.request import FinishReason

from .llm_request import LlmRequest, RequestState
from ..options import SchedulerPolicy
from ..adapters.peft_cache import PeftCache


@dataclass
class CapacityOutput:
    fitting: list[LlmRequest] = field(default_factory=list)  # hold blocks for their next step
    paused: list[LlmRequest] = field(default_factory=list)   # lost their blocks this iteration


class CapacityScheduler:
    """Base: GUARANTEED_NO_EVICT. A request is admitted (by priority, higher first, FIFO among
    equals; never skipping the head of that queue) only if the worst case of every admitted request fits: the most blocks it can hold
    at once (prompt + max_new_tokens, or less under an attention window).

    The promise with shared blocks: S = free - sum over running requests of (worst - held) never
    goes negative. A prefix block another request holds costs its new holder nothing, and only
    a window release of a still-shared block lowers S (by one per extra reference), so with a
    window the shared blocks are kept in reserve (`kv.num_extra_refs`) and reuse earns no credit.

    Requests in `in_flight` (their forward is running: overlap) hold their blocks untouched.

    LoRA: a request starts only when its adapter can be made resident in the PEFT cache (evicting
    idle adapters); otherwise it waits at the head of the queue, like a request whose blocks do
    not fit. It keeps its adapter pinned while it holds blocks.
    """

    # Every running request's worst case is kept free for it, so it may take its blocks early
    # (multi-step decoding, Scheduler._decode_steps) at no other request's cost.
    reserves_worst_case = True

    def __init__(self, kv_cache_manager: KvCacheManager, max_num_requests: int, peft_cache: PeftCache | None = None):
        self.kv = kv_cache_manager
        self.max_num_requests = max_num_requests
        self.peft_cache = peft_cache
        self._num_starts = 0

    # -- adapters (the PEFT cache) -------------------------------------------------------------------

    def register(self, r: LlmRequest) -> str | None:
        """A newly admitted request: its adapter joins the cache. -> the error refusing it, or None."""
        if r.adapter is None:
            return None
        if self.peft_cache is None:
            return "lora_task_id: this manager has no PEFT cache"
        error = self.peft_cache.register(r.adapter)
        if error is None:   # the cache holds the weights now; its blocks are keyed by the cached instance
            instance = self.peft_cache.instance(r.adapter.task_id)
            r.adapter = replace(r.adapter, payload=None)
            r.cache_salt = (r.cache_salt or b"") + b"#" + instance.to_bytes(8, "little")
        else:
            r.adapter = None
        return error

    def release(self, r: LlmRequest) -> None:
        """`r` stops holding KV blocks (paused or ended): free them and unpin its adapter."""
        free_request_blocks(self.kv, r)
        if r.holds_adapter:
            self.peft_cache.release(r.adapter.task_id)
            r.holds_adapter = False

    def end(self, r: LlmRequest) -> None:
        """`r` ended: release it and its claim on the cached adapter."""
        self.release(r)
        if r.adapter is not None:
            self.peft_cache.unregister(r.adapter.task_id)
            r.adapter = None

    def take_adapter_changes(self) -> tuple[tuple, tuple[int, ...]]:
        """(loads, evictions) for the runtime's adapter store since the last step."""
        return self.peft_cache.take_changes() if self.peft_cache is not None else ((), ())

    def _can_start_adapter(self, r: LlmRequest) -> bool:
        return r.adapter is None or self.peft_cache.can_acquire(r.adapter.task_id)

    def schedule(self, requests: list[LlmRequest], in_flight: frozenset[LlmRequest] = frozenset()) -> CapacityOutput:
        """`requests`: active (unfinished) requests in admission order."""
        running = [r for r in requests if r.holds_blocks]
        out = CapacityOutput(fitting=[r for r in running if r not in in_flight])
        num_holding = len(running)
        if self.can_admit(running):
            available = self.kv.num_free_blocks - sum(
                max(0, self.worst_case_blocks(r) - self.kv.num_blocks_held(r.request_id)) for r in running)
            if self.kv.attention_window is not None:
                available -= self.kv.num_extra_refs
            for r in waiting_by_priority(requests):
                cost = self._admission_cost(r)
                if num_holding >= self.max_num_requests or cost > available or not self._can_start_adapter(r):
                    break
                if not self._start(r):
                    continue
                available -= cost
                num_holding += 1
                out.fitting.append(r)
        for r in out.fitting:
            ok = self._grow(r)
            assert ok, f"request {r.request_id}: reserved KV blocks were not available"
        return out

    def can_admit(self, running: list[LlmRequest]) -> bool:
        return True

    def worst_case_blocks(self, r: LlmRequest) -> int:
        if r.spec.num_sequences > 1:
            return max_beam_blocks(self.kv, r.spec.num_sequences, r.max_num_tokens)
        # Drafts never take a request past max_num_tokens (the scheduler clips them); a window
        # counts the longest step, drafts included.
        return self.kv.max_blocks_held(r.prompt_len + r.max_draft_len, r.max_num_tokens)

    def _admission_cost(self, r: LlmRequest) -> int:
        """Free blocks admitting `r` takes out of the promise: its worst case, less the cached
        prefix blocks it will share (plus the cached ones it takes off the free list)."""
        worst = self.worst_case_blocks(r)
        if self.kv.attention_window is not None:
            return worst
        prefix = self.kv.find_cached_prefix(_reusable_tokens(r))
        return worst - len(prefix) + sum(1 for b in prefix if self.kv.is_free(b))

    def _start(self, r: LlmRequest) -> bool:
        """Admit `r`: it starts holding blocks, beginning with its cached prefix. False: it ended
        instead (its fetched KV could not be imported) and holds nothing."""
        if r.adapter is not None:
            ok = self.peft_cache.acquire(r.adapter.task_id)
            assert ok, f"request {r.request_id}: adapter {r.adapter.task_id} was checked resident-able"
            r.holds_adapter = True
        r.set_state(RequestState.CONTEXT)
        r.start_index = self._num_starts
        self._num_starts += 1
        assert r.num_computed_tokens == 0
        r.num_computed_tokens = self.kv.acquire_cached_prefix(r.request_id, _reusable_tokens(r))
        r.num_reused_blocks += r.num_computed_tokens // self.kv.tokens_per_block
        if r.kv_import is not None:   # generation-only: the prompt's KV fetched from the context instance
            return self._import(r)
        return True

    def _import(self, r: LlmRequest) -> bool:
        """A starting generation-only request takes its fetched prompt KV. What a peer sent fails its
        own request (ended, its blocks and adapter released: False), never the worker."""
        try:
            fetched, r.kv_import = r.kv_import.result(timeout=0), None   # done: the scheduler waited for it
            r.pending_kv_writes = import_blocks(self.kv, r.request_id, r.prompt_len, r.num_computed_tokens, fetched)
        except Exception as e:  # noqa: BLE001 - a bad answer (or a bug it exposes) is this request's error
            self.release(r)
            r.kv_import, r.num_computed_tokens = None, 0
            message = str(e) if str(e).startswith("context_phase_params") else \
                f"context_phase_params: the fetched KV blocks could not be imported ({type(e).__name__}: {e})"
            r.finish(FinishReason.ERROR, message)
            return False
        r.num_computed_tokens = max(r.num_computed_tokens, r.prompt_len)
        return True

    def _grow(self, r: LlmRequest) -> bool:
        """Release what the window hides, then cover every token of `r`'s next step (for every
        live beam, with a private copy of the block each beam writes)."""
        if r.num_live_beams == 1:
            self.kv.release_invisible_blocks(r.request_id, r.num_computed_tokens)
            return self.kv.allocate(r.request_id, r.num_tokens_with_drafts)
        for b in range(r.num_live_beams):
            holder = beam_holder(r.request_id, b)
            self.kv.release_invisible_blocks(holder, r.num_computed_tokens)
            if not self.kv.allocate(holder, r.num_tokens):
                return False
        try:
            prepare_beam_writes(self.kv, r.request_id, r.num_live_beams, r.num_computed_tokens, r.pending_block_copies)
        except RuntimeError:
            return False
        return True


def free_request_blocks(kv: KvCacheManager, r: LlmRequest) -> None:
    """Drop every block table of `r` (one per live beam) and its pending copies."""
    free_beams(kv, r.request_id, r.num_live_beams)
    r.pending_block_copies.clear()
    r.pending_kv_writes = None   # not written yet: a resumed request recomputes its tokens


def waiting_by_priority(requests: list[LlmRequest]) -> list[LlmRequest]:
    """The requests waiting for blocks (new or paused), higher priority first, FIFO among equals."""
    return sorted((r for r in requests if r.state == RequestState.WAITING), key=lambda r: -r.spec.priority)


def _reusable_tokens(r: LlmRequest) -> list[int]:
    """Tokens whose cached KV `r` may reuse: none when it wants the logits of its whole prompt, or
    when it resumes several beams (each recomputes its own sequence)."""
    return [] if r.spec.return_context_logits or r.num_live_beams > 1 else r.reuse_token_slice(0, r.num_tokens)


class GuaranteedNoEvictScheduler(CapacityScheduler):
    pass


class StaticBatchScheduler(CapacityScheduler):
    """GUARANTEED_NO_EVICT that admits new requests only once the previous batch has finished;
    with `max_num_tokens`, a batch's prompts also fit one context step (V1's lockstep batches)."""

    def __init__(self, kv_cache_manager: KvCacheManager, max_num_requests: int, max_num_tokens: int | None = None,
                 peft_cache: PeftCache | None = None):
        super().__init__(kv_cache_manager, max_num_requests, peft_cache)
        self.max_num_tokens = max_num_tokens

    def can_admit(self, running: list[LlmRequest]) -> bool:
        return not running

    def schedule(self, requests: list[LlmRequest], in_flight: frozenset[LlmRequest] = frozenset()) -> CapacityOutput:
        if self.max_num_tokens is None or any(r.holds_blocks for r in requests):
            return super().schedule(requests, in_flight)
        budget, admissible = self.max_num_tokens, []
        for r in waiting_by_priority(requests):
            if admissible and r.num_tokens_with_drafts > budget:
                break
            budget -= r.num_tokens_with_drafts
            admissible.append(r)
        return super().schedule(admissible, in_flight)


class MaxUtilizationScheduler(CapacityScheduler):
    """Admit what fits now, by priority. Running requests grow highest priority first (oldest
    first among equals); when one needs a block and none is free, pause the lowest-priority
    request, the most recently started among equals (free its blocks; it resumes later by
    recomputing its tokens, or by reusing them when block reuse is on)."""

    reserves_worst_case = False   # a block taken early could pause another request

    def schedule(self, requests: list[LlmRequest], in_flight: frozenset[LlmRequest] = frozenset()) -> CapacityOutput:
        running = sorted((r for r in requests if r.holds_blocks and r not in in_flight),
                         key=lambda r: (-r.spec.priority, r.start_index))
        out = CapacityOutput()
        num_holding = sum(1 for r in requests if r.holds_blocks)
        while running:
            r = running.pop(0)
            while not self._grow(r):
                victim = running.pop() if running else r
                self.release(victim)
                victim.pause()
                num_holding -= 1
                out.paused.append(victim)
                if victim is r:
                    break
            if r.holds_blocks:
                out.fitting.append(r)
        if out.paused:  # memory is short: admit nothing new this iteration
            return out
        for r in waiting_by_priority(requests):
            prefix = self.kv.find_cached_prefix(_reusable_tokens(r))
            cost = (r.num_live_beams * self.kv.blocks_for_tokens(r.num_tokens_with_drafts) - len(prefix)
                    + sum(1 for b in prefix if self.kv.is_free(b)))
            if num_holding >= self.max_num_requests or cost > self.kv.num_free_blocks or \
                    not self._can_start_adapter(r):
                break
            if not self._start(r):
                continue
            num_holding += 1
            ok = self._grow(r)
            assert ok, f"request {r.request_id}: blocks counted free were not"
            out.fitting.append(r)
        return out


def make_capacity_scheduler(policy: SchedulerPolicy, kv_cache_manager: KvCacheManager, max_num_requests: int,
                            static_max_num_tokens: int | None = None,
                            peft_cache: PeftCache | None = None) -> CapacityScheduler:
    if policy == SchedulerPolicy.MAX_UTILIZATION:
        return MaxUtilizationScheduler(kv_cache_manager, max_num_requests, peft_cache)
    if policy == SchedulerPolicy.STATIC_BATCH:
        return StaticBatchScheduler(kv_cache_manager, max_num_requests, static_max_num_tokens, peft_cache)
    if policy == SchedulerPolicy.GUARANTEED_NO_EVICT:
        return GuaranteedNoEvictScheduler(kv_cache_manager, max_num_requests, peft_cache)
    raise ValueError(f"scheduler policy: unknown {policy!r}")
