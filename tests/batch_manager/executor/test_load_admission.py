"""Admission by load (API.md, "Admission"): the queue bounded in prompt tokens, the time-to-first-
token budget refused at once (QueueFullError with retry_after_s) once the context rate is
measured, allotted_time_ms ending a request TIMED_OUT; the predictor's pieces exactly."""
from __future__ import annotations

import threading
import time

import pytest

from batch_manager.executor import (Executor, ExecutorConfig, FinishReason, KvCacheConfig, LogitsPostProcessorConfig,
                                    ModelType, QueueFullError, Request)
from batch_manager.executor.queues import QueuedRequest, RequestQueue
from batch_manager.executor.ttft import ContextThroughput, PendingContext, predict_ttft_ms, ttft_refusal
from tests.batch_manager.executor.helpers import collect


def test_context_throughput_skips_the_first_step_and_warms_up():
    rate = ContextThroughput(window=3, min_steps=2, num_skipped=1)
    rate.observe(1000, 10.0)           # the cold first context step: not measured
    rate.observe(0, 1.0)               # no context tokens: not a context step
    assert rate.tokens_per_s is None
    rate.observe(100, 1.0)
    assert rate.tokens_per_s is None   # one measured step: still warming up
    rate.observe(300, 1.0)
    assert rate.tokens_per_s == 200.0
    rate.observe(600, 2.0)
    rate.observe(50, 0.5)              # the window keeps the last 3: (300, 1), (600, 2), (50, 0.5)
    assert rate.tokens_per_s == 950 / 3.5


def test_pending_context_counts_running_and_equal_or_higher_priority():
    pending = PendingContext()
    pending.add(1, 100, priority=0.2)
    pending.add(2, 40, priority=0.5)
    pending.add(3, 7, priority=0.9)
    pending.update(1, 30)              # admitted, 30 of its context left: ahead of everyone
    assert pending.num_tokens_ahead(0.5) == 30 + 40 + 7
    assert pending.num_tokens_ahead(0.95) == 30
    pending.remove(1)
    pending.remove(1)
    assert pending.num_tokens_ahead(0.0) == 47 and len(pending) == 2


def test_ttft_refusal_says_the_figures():
    rate = ContextThroughput(min_steps=1, num_skipped=0)
    assert ttft_refusal(1.0, 10_000, 10, rate) is None     # unmeasured: never refused
    rate.observe(1000, 1.0)
    assert predict_ttft_ms(900, 100, 1000.0) == 1000.0
    assert ttft_refusal(1000.0, 900, 100, rate) is None
    message, retry_after_s = ttft_refusal(400.0, 900, 100, rate)
    assert retry_after_s == pytest.approx(0.6)
    assert message == ("ttft_budget_ms: the predicted time to first token, 1000 ms (900 context tokens ahead and "
                       "100 of its own at 1000 context tokens/s), exceeds the budget of 400 ms")


class _Spec:
    def __init__(self, n: int):
        self.prompt, self.priority = [0] * n, 0.5


def test_request_queue_bounds_requests_and_prompt_tokens():
    queue = RequestQueue(max_size=3, max_num_tokens=10)
    queue.check_room([_Spec(6)])
    queue.push_all([QueuedRequest(1, _Spec(6))])
    with pytest.raises(QueueFullError, match=r"max_num_queued_tokens=10, 6 prompt tokens waiting, 5 more") as e:
        queue.check_room([_Spec(5)], tokens_per_s=2.0)
    assert e.value.retry_after_s == 0.5            # 1 token over at 2 tokens/s
    queue.check_room([_Spec(4)])
    assert [r.request_id for r in queue.pop(5)] == [1] and queue.num_tokens == 0
    queue.push_all([QueuedRequest(i, _Spec(1)) for i in range(3)])
    with pytest.raises(QueueFullError, match=r"max_queue_size=3, 3 waiting") as e:
        queue.check_room([_Spec(1)])
    assert e.value.retry_after_s is None            # no rate measured
    assert queue.remove(1) is not None and queue.num_tokens == 2


class _Gate:
    """A logits post-processor that holds the worker's step until released (and says it began)."""

    def __init__(self):
        self.began, self.release = threading.Event(), threading.Event()

    def __call__(self, request_id, logits, token_ids, stream, client_id):
        self.began.set()
        assert self.release.wait(30)


def _executor(engine_dir, gate: _Gate, **config) -> Executor:
    """One request at a time (max_batch_size 1): the others wait in the queue."""
    return Executor(engine_dir, ModelType.DECODER_ONLY, ExecutorConfig(
        max_batch_size=1, kv_cache_config=KvCacheConfig(max_tokens=600),
        logits_post_processor_config=LogitsPostProcessorConfig(processor_map={"gate": gate}), **config))


def test_queued_tokens_bound_refuses_with_retry_after(tiny_engine, prompts):
    gate = _Gate()
    with _executor(tiny_engine[0], gate, max_num_queued_tokens=30) as executor:
        try:
            held = executor.enqueue_request(Request(prompts[0], 2, logits_post_processor_name="gate"))
            assert gate.began.wait(30)                  # running; the next ones stay queued
            first = executor.enqueue_request(Request([5] * 20, 2))
            with pytest.raises(QueueFullError, match=r"max_num_queued_tokens=30, 20 prompt tokens waiting, 20 more"):
                executor.enqueue_request(Request([5] * 20, 2))
            with pytest.raises(ValueError, match=r"input_token_ids: 31 tokens, more than the executor's "
                                                 r"max_num_queued_tokens 30"):
                executor.enqueue_request(Request([5] * 31, 2))
            second = executor.enqueue_request(Request([5] * 10, 2))   # 30 in all: fits
        finally:
            gate.release.set()
        responses = collect(executor, [held, first, second])
    assert all(not r.has_error() for rs in responses.values() for r in rs)


def test_ttft_budget_refuses_at_once_once_the_rate_is_measured(tiny_engine, prompts):
    gate = _Gate()
    gate.release.set()
    with _executor(tiny_engine[0], gate) as executor:
        # unmeasured: a budget nobody could meet is still admitted (the warm-up rule)
        ids = [executor.enqueue_request(Request(prompts[1], 2, ttft_budget_ms=1e-6))]
        collect(executor, ids)
        ids = [executor.enqueue_request(Request(prompts[i], 2)) for i in range(2, 6)]   # measure the rate
        collect(executor, ids)
        rate = executor.front_end.throughput.tokens_per_s
        assert rate is not None and rate > 0
        gate.release.clear()
        gate.began.clear()
        try:
            held = executor.enqueue_request(Request(prompts[0], 2, logits_post_processor_name="gate"))
            assert gate.began.wait(30)
            waiting = executor.enqueue_request(Request([7] * 40, 2))
            started = time.monotonic()
            ahead = len(prompts[0]) + 40   # the running one has no first token yet
            with pytest.raises(QueueFullError, match=rf"ttft_budget_ms: the predicted time to first token, "
                                                     rf".* \({ahead} context tokens ahead and 6 of its own at "
                                                     r".*exceeds the budget of 1e-06 ms") as e:
                executor.enqueue_request(Request([9] * 6, 2, ttft_budget_ms=1e-6))
            assert time.monotonic() - started < 10       # at once, not after waiting (for the gate: forever)
            assert e.value.retry_after_s > 0
            with pytest.raises(QueueFullError, match=rf"\({len(prompts[0])} context tokens ahead and 6 of its own"):
                executor.enqueue_request(Request([9] * 6, 2, ttft_budget_ms=1e-6, priority=0.9))   # jumps the queue
            fits = executor.enqueue_request(Request([9] * 6, 2, ttft_budget_ms=1e9))
        finally:
            gate.release.set()
        responses = collect(executor, [held, waiting, fits])
    assert all(not r.has_error() for rs in responses.values() for r in rs)
    assert executor.get_bookkeeping_counts()["pending_context"] == 0


def test_ttft_budget_and_allotted_time_are_checked(tiny_engine, prompts):
    gate = _Gate()
    gate.release.set()
    with _executor(tiny_engine[0], gate) as executor:
        for field in ("ttft_budget_ms", "allotted_time_ms"):
            for value in (0, -1, True, "5", float("nan"), float("inf"), 10 ** 400):
                with pytest.raises(ValueError, match=f"{field}: expected a finite number of milliseconds > 0"):
                    executor.enqueue_request(Request(prompts[1], 2, **{field: value}))


def test_allotted_time_ends_running_and_queued_requests_timed_out(tiny_engine, prompts):
    gate = _Gate()
    with _executor(tiny_engine[0], gate) as executor:
        try:
            running = executor.enqueue_request(Request(prompts[0], 40, logits_post_processor_name="gate",
                                                       allotted_time_ms=100))
            assert gate.began.wait(30)
            queued = executor.enqueue_request(Request(prompts[1], 4, allotted_time_ms=50))
            time.sleep(0.2)
        finally:
            gate.release.set()
        responses = collect(executor, [running, queued])
        counts = executor.get_bookkeeping_counts()
    for request_id in (running, queued):
        final = responses[request_id][-1].result
        assert final.is_final and final.finish_reasons == [FinishReason.TIMED_OUT], request_id
    assert len(responses[running][-1].result.output_token_ids[0]) < len(prompts[0]) + 40
    assert counts["deadlines"] == 0 and counts["pending_context"] == 0


def test_a_non_streamed_request_leaves_the_pending_context_with_its_first_token(tiny_engine, prompts):
    """It answers only at its end: it once stayed counted as context ahead of every new request
    while it generated."""
    from tests.batch_manager.conftest import wait_until
    engine_dir, _ = tiny_engine
    with Executor(engine_dir, executor_config=ExecutorConfig()) as executor:
        pending = executor.front_end.pending_context
        request_id = executor.enqueue_request(Request(prompts[0], 60))
        # empty while the request still generates (before its answer, at its end)
        assert wait_until(lambda: len(pending) == 0 and executor.get_num_active_requests() == 1, timeout_s=30)
        (response,) = collect(executor, [request_id])[request_id]
        assert not response.has_error()
