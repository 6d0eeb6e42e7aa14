"""Capacity and micro-batch scheduling over plain LlmRequests (no model): exact admissions, block
ids and pauses; a hypothesis state machine checks the KV bookkeeping of each capacity policy."""
from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from batch_manager.scheduling.llm_request import LlmRequest, RequestState
from runtime.request import FinishReason, RequestSpec
from runtime.decoding import DecodingParams
from batch_manager.options import SchedulerPolicy
from batch_manager.scheduling.capacity_scheduler import (GuaranteedNoEvictScheduler, MaxUtilizationScheduler,
                                              StaticBatchScheduler, free_request_blocks, make_capacity_scheduler)
from batch_manager.scheduling.micro_batch_scheduler import MicroBatchScheduler
from runtime.cache.beam_blocks import beam_holder, fork_beams
from runtime.cache.kv_cache_manager import KvCacheManager

GENERATED_TOKEN = 7


def make_request(request_id: int, prompt_len: int = 2, max_new_tokens: int = 2) -> LlmRequest:
    return LlmRequest(request_id, RequestSpec(list(range(prompt_len)), max_new_tokens, DecodingParams()),
                      arrival_index=request_id)


def forward(r: LlmRequest) -> None:
    """What a model step does to a scheduled request: compute every token, append one."""
    r.num_computed_tokens = r.num_tokens
    r.generated.append(GENERATED_TOKEN)
    if len(r.generated) >= r.max_new_tokens:
        r.finish(FinishReason.LENGTH)
    elif r.state == RequestState.CONTEXT:
        r.set_state(RequestState.GENERATION)


def ids(requests: list[LlmRequest]) -> list[int]:
    return [r.request_id for r in requests]


def in_generation(request_id: int, num_generated: int = 1, prompt_len: int = 2) -> LlmRequest:
    r = make_request(request_id, prompt_len, max_new_tokens=num_generated + 4)
    r.set_state(RequestState.CONTEXT)
    r.set_state(RequestState.GENERATION)
    r.generated[:] = [GENERATED_TOKEN] * num_generated
    r.num_computed_tokens = r.num_tokens - 1
    return r


def in_context(request_id: int, prompt_len: int) -> LlmRequest:
    r = make_request(request_id, prompt_len)
    r.set_state(RequestState.CONTEXT)
    return r


# -- GUARANTEED_NO_EVICT ---------------------------------------------------------------------------

def test_guaranteed_no_evict_reserves_the_worst_case_and_keeps_fifo():
    kv = KvCacheManager(8, 4)
    scheduler = GuaranteedNoEvictScheduler(kv, max_num_requests=8)
    r1 = make_request(1, prompt_len=8, max_new_tokens=8)    # reserves 4 blocks, holds 2
    r2 = make_request(2, prompt_len=4, max_new_tokens=13)   # needs 5 blocks worst case; 1 now
    r3 = make_request(3, prompt_len=1, max_new_tokens=1)    # would fit, but is behind r2
    out = scheduler.schedule([r1, r2, r3])
    assert ids(out.fitting) == [1]
    assert out.paused == []
    assert kv.block_table(1) == [0, 1]
    assert (r1.state, r2.state, r3.state) == (RequestState.CONTEXT, RequestState.WAITING, RequestState.WAITING)
    assert not kv.holds(2) and not kv.holds(3)

    forward(r1)                                             # r1 still reserves its worst case
    out = scheduler.schedule([r1, r2, r3])
    assert ids(out.fitting) == [1]
    assert kv.block_table(1) == [0, 1, 2]
    assert r2.state == RequestState.WAITING and r3.state == RequestState.WAITING

    r1.finish(FinishReason.STOPPED)
    kv.free(1)                                              # free list: 3..7, 0, 1, 2
    out = scheduler.schedule([r2, r3])
    assert ids(out.fitting) == [2, 3]
    assert kv.block_table(2) == [3]
    assert kv.block_table(3) == [4]
    assert (r1.start_index, r2.start_index, r3.start_index) == (0, 1, 2)
    kv.check_invariants()


def test_guaranteed_no_evict_grows_a_running_request_block_by_block():
    kv = KvCacheManager(3, 2)
    scheduler = GuaranteedNoEvictScheduler(kv, max_num_requests=8)
    r1 = make_request(1, prompt_len=3, max_new_tokens=3)    # worst case 6 tokens = the whole pool
    r2 = make_request(2, prompt_len=1, max_new_tokens=1)
    tables = []
    while not r1.is_finished:
        out = scheduler.schedule([r for r in (r1, r2) if not r.is_finished])
        assert ids(out.fitting) == [1] and out.paused == []
        tables.append(list(kv.block_table(1)))
        forward(r1)
    assert tables == [[0, 1], [0, 1], [0, 1, 2]]
    assert r2.state == RequestState.WAITING
    kv.free(1)
    assert ids(scheduler.schedule([r2]).fitting) == [2]
    assert kv.block_table(2) == [0]


def test_guaranteed_no_evict_max_num_requests():
    kv = KvCacheManager(8, 4)
    scheduler = GuaranteedNoEvictScheduler(kv, max_num_requests=2)
    requests = [make_request(i, prompt_len=1, max_new_tokens=1) for i in range(3)]
    assert ids(scheduler.schedule(requests).fitting) == [0, 1]
    assert requests[2].state == RequestState.WAITING
    assert ids(scheduler.schedule(requests).fitting) == [0, 1]
    requests[0].finish(FinishReason.STOPPED)
    kv.free(0)
    assert ids(scheduler.schedule(requests[1:]).fitting) == [1, 2]


# -- MAX_UTILIZATION -------------------------------------------------------------------------------

def test_max_utilization_admits_what_fits_now_not_the_worst_case():
    r1, r2 = make_request(1, prompt_len=4, max_new_tokens=4), make_request(2, prompt_len=3, max_new_tokens=4)
    kv = KvCacheManager(4, 2)
    assert ids(MaxUtilizationScheduler(kv, max_num_requests=8).schedule([r1, r2]).fitting) == [1, 2]
    assert kv.block_table(1) == [0, 1]
    assert kv.block_table(2) == [2, 3]

    r1, r2 = make_request(1, prompt_len=4, max_new_tokens=4), make_request(2, prompt_len=3, max_new_tokens=4)
    assert ids(GuaranteedNoEvictScheduler(KvCacheManager(4, 2), max_num_requests=8).schedule([r1, r2]).fitting) \
        == [1]


def test_max_utilization_pauses_the_most_recently_started_request():
    kv = KvCacheManager(6, 2)
    scheduler = MaxUtilizationScheduler(kv, max_num_requests=8)
    r1, r2, r3 = (make_request(i, prompt_len=4, max_new_tokens=4) for i in (1, 2, 3))
    assert ids(scheduler.schedule([r1, r2, r3]).fitting) == [1, 2, 3]
    assert (kv.block_table(1), kv.block_table(2), kv.block_table(3)) == ([0, 1], [2, 3], [4, 5])
    for r in (r1, r2, r3):
        forward(r)                                          # 5 tokens each: a third block each
    out = scheduler.schedule([r1, r2, r3])
    assert ids(out.paused) == [3]
    assert ids(out.fitting) == [1, 2]
    assert kv.block_table(1) == [0, 1, 4]
    assert kv.block_table(2) == [2, 3, 5]
    assert not kv.holds(3)
    assert kv.num_allocated_new == 6 + 2             # cumulative
    assert r3.state == RequestState.WAITING
    assert r3.num_computed_tokens == 0
    assert r3.num_pauses == 1
    assert r3.generated == [GENERATED_TOKEN]
    assert (r1.num_pauses, r2.num_pauses) == (0, 0)
    kv.check_invariants()


def test_max_utilization_admits_nothing_new_while_pausing_then_resumes():
    kv = KvCacheManager(4, 2)
    scheduler = MaxUtilizationScheduler(kv, max_num_requests=8)
    r1, r2 = make_request(1, prompt_len=4, max_new_tokens=4), make_request(2, prompt_len=3, max_new_tokens=4)
    assert ids(scheduler.schedule([r1, r2]).fitting) == [1, 2]
    forward(r1)                                             # 5 tokens: needs a third block
    forward(r2)
    r3 = make_request(3, prompt_len=1, max_new_tokens=1)    # fits the block left after the pause
    out = scheduler.schedule([r1, r2, r3])
    assert ids(out.paused) == [2]
    assert ids(out.fitting) == [1]
    assert kv.block_table(1) == [0, 1, 2]
    assert kv.num_free_blocks == 1
    assert r3.state == RequestState.WAITING                 # nothing new in an iteration with pauses

    forward(r1)
    out = scheduler.schedule([r1, r2, r3])                  # r2 (2 blocks) does not fit; r3 waits behind it
    assert ids(out.fitting) == [1] and out.paused == []
    assert (r2.state, r3.state) == (RequestState.WAITING, RequestState.WAITING)

    r1.finish(FinishReason.STOPPED)
    kv.free(1)                                              # free list: 3, 0, 1, 2
    out = scheduler.schedule([r2, r3])
    assert ids(out.fitting) == [2, 3]
    assert r2.state == RequestState.CONTEXT
    assert r2.num_tokens_to_compute == 4                    # prompt 3 + 1 generated, recomputed
    assert r2.token_slice(0, 4) == [0, 1, 2, GENERATED_TOKEN]
    assert kv.block_table(2) == [3, 0]
    assert kv.block_table(3) == [1]
    assert (r2.start_index, r3.start_index) == (2, 3)
    kv.check_invariants()


def test_max_utilization_a_request_that_cannot_grow_and_started_last_pauses_itself():
    kv = KvCacheManager(4, 2)
    scheduler = MaxUtilizationScheduler(kv, max_num_requests=8)
    r1, r2 = make_request(1, prompt_len=3, max_new_tokens=4), make_request(2, prompt_len=4, max_new_tokens=4)
    scheduler.schedule([r1, r2])
    forward(r1)                                             # 4 tokens: still 2 blocks
    forward(r2)                                             # 5 tokens: needs a third
    out = scheduler.schedule([r1, r2])
    assert ids(out.fitting) == [1]
    assert ids(out.paused) == [2]
    assert kv.block_table(1) == [0, 1]
    assert kv.num_free_blocks == 2


def test_max_utilization_max_num_requests():
    kv = KvCacheManager(8, 4)
    scheduler = MaxUtilizationScheduler(kv, max_num_requests=2)
    requests = [make_request(i, prompt_len=1) for i in range(3)]
    assert ids(scheduler.schedule(requests).fitting) == [0, 1]
    assert requests[2].state == RequestState.WAITING


# -- STATIC_BATCH ----------------------------------------------------------------------------------

def test_static_batch_admits_only_when_nothing_runs():
    kv = KvCacheManager(8, 4)
    scheduler = StaticBatchScheduler(kv, max_num_requests=4)
    r1, r2, r3 = (make_request(i, prompt_len=2, max_new_tokens=2) for i in (1, 2, 3))
    assert ids(scheduler.schedule([r1, r2]).fitting) == [1, 2]
    forward(r1)
    forward(r2)
    assert ids(scheduler.schedule([r1, r2, r3]).fitting) == [1, 2]
    forward(r1)                                             # r1 finishes; r2 is still running
    kv.free(1)
    r2.generated.pop()                                      # keep r2 unfinished for one more step
    assert ids(scheduler.schedule([r2, r3]).fitting) == [2]
    assert r3.state == RequestState.WAITING
    r2.finish(FinishReason.STOPPED)
    kv.free(2)
    assert ids(scheduler.schedule([r3]).fitting) == [3]


@pytest.mark.parametrize("max_num_tokens, prompt_lens, admitted", [
    (10, [4, 5, 2], [0, 1]),        # 4 + 5 fit; + 2 = 11 does not
    (11, [4, 5, 2], [0, 1, 2]),
    (3, [4, 1], [0]),               # an oversize first prompt runs alone
    (None, [4, 5, 2], [0, 1, 2]),
])
def test_static_batch_max_num_tokens_limits_the_batch_prompts(max_num_tokens, prompt_lens, admitted):
    kv = KvCacheManager(16, 4)
    scheduler = StaticBatchScheduler(kv, max_num_requests=8, max_num_tokens=max_num_tokens)
    requests = [make_request(i, prompt_len=n) for i, n in enumerate(prompt_lens)]
    assert ids(scheduler.schedule(requests).fitting) == admitted


def test_static_batch_max_num_requests():
    scheduler = StaticBatchScheduler(KvCacheManager(8, 4), max_num_requests=2, max_num_tokens=100)
    assert ids(scheduler.schedule([make_request(i, prompt_len=1) for i in range(3)]).fitting) == [0, 1]


@pytest.mark.parametrize("policy, cls", [(SchedulerPolicy.MAX_UTILIZATION, MaxUtilizationScheduler),
                                         (SchedulerPolicy.GUARANTEED_NO_EVICT, GuaranteedNoEvictScheduler),
                                         (SchedulerPolicy.STATIC_BATCH, StaticBatchScheduler)])
def test_make_capacity_scheduler(policy, cls):
    scheduler = make_capacity_scheduler(policy, KvCacheManager(4, 4), 3)
    assert type(scheduler) is cls
    assert scheduler.max_num_requests == 3


def test_make_capacity_scheduler_rejects_an_unknown_policy():
    with pytest.raises(ValueError, match="unknown"):
        make_capacity_scheduler(7, KvCacheManager(4, 4), 3)


# -- micro-batch -----------------------------------------------------------------------------------

def test_micro_batch_generation_first_then_context_in_order():
    c1, g1, c2, g2 = in_context(1, 4), in_generation(2), in_context(3, 3), in_generation(4)
    batch = MicroBatchScheduler(max_batch_size=8, max_num_tokens=100).schedule([c1, g1, c2, g2])
    assert ids(batch.generation_requests) == [2, 4]
    assert ids(batch.context_requests) == [1, 3]
    assert batch.num_requests == 4
    assert batch.num_context_tokens == 7


def test_micro_batch_max_batch_size():
    c1, g1, g2, g3 = in_context(1, 4), in_generation(2), in_generation(3), in_generation(4)
    batch = MicroBatchScheduler(max_batch_size=2, max_num_tokens=100).schedule([c1, g1, g2, g3])
    assert ids(batch.generation_requests) == [2, 3]
    assert batch.context_requests == []
    batch = MicroBatchScheduler(max_batch_size=3, max_num_tokens=100).schedule([c1, g1, in_context(5, 2)])
    assert ids(batch.generation_requests) == [2]
    assert ids(batch.context_requests) == [1, 5]


def test_micro_batch_a_lowered_limit_still_runs_a_wider_beam_request_alone():
    """Overlap and pipeline micro-batches lower the limit to a share of the active requests: a
    beam request wider than the share runs alone instead of never (it hung the worker)."""
    beams, g2 = in_generation(1), in_generation(2)
    beams.num_live_beams = 2
    scheduler = MicroBatchScheduler(max_batch_size=4, max_num_tokens=100)
    assert ids(scheduler.schedule([beams], max_batch_size=1).generation_requests) == [1]
    assert ids(scheduler.schedule([beams, g2], max_batch_size=1).generation_requests) == [1]
    assert ids(scheduler.schedule([g2, beams], max_batch_size=1).generation_requests) == [2]
    wide = in_context(3, 4)
    wide.num_live_beams = 5   # wider than max_batch_size itself: never
    assert scheduler.schedule([wide], max_batch_size=1).num_requests == 0


def test_micro_batch_max_num_tokens():
    g1, g2, g3 = in_generation(1), in_generation(2), in_generation(3)
    batch = MicroBatchScheduler(max_batch_size=8, max_num_tokens=2).schedule([g1, g2, g3])
    assert ids(batch.generation_requests) == [1, 2]
    c1, c2 = in_context(4, 3), in_context(5, 3)
    batch = MicroBatchScheduler(max_batch_size=8, max_num_tokens=5).schedule([c1, g1, g2, c2])
    assert ids(batch.generation_requests) == [1, 2]
    assert ids(batch.context_requests) == [4]               # 2 + 3 = 5 tokens; c2 would make 8
    assert batch.num_context_tokens == 3


def test_micro_batch_counts_only_uncomputed_context_tokens():
    resumed = in_context(1, 6)
    resumed.num_computed_tokens = 4                         # a chunk already in the cache
    batch = MicroBatchScheduler(max_batch_size=8, max_num_tokens=3).schedule([resumed, in_context(2, 1)])
    assert ids(batch.context_requests) == [1, 2]
    assert batch.num_context_tokens == 3


def test_micro_batch_oversize_context_runs_alone_only_when_the_batch_is_empty():
    scheduler = MicroBatchScheduler(max_batch_size=8, max_num_tokens=4)
    big, small = in_context(1, 10), in_context(2, 1)
    batch = scheduler.schedule([big, small])
    assert ids(batch.context_requests) == [1]
    assert batch.generation_requests == []
    batch = scheduler.schedule([big, in_generation(3)])
    assert ids(batch.generation_requests) == [3]
    assert batch.context_requests == []


def test_micro_batch_skips_waiting_and_finished_requests():
    waiting, done = make_request(1), in_context(2, 2)
    done.finish(FinishReason.STOPPED)
    batch = MicroBatchScheduler(max_batch_size=8, max_num_tokens=100).schedule([waiting, done])
    assert batch.num_requests == 0


# -- state machine ---------------------------------------------------------------------------------

NUM_BLOCKS, TOKENS_PER_BLOCK, MAX_NUM_REQUESTS = 6, 2, 4


class CapacityMachine(RuleBasedStateMachine):
    """Random arrivals, steps (whole or chunked contexts) and stops against one capacity scheduler
    and a small pool, optionally with prefix reuse, a window, or beam search (beams forked at
    random after each step, copy-on-write before each write). Block contents are simulated: a
    token written into a shared or released block, or a reused prefix of other tokens, fails."""
    policy: SchedulerPolicy
    reuse = False
    max_beam_width = 1
    window: int | None = None
    sink = 0
    num_blocks, tokens_per_block = NUM_BLOCKS, TOKENS_PER_BLOCK

    def __init__(self):
        super().__init__()
        self.kv = KvCacheManager(self.num_blocks, self.tokens_per_block, enable_block_reuse=self.reuse,
                                 attention_window=self.window, sink_token_length=self.sink)
        self.scheduler = make_capacity_scheduler(self.policy, self.kv, MAX_NUM_REQUESTS)
        self.active: list[LlmRequest] = []   # admission order
        self.next_id = 0
        self.content: dict[int, list] = {}   # block -> simulated token of each slot
        self.tokens_seen: dict[int, list[int]] = {}   # request id -> its tokens at the last check

    @rule(data=st.data())
    def add_request(self, data):   # prompt + max_new_tokens <= the pool
        half = self.num_blocks * self.tokens_per_block // 2
        prompt = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=half))
        max_new_tokens = data.draw(st.integers(1, half))
        beam_width = data.draw(st.integers(1, self.max_beam_width)) if self.max_beam_width > 1 else 1

        def request() -> LlmRequest:
            spec = RequestSpec(list(prompt), max_new_tokens, DecodingParams(beam_width=beam_width))
            return LlmRequest(self.next_id, spec, arrival_index=self.next_id)
        r = request()
        # As admission refuses a request that cannot fit the pool alone.
        while beam_width > 1 and self.scheduler.worst_case_blocks(r) > self.num_blocks:
            max_new_tokens -= 1
            if max_new_tokens == 0:
                prompt, max_new_tokens = prompt[:1], 1
            r = request()
        self.active.append(r)
        self.next_id += 1

    def _forward(self, r: LlmRequest, max_step_tokens: int, data) -> None:
        """A (possibly chunked) model step: make the block copies the scheduler asked for, write
        the KV of the step's tokens into every live beam's table, then as `forward`; a beam
        request then forks its beams at random (beam b continues old beam parents[b])."""
        n = r.num_tokens_to_compute if r.num_live_beams > 1 else min(r.num_tokens_to_compute, max_step_tokens)
        for src, dst in r.pending_block_copies:
            self.content[dst] = list(self.content.get(src, [None] * self.tokens_per_block))
        r.pending_block_copies.clear()
        start, tpb = r.num_computed_tokens, self.tokens_per_block
        for beam in range(r.num_live_beams):
            table = self.kv.block_table(beam_holder(r.request_id, beam))
            for pos in range(start, start + n):
                b = table[pos // tpb]
                assert b >= 0 and self.kv.ref_count(b) == 1, "a write into a shared or released block"
                self.content.setdefault(b, [None] * tpb)[pos % tpb] = r.token_slice(pos, pos + 1)[0]
        if n < r.num_tokens_to_compute:
            r.num_computed_tokens += n
        else:
            forward(r)
            if r.spec.num_sequences > 1 and not r.is_finished:
                parents = data.draw(st.lists(st.integers(0, r.num_live_beams - 1), min_size=r.spec.num_sequences,
                                             max_size=r.spec.num_sequences))
                fork_beams(self.kv, r.request_id, r.num_live_beams, parents)
                r.num_live_beams = r.spec.num_sequences
        self.kv.store_computed_blocks(r.request_id, r.token_slice(self.kv.num_stored_tokens(r.request_id),
                                                                  r.num_computed_tokens), r.num_computed_tokens)

    @rule(max_step_tokens=st.sampled_from([1, 3, 100]), data=st.data())
    def step(self, max_step_tokens, data):
        if not self.active:
            return
        running_before = {r.request_id for r in self.active if r.holds_blocks}
        generated_before = {r.request_id: list(r.generated) for r in self.active}
        out = self.scheduler.schedule(list(self.active))
        assert out.fitting, "no progress with requests active"
        assert len(out.fitting) <= MAX_NUM_REQUESTS
        if self.policy != SchedulerPolicy.MAX_UTILIZATION:
            assert out.paused == []
            self._check_promise()
        if self.policy == SchedulerPolicy.STATIC_BATCH and running_before:
            assert {r.request_id for r in out.fitting} == running_before
        for r in out.paused:
            assert r.state == RequestState.WAITING and r.num_computed_tokens == 0
            assert not self.kv.holds(r.request_id)
            assert r.generated == generated_before[r.request_id]
        for r in out.fitting:
            assert r.holds_blocks
            table = self.kv.block_table(r.request_id)
            assert len(table) >= self.kv.blocks_for_tokens(r.num_tokens)
            tpb = self.tokens_per_block
            for j in range(r.num_computed_tokens // tpb):   # a reused prefix holds its tokens
                if table[j] >= 0 and r.request_id not in running_before:
                    assert self.content[table[j]] == r.token_slice(j * tpb, (j + 1) * tpb)
            self._forward(r, max_step_tokens, data)
            if r.is_finished:
                free_request_blocks(self.kv, r)
                self.active.remove(r)

    def _check_promise(self):
        """GUARANTEED_NO_EVICT: what the running requests may still need is free (shared blocks
        in reserve under a window), and none holds more than its worst case."""
        running = [r for r in self.active if r.holds_blocks]
        missing = 0
        for r in running:
            worst, held = self.scheduler.worst_case_blocks(r), len(self._blocks_of(r))
            assert held <= worst
            missing += worst - held
        reserve = self.kv.num_extra_refs if self.window is not None else 0
        assert self.kv.num_free_blocks - missing >= reserve
        if not self.reuse and self.window is None:
            assert sum(self.kv.blocks_for_tokens(r.max_num_tokens) for r in running) <= self.num_blocks

    @rule(data=st.data())
    def stop(self, data):
        if not self.active:
            return
        r = data.draw(st.sampled_from(self.active))
        r.finish(FinishReason.STOPPED)
        free_request_blocks(self.kv, r)
        self.active.remove(r)

    def _blocks_of(self, r: LlmRequest) -> set[int]:
        """Distinct blocks held by any beam of `r`."""
        return {b for beam in range(r.num_live_beams) for b in self.kv.block_table(beam_holder(r.request_id, beam))
                if b >= 0}

    @invariant()
    def blocks_are_consistent(self):
        self.kv.check_invariants()
        holders = {r.request_id for r in self.active if r.holds_blocks}
        assert {i for i in range(self.next_id) if self.kv.holds(i)} == holders
        assert all(self.kv.ref_count(b) >= 0 for b in range(self.kv.num_blocks))
        assert self.kv.num_free_blocks + self.kv.num_used_blocks == self.kv.num_blocks
        owners: dict[int, set[int]] = {}
        for r in self.active:
            assert not any(self.kv.holds((r.request_id, b)) for b in range(r.num_live_beams, self.max_beam_width + 1))
            if not r.holds_blocks:
                assert not any(self.kv.holds(beam_holder(r.request_id, b)) for b in range(self.max_beam_width))
            for b in self._blocks_of(r):
                owners.setdefault(b, set()).add(r.request_id)
        for b, request_ids in owners.items():   # shared between requests only through the prefix cache
            assert len(request_ids) == 1 or self.kv.is_cached(b), f"block {b} owned twice"
        for r in self.active:   # tokens only ever grow, whatever pauses and resumes happened
            tokens = r.token_slice(0, r.num_tokens)
            seen = self.tokens_seen.get(r.request_id, [])
            assert tokens[:len(seen)] == seen, "a request lost tokens"
            self.tokens_seen[r.request_id] = tokens
        for r in self.active:
            assert len(self.kv.block_table(r.request_id)) >= self.kv.blocks_for_tokens(r.num_computed_tokens)
            if not r.holds_blocks:
                assert r.num_computed_tokens == 0
            if self.policy != SchedulerPolicy.MAX_UTILIZATION:
                assert r.num_pauses == 0


STATEFUL_SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])


def _machine_for(policy: SchedulerPolicy, **features):
    name = "".join(f"_{k}" for k, v in features.items() if v)
    machine = type(f"CapacityMachine_{policy.name}{name}", (CapacityMachine,), {"policy": policy, **features})
    machine.TestCase.settings = STATEFUL_SETTINGS
    return machine.TestCase


TestMaxUtilizationMachine = _machine_for(SchedulerPolicy.MAX_UTILIZATION)
TestGuaranteedNoEvictMachine = _machine_for(SchedulerPolicy.GUARANTEED_NO_EVICT)
TestStaticBatchMachine = _machine_for(SchedulerPolicy.STATIC_BATCH)
TestMaxUtilizationReuseMachine = _machine_for(SchedulerPolicy.MAX_UTILIZATION, reuse=True)
TestGuaranteedNoEvictReuseMachine = _machine_for(SchedulerPolicy.GUARANTEED_NO_EVICT, reuse=True)
TestStaticBatchReuseMachine = _machine_for(SchedulerPolicy.STATIC_BATCH, reuse=True)
TestMaxUtilizationWindowMachine = _machine_for(SchedulerPolicy.MAX_UTILIZATION, reuse=True, window=3, sink=1)
TestGuaranteedNoEvictWindowMachine = _machine_for(SchedulerPolicy.GUARANTEED_NO_EVICT, reuse=True, window=3, sink=1)
TestGuaranteedNoEvictWindowOnlyMachine = _machine_for(SchedulerPolicy.GUARANTEED_NO_EVICT, window=2)
# One-token blocks and a short window: shared blocks are released while still shared.
TestGuaranteedNoEvictTightWindowMachine = _machine_for(SchedulerPolicy.GUARANTEED_NO_EVICT, reuse=True, window=2,
                                                       sink=1, num_blocks=8, tokens_per_block=1)
TestMaxUtilizationTightWindowMachine = _machine_for(SchedulerPolicy.MAX_UTILIZATION, reuse=True, window=2,
                                                    sink=1, num_blocks=8, tokens_per_block=1)
# Beam search: beams forked at random after each step over shared tables, copy-on-write.
TestMaxUtilizationBeamMachine = _machine_for(SchedulerPolicy.MAX_UTILIZATION, max_beam_width=3, num_blocks=12)
TestGuaranteedNoEvictBeamMachine = _machine_for(SchedulerPolicy.GUARANTEED_NO_EVICT, max_beam_width=3, num_blocks=12)
TestStaticBatchBeamMachine = _machine_for(SchedulerPolicy.STATIC_BATCH, max_beam_width=3, num_blocks=12)
TestMaxUtilizationBeamReuseMachine = _machine_for(SchedulerPolicy.MAX_UTILIZATION, reuse=True, max_beam_width=3,
                                                  num_blocks=12)
TestGuaranteedNoEvictBeamReuseMachine = _machine_for(SchedulerPolicy.GUARANTEED_NO_EVICT, reuse=True,
                                                     max_beam_width=3, num_blocks=12)
