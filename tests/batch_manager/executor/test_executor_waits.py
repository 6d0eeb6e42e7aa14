"""The Executor's waits on a tiny engine: shutdown wakes every wait and no wait outlives it, bad
timeouts are refused, and a request's id is unknown once its final was returned (also when
generate_async is left early)."""
from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from batch_manager.executor import KvCacheConfig, Request
from tests.batch_manager.conftest import wait_until
from tests.batch_manager.executor.helpers import collect, executor_for


def in_thread(call) -> tuple[threading.Thread, list]:
    """`call()` on a daemon thread; the list gets its result, or the exception it raised."""
    out: list = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_shutdown_wakes_every_wait_and_later_waits_return_at_once(tiny_engine, prompts):
    engine_dir, _ = tiny_engine
    executor = executor_for(engine_dir, kv_cache_config=KvCacheConfig(event_buffer_max_size=64))
    rid = executor.enqueue_request(Request(prompts[0], 2))
    collect(executor, [rid])
    executor.get_latest_kv_cache_events(timeout=0)
    waits = [in_thread(executor.await_responses), in_thread(executor.get_latest_kv_cache_events)]
    time.sleep(0.1)                                # both are waiting: nothing is ready
    assert all(thread.is_alive() for thread, _ in waits)
    executor.shutdown()
    for thread, _ in waits:
        thread.join(10)
        assert not thread.is_alive()
    assert [out for _, out in waits] == [[[]], [[]]]
    start = time.monotonic()
    assert executor.await_responses() == [] and executor.get_latest_kv_cache_events() == []
    [unknown] = executor.await_responses(rid)
    assert unknown.has_error() and time.monotonic() - start < 5


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1.0, True, "0.1"])
def test_bad_timeouts_raise_value_errors_naming_timeout(tiny_engine, timeout):
    config = KvCacheConfig(event_buffer_max_size=8)
    with executor_for(tiny_engine[0], kv_cache_config=config) as executor:
        for call in (lambda: executor.await_responses(timeout=timeout), lambda: executor.await_responses(1, timeout),
                     lambda: executor.get_latest_kv_cache_events(timeout)):
            thread, out = in_thread(call)    # a thread: a wait that never ends fails the test, not the run
            thread.join(10)
            assert not thread.is_alive() and isinstance(out[0], ValueError) and str(out[0]).startswith("timeout: ")


def test_leaving_generate_async_after_its_final_arrived_forgets_the_id(tiny_engine, prompts):
    engine_dir, _ = tiny_engine
    with executor_for(engine_dir) as executor:
        store = executor.front_end.responses       # internal: to know that the final has arrived

        async def first_result_then_leave() -> None:
            async for _ in executor.generate_async(Request(prompts[1], 3, streaming=True)):
                assert wait_until(lambda: any(r.result.is_final for q in store._responses.values() for r in q))
                break

        asyncio.run(first_result_then_leave())
        request_id = 1                             # a fresh executor's first request
        start = time.monotonic()
        [unknown] = executor.await_responses(request_id, timeout=30)
        assert unknown.has_error() and "unknown" in unknown.error_msg
        assert time.monotonic() - start < 5
        assert not store.known_ids and not store.abandoned_ids and executor.get_num_responses_ready() == 0


def test_an_idle_executor_blocks_until_a_request_arrives(tiny_engine, monkeypatch):
    """Nothing to do: the worker blocks (a fetch per IDLE_BLOCK_S, not one per 0.5 ms); an
    enqueue wakes it at once."""
    from batch_manager.executor import front_end
    fetches: list[tuple[float, int]] = []   # (when, requests fetched)
    fetch = front_end.ExecutorFrontEnd.fetch

    def counted(self, max_num_requests):
        fetched = fetch(self, max_num_requests)
        fetches.append((time.monotonic(), len(fetched.requests)))
        return fetched

    monkeypatch.setattr(front_end.ExecutorFrontEnd, "fetch", counted)
    # A long block: a wake-up by the enqueue is then told from the block's end by seconds, not ms.
    monkeypatch.setattr(front_end, "IDLE_BLOCK_S", 30.0)
    engine_dir, _ = tiny_engine
    with executor_for(engine_dir) as executor:
        time.sleep(0.3)
        start = time.monotonic()
        time.sleep(1.0)
        idle = [t for t, _ in fetches if t >= start]
        assert len(idle) <= (time.monotonic() - start) / front_end.IDLE_BLOCK_S + 2, len(idle)
        enqueued = time.monotonic()
        request_id = executor.enqueue_request(Request([5, 9, 17], 4))
        (response,) = collect(executor, [request_id])[request_id]
        assert not response.has_error()
        woke = min(t for t, n in fetches if n)
        print(f"woken {(woke - enqueued) * 1e3:.2f} ms after the enqueue")
        assert woke - enqueued < 10   # seconds, against the 30 s block
