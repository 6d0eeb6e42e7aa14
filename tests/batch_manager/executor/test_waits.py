"""The Executor's waits without a model: the timeout check, and the response store's and the KV
event buffer's waits (claims, finals returned once, shutdown wakes every wait)."""
from __future__ import annotations

import math
import threading
from datetime import timedelta

import pytest

from batch_manager.executor.kv_events import KvEventBuffer
from batch_manager.executor.queues import ResponseStore
from batch_manager.executor.request import FinishReason, Response, Result
from batch_manager.executor.waits import timeout_seconds
from tests.batch_manager.conftest import wait_until


def response(request_id: int, is_final: bool) -> Response:
    reason = FinishReason.LENGTH if is_final else FinishReason.NOT_FINISHED
    return Response(request_id, Result(is_final=is_final, output_token_ids=[[1]], finish_reasons=[reason]))


def store_with(*request_ids: int) -> ResponseStore:
    store = ResponseStore()
    for request_id in request_ids:
        store.register(request_id)
    return store


class Waiter:
    """`call()` on a daemon thread; `result` once it returns."""

    def __init__(self, call):
        self.result, self.done = None, threading.Event()
        threading.Thread(target=self._run, args=(call,), daemon=True).start()

    def _run(self, call) -> None:
        self.result = call()
        self.done.set()


def is_claimed(store: ResponseStore, request_id: int) -> bool:
    return store.num_id_waits(request_id) > 0   # a per-id wait has begun


@pytest.mark.parametrize("timeout, seconds", [(None, None), (0, 0.0), (2, 2.0), (0.25, 0.25),
                                              (timedelta(milliseconds=5), 0.005), (10 ** 12, 1e12)])
def test_good_timeouts(timeout, seconds):
    assert timeout_seconds(timeout) == seconds


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -math.inf, -1, -0.5, timedelta(seconds=-1), True, False,
                                     "1", [1], 10 ** 400])
def test_bad_timeouts_are_value_errors_naming_timeout(timeout):
    with pytest.raises(ValueError, match=r"^timeout: "):
        timeout_seconds(timeout)


def test_a_wait_by_id_has_first_claim_over_a_wait_for_any():
    store = store_with(1, 2)
    by_id = Waiter(lambda: store.await_ids([1], None))
    any_id = Waiter(lambda: store.await_any(None))
    assert wait_until(lambda: is_claimed(store, 1))
    store.push(response(1, True), True)
    assert by_id.done.wait(10) and [r.request_id for r in by_id.result[0]] == [1]
    assert not any_id.done.wait(0.05)          # id 1 was not its to take
    store.push(response(2, True), True)
    assert any_id.done.wait(10) and [r.request_id for r in any_id.result] == [2]
    assert store.num_ready() == 0


def test_a_final_returned_by_one_wait_answers_the_other_waits_for_its_id_at_once():
    store = store_with(1)
    first, second = Waiter(lambda: store.await_ids([1], None)), Waiter(lambda: store.await_ids([1], None))
    assert wait_until(lambda: store.num_id_waits(1) == 2)
    store.push(response(1, True), True)
    assert first.done.wait(10) and second.done.wait(10)
    [[a]], [[b]] = first.result, second.result
    assert sorted([a.has_error(), b.has_error()]) == [False, True]   # each response to exactly one call
    error = a if a.has_error() else b
    assert "unknown" in error.error_msg and error.request_id == 1


def test_close_wakes_every_wait_and_later_waits_do_not_wait():
    store, events = store_with(1), KvEventBuffer(4)
    waiters = [Waiter(lambda: store.await_any(None)), Waiter(lambda: store.await_ids([1], None)),
               Waiter(lambda: events.get_latest(None))]
    assert wait_until(lambda: is_claimed(store, 1))
    store.close()
    events.close()
    assert all(w.done.wait(10) for w in waiters)
    assert [w.result for w in waiters] == [[], [[]], []]
    assert store.await_any(None) == [] and store.await_ids([1], None) == [[]] and events.get_latest(None) == []
    events.removed([b"\x01"])                     # what is ready is still returned
    assert [e.block_hashes for e in events.get_latest(None)] == [(1,)]


def test_abandoning_an_id_after_its_final_arrived_forgets_it():
    store = store_with(1, 2)
    store.push(response(1, False), False)
    store.push(response(1, True), True)
    store.abandon(1)                              # the final was among the dropped responses
    [unknown] = store.await_ids([1], 30)[0]       # at once, not after 30 s
    assert unknown.has_error() and "unknown" in unknown.error_msg
    assert store.num_ready() == 0 and not store.known_ids - {2} and not store.abandoned_ids
    store.abandon(2)                              # before its final: unknown now, its final dropped later
    assert store.await_ids([2], 30)[0][0].has_error()
    store.push(response(2, True), True)
    assert store.num_ready() == 0 and not store.known_ids and not store.abandoned_ids
