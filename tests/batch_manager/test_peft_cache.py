"""The PEFT cache's bookkeeping (plain Python, exact values) and the capacity scheduler's adapter
residency: requests wait for room, adapters in use are never evicted, idle ones leave LRU first."""
from __future__ import annotations

from batch_manager.scheduling.capacity_scheduler import GuaranteedNoEvictScheduler, MaxUtilizationScheduler
from batch_manager.scheduling.llm_request import LlmRequest, RequestState
from runtime.request import FinishReason, RequestSpec
from runtime.decoding import DecodingParams
from batch_manager.adapters.peft_cache import AdapterRef, PeftCache
from runtime.cache.kv_cache_manager import KvCacheManager


def ref(task_id: int, rows: int = 2, cost: int = 10, payload: str | None = "w") -> AdapterRef:
    return AdapterRef(task_id, None if payload is None else f"{payload}{task_id}", cost, rows)


def test_register_id_only_needs_a_cached_adapter():
    cache = PeftCache(host_capacity=100, device_capacity=4)
    assert cache.register(ref(1, payload=None)) == ("lora_task_id: 1 is not in the PEFT cache; send lora_weights "
                                                    "and lora_config with it")
    assert cache.register(ref(1)) is None and cache.register(ref(1, payload=None)) is None
    assert cache.num_cached == 1
    assert "needs 5 device cache rows; the cache has 4" in cache.register(ref(2, rows=5))
    assert "needs 101 of the host cache's 100" in cache.register(ref(3, cost=101))
    cache.check_invariants()


def test_device_residency_evicts_idle_adapters_lru_and_never_pinned_ones():
    cache = PeftCache(host_capacity=100, device_capacity=4)
    for t in (1, 2, 3):
        cache.register(ref(t))
    assert cache.acquire(1) and cache.acquire(2)
    assert cache.take_changes() == (((1, "w1"), (2, "w2")), ())
    assert not cache.can_acquire(3) and not cache.acquire(3)      # both pinned: 3 waits
    cache.release(1)
    assert cache.acquire(3)                                       # evicts idle 1, not running 2
    assert cache.take_changes() == (((3, "w3"),), (1,))
    assert cache.num_evictions == 1
    cache.release(2)
    cache.release(3)
    assert cache.acquire(1)                                       # 2 is the least recently used idle one
    assert cache.take_changes() == (((1, "w1"),), (2,))
    assert cache.acquire(3) and cache.take_changes() == ((), ())  # resident already: no load
    cache.check_invariants()


def test_host_trim_drops_idle_adapters_lru_first_and_keeps_those_in_use():
    cache = PeftCache(host_capacity=25, device_capacity=8)
    cache.register(ref(1))
    cache.register(ref(2))
    cache.acquire(1)
    cache.take_changes()
    cache.unregister(1)
    cache.release(1)
    cache.register(ref(3))                                        # 30 > 25: idle 1 leaves (2 is in use)
    assert [cache.is_cached(t) for t in (1, 2, 3)] == [False, True, True]
    assert cache.take_changes() == ((), (1,))                     # it was resident: the runtime drops it
    cache.register(ref(4))                                        # 2 and 3 in use: over capacity until they end
    assert cache.num_cached == 3
    cache.unregister(2)
    assert [cache.is_cached(t) for t in (2, 3, 4)] == [False, True, True]
    assert cache.instance(4) == 4 and cache.num_evictions == 2
    cache.check_invariants()


def make_request(request_id: int, task_id: int | None, prompt_len: int = 8) -> LlmRequest:
    lora = None if task_id is None else AdapterRef(task_id, f"w{task_id}", 10, 2)
    return LlmRequest(request_id, RequestSpec(list(range(1, prompt_len + 1)), 4, DecodingParams(), lora=lora))


def test_a_request_waits_until_its_adapter_can_be_resident():
    kv = KvCacheManager(64, 4)
    capacity = GuaranteedNoEvictScheduler(kv, 8, PeftCache(100, 2))
    requests = [make_request(0, 1), make_request(1, 2), make_request(2, None)]
    for r in requests:
        assert capacity.register(r) is None
    out = capacity.schedule(requests)
    assert [r.request_id for r in out.fitting] == [0]             # 1 waits for room; 2 keeps FIFO behind it
    assert capacity.take_adapter_changes() == (((1, "w1"),), ())
    requests[0].finish(FinishReason.LENGTH)
    capacity.end(requests[0])
    out = capacity.schedule(requests[1:])
    assert [r.request_id for r in out.fitting] == [1, 2]
    assert capacity.take_adapter_changes() == (((2, "w2"),), (1,))
    capacity.peft_cache.check_invariants()


def test_a_paused_request_unpins_its_adapter():
    kv = KvCacheManager(4, 4)
    capacity = MaxUtilizationScheduler(kv, 8, PeftCache(100, 4))
    a, b = make_request(0, 1, prompt_len=8), make_request(1, 2, prompt_len=8)
    for r in (a, b):
        capacity.register(r)
    assert [r.request_id for r in capacity.schedule([a, b]).fitting] == [0, 1]
    assert a.holds_adapter and b.holds_adapter
    a.output.beams[0] += [5] * 3          # a grows into a third block; b is paused for it
    a.num_computed_tokens, b.num_computed_tokens = 10, 8
    a.set_state(RequestState.GENERATION)
    b.set_state(RequestState.GENERATION)
    out = capacity.schedule([a, b])
    assert [r.request_id for r in out.paused] == [1] and not b.holds_adapter and a.holds_adapter
    assert capacity.peft_cache.can_acquire(2)
