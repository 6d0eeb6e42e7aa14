"""End-to-end Executor tests on the tiny checkpoint: the bindings' usage loop gives GptManager's and
transformers' tokens; cancellation, timeouts, concurrent producers, priorities, stats, errors."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from datetime import timedelta

import pytest
import torch

from batch_manager import KvCacheConfig as CoreKvCacheConfig
from batch_manager.executor import (FinishReason, KvCacheConfig, LogitsPostProcessorConfig, OutputConfig,
                                    QueueFullError, Request, RequestStage, SamplingConfig)
from tests.batch_manager.conftest import NUM_NEW_TOKENS, wait_until
from tests.batch_manager.executor.helpers import beam_tensors, collect, executor_for, final_tokens, gpt_manager_tokens

POOL = 400   # KV tokens: room for every request of a test at once


def beam_request(prompt, width: int, streaming: bool, max_tokens: int = NUM_NEW_TOKENS) -> Request:
    return Request(prompt, max_tokens, streaming=streaming, sampling_config=SamplingConfig(beam_width=width))


def kv_is_whole(executor) -> bool:
    kv = executor.kv_cache_manager    # the block pool is whole again
    return kv.num_free_blocks == kv.num_blocks and executor.get_bookkeeping_counts()["active"] == 0


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("beam_width", [1, 4])
def test_the_bindings_usage_loop_gives_gpt_managers_tokens(tiny_engine, prompts, references, streaming, beam_width):
    engine_dir, _ = tiny_engine
    chosen = [prompts[i] for i in range(6)]
    with executor_for(engine_dir, max_beam_width=4, kv_cache_config=KvCacheConfig(max_tokens=POOL)) as executor:
        ids = executor.enqueue_requests([beam_request(p, beam_width, streaming) for p in chosen])
        responses = collect(executor, ids)
        assert kv_is_whole(executor)
    got = [final_tokens(responses[i], streaming) for i in ids]
    expected = gpt_manager_tokens(engine_dir, [(p, NUM_NEW_TOKENS, beam_tensors(beam_width)) for p in chosen],
                                  streaming, 4, CoreKvCacheConfig(max_tokens=POOL))
    assert got == expected
    if beam_width == 1:
        for i, tokens in enumerate(got):
            assert (tokens[0] if streaming else tokens[0][len(chosen[i]):]) == references[i][len(chosen[i]):]
    finals = [r.result for i in ids for r in responses[i] if r.result.is_final]
    assert all(len(f.finish_reasons) == beam_width for f in finals)
    assert all(reason == FinishReason.LENGTH for f in finals for reason in f.finish_reasons)


def test_beam_widths_1_and_4_in_flight_together(tiny_engine, prompts):
    engine_dir, _ = tiny_engine
    widths = [1, 4, 1, 4]
    with executor_for(engine_dir, max_beam_width=4, kv_cache_config=KvCacheConfig(max_tokens=POOL)) as executor:
        ids = executor.enqueue_requests([beam_request(prompts[i], w, False) for i, w in enumerate(widths)])
        responses = collect(executor, ids)
    expected = gpt_manager_tokens(engine_dir, [(prompts[i], NUM_NEW_TOKENS, beam_tensors(w)) for i, w in enumerate(widths)],
                                  False, 4, CoreKvCacheConfig(max_tokens=POOL))
    assert [final_tokens(responses[i], False) for i in ids] == expected


def test_output_config_log_probs_logits_and_excluded_input(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    output = OutputConfig(return_log_probs=True, return_context_logits=True, return_generation_logits=True,
                          exclude_input_from_output=True)
    with executor_for(engine_dir) as executor:
        rid = executor.enqueue_request(Request(prompts[0], NUM_NEW_TOKENS, output_config=output))
        [response] = collect(executor, [rid])[rid]
    result = response.result
    assert result.output_token_ids == [references[0][len(prompts[0]):]]
    assert result.log_probs.shape == (1, NUM_NEW_TOKENS) and result.cum_log_probs.shape == (1,)
    assert float(result.cum_log_probs[0]) == pytest.approx(float(result.log_probs.sum()), abs=1e-4)
    assert result.context_logits.shape == (len(prompts[0]), 128)
    assert result.generation_logits.shape == (1, NUM_NEW_TOKENS, 128)
    assert result.generation_logits[0].argmax(-1).tolist() == result.output_token_ids[0]


def test_return_all_generated_tokens_streams_the_whole_sequence_each_time(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    with executor_for(engine_dir) as executor:
        rid = executor.enqueue_request(Request(prompts[1], NUM_NEW_TOKENS, streaming=True,
                                               return_all_generated_tokens=True))
        results = [r.result for r in collect(executor, [rid])[rid]]
    generated = references[1][len(prompts[1]):]
    for result in results:
        assert result.output_token_ids[0] == generated[:len(result.output_token_ids[0])]
    assert results[-1].output_token_ids == [generated]


def test_cancel_mid_stream_ends_with_what_it_has(tiny_engine, prompts):
    engine_dir, _ = tiny_engine
    with executor_for(engine_dir) as executor:
        rid = executor.enqueue_request(Request(prompts[2], 40, streaming=True))
        first = executor.await_responses(rid, timeout=timedelta(seconds=30))
        assert first and not first[0].result.is_final
        executor.cancel_request(rid)
        rest = collect(executor, [rid])[rid]
        assert rest[-1].result.is_final and rest[-1].result.finish_reasons == [FinishReason.CANCELLED]
        num_tokens = sum(len(r.result.output_token_ids[0]) for r in first + rest)
        assert 1 <= num_tokens < 40
        assert wait_until(lambda: kv_is_whole(executor))


def test_cancel_a_queued_request_answers_it_at_once(tiny_engine, prompts):
    engine_dir, _ = tiny_engine
    with executor_for(engine_dir, max_batch_size=1) as executor:   # one request at a time: the next waits
        running = executor.enqueue_request(Request(prompts[3], 40, streaming=True))
        assert executor.await_responses(running, timeout=30)
        queued = executor.enqueue_request(Request(prompts[4], 8))
        executor.cancel_request(queued)
        [response] = executor.await_responses(queued, timeout=0)
        assert response.result.is_final and response.result.finish_reasons == [FinishReason.CANCELLED]
        assert response.result.output_token_ids == [prompts[4]]
        executor.cancel_request(running)
        collect(executor, [running])


def test_timeouts_return_empty_lists(tiny_engine, prompts):
    engine_dir, _ = tiny_engine
    with executor_for(engine_dir) as executor:
        start = time.monotonic()
        assert executor.await_responses(timeout=timedelta(milliseconds=50)) == []
        assert time.monotonic() - start >= 0.05
        rid = executor.enqueue_request(Request(prompts[5], 30))
        assert executor.await_responses(rid, timeout=0) == []
        assert executor.await_responses([rid], timeout=timedelta(0)) == [[]]
        assert executor.get_num_responses_ready(rid) == 0
        collect(executor, [rid])


def test_concurrent_producers_while_a_consumer_awaits(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    prompt_of: dict[int, int] = {}
    lock = threading.Lock()
    with executor_for(engine_dir, kv_cache_config=KvCacheConfig(max_tokens=POOL)) as executor:
        def produce(first: int) -> None:
            for i in range(first, first + 5):
                rid = executor.enqueue_request(Request(prompts[i], NUM_NEW_TOKENS, streaming=i % 2 == 0))
                with lock:
                    prompt_of[rid] = i
                time.sleep(0.001)

        producers = [threading.Thread(target=produce, args=(k * 5,)) for k in range(4)]
        for t in producers:
            t.start()
        seen: dict[int, list] = {}
        deadline = time.monotonic() + 120
        while len([rs for rs in seen.values() if rs[-1].result.is_final]) < 20:
            assert time.monotonic() < deadline
            for response in executor.await_responses(timeout=timedelta(milliseconds=50)):
                seen.setdefault(response.request_id, []).append(response)
        for t in producers:
            t.join()
    assert sorted(seen) == sorted(prompt_of)
    for rid, responses in seen.items():
        i = prompt_of[rid]
        tokens = final_tokens(responses, streaming=i % 2 == 0)[0]
        assert tokens == (references[i][len(prompts[i]):] if i % 2 == 0 else references[i])


def test_priority_orders_admission_under_a_full_pool(tiny_engine, prompts):
    engine_dir, _ = tiny_engine
    prompt = prompts[0][:20] + [5] * (20 - len(prompts[0][:20]))
    # 48 tokens of KV: one request of 20 + 28 tokens holds the pool; the others wait in the scheduler.
    with executor_for(engine_dir, kv_cache_config=KvCacheConfig(max_tokens=48)) as executor:
        blocker = executor.enqueue_request(Request(prompt, 28, streaming=True))
        assert executor.await_responses(blocker, timeout=30)
        priority_of = {executor.enqueue_request(Request(prompt, 28, priority=p)): p for p in (0.1, 0.5, 0.9, 0.5)}
        finals = []
        pending = set(priority_of) | {blocker}
        while pending:
            for response in executor.await_responses(timeout=1):
                if response.result.is_final:
                    finals.append(response.request_id)
                    pending.discard(response.request_id)
    assert finals[0] == blocker
    assert [priority_of[rid] for rid in finals[1:]] == [0.9, 0.5, 0.5, 0.1]
    assert finals[2] < finals[3]           # FIFO among equals


def test_iteration_stats_ring_keeps_the_newest(tiny_engine, prompts):
    engine_dir, _ = tiny_engine
    with executor_for(engine_dir, iter_stats_max_iterations=3) as executor:
        rid = executor.enqueue_request(Request(prompts[6], NUM_NEW_TOKENS))
        collect(executor, [rid])
        stats = executor.get_latest_iteration_stats()
        assert executor.get_latest_iteration_stats() == []
    assert len(stats) == 3
    counters = [s.iteration for s in stats]
    assert counters == list(range(counters[0], counters[0] + 3)) and counters[-1] >= NUM_NEW_TOKENS
    parsed = json.loads(stats[-1].to_json_str())
    assert parsed["Iteration Counter"] == counters[-1] and parsed["Active Request Count"] == 0
    assert {"Used KV cache blocks", "Reused KV cache blocks", "Generation Requests"} <= set(parsed)


def test_request_stats_follow_a_request(tiny_engine, prompts):
    engine_dir, _ = tiny_engine
    prompt = prompts[7]
    with executor_for(engine_dir, request_stats_max_iterations=100, max_batch_size=1) as executor:
        first, second = executor.enqueue_requests([Request(prompt, 4), Request(prompts[8], 2)])
        collect(executor, [first, second])
        per_iteration = executor.get_latest_request_stats()
    by_id = {}
    for it in per_iteration:
        for s in it.request_stats:
            by_id.setdefault(s.id, []).append(s)
    stages = [(s.stage, s.context_prefill_position, s.num_generated_tokens, s.scheduled, s.paused)
              for s in by_id[first]]
    n = len(prompt)
    assert stages == [(RequestStage.GENERATION, n, 1, True, False), (RequestStage.GENERATION, n + 1, 2, True, False),
                      (RequestStage.GENERATION, n + 2, 3, True, False), (RequestStage.FINISHED, n + 3, 4, True, False)]
    assert [s.stage for s in by_id[second]][:4] == [RequestStage.QUEUED] * 4
    assert by_id[second][-1].stage == RequestStage.FINISHED
    assert all(s.num_reused_blocks == 0 for s in by_id[first])
    parsed = json.loads(per_iteration[0].to_json_str())
    assert set(parsed["request_stats"][0]) == {"id", "stage", "context_prefill_position", "num_generated_tokens",
                                                "scheduled", "paused", "num_reused_blocks"}


def test_bad_input_raises_at_enqueue_and_nothing_is_queued(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    bad = [(Request(prompts[0], 4, sampling_config=SamplingConfig(top_k=-1)), "sampling_config.top_k"),
           (Request([1, 500], 4), "input_token_ids"), (Request(prompts[0]), "max_tokens"),
           (Request(prompts[0], 4, priority=1.5), "priority"), (Request(prompts[0], 0), "max_tokens"),
           (Request(prompts[0], 4, sampling_config=SamplingConfig(beam_width=3)), "sampling_config.beam_width"),
           (Request(prompts[0], 4, bad_words=[[1, 999]]), "bad_words"),
           (Request(prompts[0], 4, logits_post_processor_name="nope"), "logits_post_processor_name"),
           (Request(torch.tensor([True, True, False]), 4), "input_token_ids: expected a 1-D integer tensor, got "
                                                           "torch.bool")]
    with executor_for(engine_dir) as executor:
        for request, field in bad:
            with pytest.raises(ValueError, match=field):
                executor.enqueue_request(request)
        with pytest.raises(ValueError, match="sampling_config.temperature"):
            executor.enqueue_requests([Request(prompts[0], 4),
                                       Request(prompts[0], 4, sampling_config=SamplingConfig(temperature=-1.0))])
        assert executor.front_end.num_pending == 0 and executor.get_num_responses_ready() == 0
        rid = executor.enqueue_request(Request(prompts[0], NUM_NEW_TOKENS, max_new_tokens=NUM_NEW_TOKENS))
        responses = collect(executor, [rid])
    assert list(responses) == [rid]
    assert final_tokens(responses[rid], False) == [references[0]]


def test_enqueue_after_shutdown_and_into_a_full_queue_raise(tiny_engine, prompts):
    engine_dir, _ = tiny_engine
    executor = executor_for(engine_dir, max_batch_size=1, max_queue_size=2)
    running = executor.enqueue_request(Request(prompts[0], 40, streaming=True))
    assert executor.await_responses(running, timeout=30)
    waiting = executor.enqueue_requests([Request(prompts[1], 2), Request(prompts[2], 2)])
    with pytest.raises(QueueFullError, match="max_queue_size=2"):
        executor.enqueue_request(Request(prompts[3], 2))
    assert executor.can_enqueue_requests()
    executor.shutdown()                      # drains: every queued request is answered
    executor.shutdown()
    assert not executor.can_enqueue_requests()
    with pytest.raises(RuntimeError, match="shut down"):
        executor.enqueue_request(Request(prompts[0], 2))
    responses = collect(executor, [running, *waiting], timeout_s=5)
    assert all(rs[-1].result.is_final and not rs[-1].has_error() for rs in responses.values())


def test_awaiting_an_unknown_id_returns_an_error_response(tiny_engine, prompts):
    engine_dir, _ = tiny_engine
    with executor_for(engine_dir) as executor:
        [response] = executor.await_responses(12345, timeout=1)
        assert response.has_error() and "unknown" in response.error_msg and response.request_id == 12345
        rid = executor.enqueue_request(Request(prompts[0], 2))
        collect(executor, [rid])
        [again] = executor.await_responses(rid)          # its final was handed over already
        assert again.has_error()


def test_generate_async_yields_results_and_cancelling_the_task_cancels_the_request(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    with executor_for(engine_dir) as executor:
        async def tokens_of(request):
            return [t for result in [r async for r in executor.generate_async(request)] for t in result.output_token_ids[0]]

        assert asyncio.run(tokens_of(Request(prompts[9], NUM_NEW_TOKENS, streaming=True))) == \
            references[9][len(prompts[9]):]

        started = threading.Event()

        async def consume():
            async for _ in executor.generate_async(Request(prompts[10], 60, streaming=True)):
                started.set()

        async def cancel_after_first():
            task = asyncio.ensure_future(consume())
            while not started.is_set():
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(cancel_after_first())
        assert wait_until(lambda: kv_is_whole(executor))
        assert wait_until(lambda: not executor.front_end.responses.known_ids)
        assert executor.get_num_responses_ready() == 0


def test_named_logits_post_processor_sees_the_client_id(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    seen = []
    banned = references[11][len(prompts[11])]    # the greedy first token

    def ban(request_id, logits, token_ids, stream, client_id):
        seen.append(client_id)
        logits[:, banned] = float("-inf")

    config = LogitsPostProcessorConfig(processor_map={"ban": ban})
    with executor_for(engine_dir, logits_post_processor_config=config) as executor:
        rid = executor.enqueue_request(Request(prompts[11], 3, logits_post_processor_name="ban", client_id=77))
        [response] = collect(executor, [rid])[rid]
    assert response.client_id == 77 and set(seen) == {77} and len(seen) == 3
    assert banned not in response.result.output_token_ids[0][len(prompts[11]):]
