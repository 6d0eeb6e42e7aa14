"""Request priority in the capacity stage (plain LlmRequests, no model): admission higher first and
FIFO among equals, MAX_UTILIZATION pauses the lowest priority (newest first), the other policies
never preempt. Exact ids and block tables."""
from __future__ import annotations

from batch_manager.scheduling.capacity_scheduler import (GuaranteedNoEvictScheduler, MaxUtilizationScheduler,
                                              StaticBatchScheduler)
from runtime.cache.kv_cache_manager import KvCacheManager
from batch_manager.scheduling.llm_request import LlmRequest, RequestState
from runtime.request import FinishReason, RequestSpec
from runtime.decoding import DecodingParams


def make_request(request_id: int, priority: float, prompt_len: int = 2, max_new_tokens: int = 2) -> LlmRequest:
    return LlmRequest(request_id, RequestSpec(list(range(prompt_len)), max_new_tokens, DecodingParams(),
                                              priority=priority), arrival_index=request_id)


def forward(r: LlmRequest) -> None:
    r.num_computed_tokens = r.num_tokens
    r.generated.append(7)
    if len(r.generated) >= r.max_new_tokens:
        r.finish(FinishReason.LENGTH)
    elif r.state == RequestState.CONTEXT:
        r.set_state(RequestState.GENERATION)


def ids(requests) -> list[int]:
    return [r.request_id for r in requests]


def test_guaranteed_no_evict_admits_higher_priority_first_and_fifo_among_equals():
    kv = KvCacheManager(8, 4)
    requests = [make_request(1, 0.5, 8, 8), make_request(2, 0.9, 8, 8), make_request(3, 0.5, 8, 8),
                make_request(4, 0.9, 8, 8)]          # worst case 4 blocks each: two fit
    out = GuaranteedNoEvictScheduler(kv, max_num_requests=8).schedule(requests)
    assert ids(out.fitting) == [2, 4]
    assert (kv.block_table(2), kv.block_table(4)) == ([0, 1], [2, 3])
    assert [r.state for r in requests] == [RequestState.WAITING, RequestState.CONTEXT, RequestState.WAITING,
                                           RequestState.CONTEXT]
    kv.check_invariants()


def test_guaranteed_no_evict_never_skips_the_highest_priority_and_never_preempts():
    kv = KvCacheManager(8, 4)
    scheduler = GuaranteedNoEvictScheduler(kv, max_num_requests=8)
    low = make_request(0, 0.0, 4, 20)                 # worst case 6 blocks
    assert ids(scheduler.schedule([low]).fitting) == [0]
    high, small = make_request(1, 1.0, 8, 8), make_request(2, 0.1, 1, 1)   # 4 blocks do not fit; 1 would
    out = scheduler.schedule([low, high, small])
    assert ids(out.fitting) == [0] and out.paused == []
    assert (high.state, small.state) == (RequestState.WAITING, RequestState.WAITING)
    assert kv.block_table(0) == [0]


def test_max_utilization_pauses_the_lowest_priority_newest_first():
    kv = KvCacheManager(8, 2)
    scheduler = MaxUtilizationScheduler(kv, max_num_requests=8)
    r1, r2, r3, r4 = (make_request(i, p, 4, 4) for i, p in ((1, 0.5), (2, 0.1), (3, 0.5), (4, 0.1)))
    out = scheduler.schedule([r1, r2, r3, r4])
    assert ids(out.fitting) == [1, 3, 2, 4]
    assert [kv.block_table(i) for i in (1, 3, 2, 4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    for r in (r1, r2, r3, r4):
        forward(r)                                    # 5 tokens each: a third block each
    out = scheduler.schedule([r1, r2, r3, r4])
    assert ids(out.paused) == [4, 2]                  # lowest priority; the newest of the two first
    assert ids(out.fitting) == [1, 3]
    assert (kv.block_table(1), kv.block_table(3)) == ([0, 1, 6], [2, 3, 7])
    assert (r2.num_pauses, r4.num_pauses, r1.num_pauses, r3.num_pauses) == (1, 1, 0, 0)
    kv.check_invariants()


def test_max_utilization_with_equal_priorities_pauses_the_most_recently_started():
    kv = KvCacheManager(6, 2)
    scheduler = MaxUtilizationScheduler(kv, max_num_requests=8)
    requests = [make_request(i, 0.5, 4, 4) for i in (1, 2, 3)]
    scheduler.schedule(requests)
    for r in requests:
        forward(r)
    assert ids(scheduler.schedule(requests).paused) == [3]


def test_max_utilization_admits_by_priority():
    kv = KvCacheManager(4, 2)
    low, high = make_request(1, 0.2, 6, 2), make_request(2, 0.8, 4, 2)    # 3 blocks, 2 blocks
    out = MaxUtilizationScheduler(kv, max_num_requests=8).schedule([low, high])
    assert ids(out.fitting) == [2]
    assert kv.block_table(2) == [0, 1]
    assert low.state == RequestState.WAITING


def test_static_batch_fills_its_token_budget_by_priority():
    kv = KvCacheManager(16, 4)
    requests = [make_request(1, 0.5, 6, 1), make_request(2, 0.9, 6, 1), make_request(3, 0.9, 4, 1)]
    out = StaticBatchScheduler(kv, max_num_requests=8, max_num_tokens=10).schedule(requests)
    assert ids(out.fitting) == [2, 3]
    assert requests[0].state == RequestState.WAITING
    # A running batch is never preempted, whatever waits.
    urgent = make_request(4, 1.0, 2, 1)
    out = StaticBatchScheduler(kv, max_num_requests=8).schedule([requests[1], requests[2], urgent])
    assert ids(out.fitting) == [2, 3] and out.paused == []
    assert urgent.state == RequestState.WAITING
