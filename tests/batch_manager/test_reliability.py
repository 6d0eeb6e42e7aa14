"""The worker survives hostile callbacks, queues what exceeds max_num_sequences, drops items that
are not requests, and after an internal crash answers every later request with the error."""
from __future__ import annotations

import json
import logging

import pytest

from batch_manager import (GptManager, InferenceRequest, SchedulerPolicy, TrtGptModelOptionalParams,
                           TrtGptModelType, tensor_names)
from batch_manager.scheduling.scheduler import Scheduler
from tests.batch_manager.conftest import Client, make_request, wait_until


def manager_for(engine_dir, client: Client, get=None, poll=None, **kwargs) -> GptManager:
    _, send, poll_stop, stats = client.callbacks()
    return GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                      get or client.get, send, poll or poll_stop, stats, **kwargs)


def assert_reference(client: Client, request_id: int, reference: list[int]) -> None:
    tensors, final, err = client.final(request_id)
    assert err == "" and tensors[tensor_names.OUTPUT_IDS][0, 0].tolist() == reference


def test_a_get_callback_whose_iterable_raises_keeps_what_it_yielded(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    client = Client([make_request(i, prompts[i]) for i in range(3)])
    calls = []

    def get(n):
        calls.append(n)
        if len(calls) == 1:
            def broken():
                yield client.pending.pop(0)
                raise RuntimeError("broken generator")
            return broken()
        if len(calls) == 2:
            return 42   # not iterable
        return iter(client.get(n))

    with manager_for(engine_dir, client, get=get) as manager:
        client.wait()
        assert manager.is_running and manager.fatal_error is None
    for i in range(3):
        assert_reference(client, i, references[i])


def test_a_stop_callback_whose_iterable_raises_is_contained(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    client = Client([make_request(i, prompts[i]) for i in range(3)], [0, 2, 4])

    def poll():
        def broken():
            yield 12345
            raise RuntimeError("broken stop generator")
        return broken()

    with manager_for(engine_dir, client, poll=poll) as manager:
        client.wait()
        assert manager.is_running
    for i in range(3):
        assert_reference(client, i, references[i])


@pytest.mark.parametrize("terminate_req_id", [None, 10000])
def test_items_that_are_not_requests_are_logged_and_dropped(tiny_engine, prompts, references, caplog,
                                                            terminate_req_id):
    engine_dir, _ = tiny_engine
    client = Client([make_request(0, prompts[0])])
    junk = [None, object(), "request", 7]

    def get(n):
        items = client.get(n)
        return junk + items if items else []

    with caplog.at_level(logging.WARNING, logger="batch_manager.worker"):
        with manager_for(engine_dir, client, get=get, terminate_req_id=terminate_req_id) as manager:
            client.wait()
            assert manager.is_running
    assert_reference(client, 0, references[0])
    assert set(client.responses) == {0}
    for name in ("NoneType", "object", "str", "int"):
        assert f"returned a {name}, not an InferenceRequest" in caplog.text


def test_requests_beyond_max_num_sequences_are_queued_and_admitted_later(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    client = Client([make_request(i, prompts[i]) for i in range(7)])
    asked = []

    def greedy_get(n):   # ignores the number it is asked for
        asked.append(n)
        with client.lock:
            items, client.pending = client.pending, []
        return items

    params = TrtGptModelOptionalParams(max_num_sequences=2)
    with manager_for(engine_dir, client, get=greedy_get, optional_params=params) as manager:
        client.wait()
    for i in range(7):
        assert_reference(client, i, references[i])
    stats = [json.loads(s) for s in client.stats]
    assert max(s["Active Request Count"] for s in stats) == 2
    assert asked[0] == 2 and all(n >= 0 for n in asked)
    # While 7 were held (2 active + 5 queued), the callback was asked for none.
    assert 0 in asked


def test_a_crashed_worker_fails_its_requests_and_answers_later_ones(tiny_engine, prompts, monkeypatch):
    engine_dir, _ = tiny_engine
    client = Client([make_request(0, prompts[0])])
    client.num_expected = 2

    def crash(self, *args, **kwargs):
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(Scheduler, "schedule", crash)
    manager = manager_for(engine_dir, client)
    try:
        assert wait_until(lambda: 0 in client.responses)
        assert wait_until(lambda: not manager.is_running)
        assert "scheduler bug" in manager.fatal_error
        tensors, final, err = client.final(0)
        assert tensors == {} and "scheduler bug" in err
        with client.lock:
            client.pending.append(make_request(1, prompts[1]))
            client.arrival_calls.append(0)
        client.wait()
        tensors, final, err = client.final(1)
        assert tensors == {} and final and "scheduler bug" in err
        assert manager.get_num_active_requests() == 0
    finally:
        manager.shutdown()
    assert not manager.is_running


def test_is_running_turns_false_after_shutdown(tiny_engine):
    engine_dir, _ = tiny_engine
    client = Client([])
    manager = manager_for(engine_dir, client)
    assert manager.is_running and manager.fatal_error is None
    manager.shutdown()
    assert not manager.is_running and manager.fatal_error is None


def test_a_request_with_a_bad_id_is_answered_under_its_id(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    client = Client([InferenceRequest(-5), make_request(0, prompts[0])])
    client.pending[0].input_ids = make_request(0, prompts[0]).input_ids
    with manager_for(engine_dir, client, terminate_req_id=10000):
        client.wait()
    assert "request_id" in client.final(-5)[2]
    assert_reference(client, 0, references[0])
