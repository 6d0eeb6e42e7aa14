"""The seam of one step, data in and data out, no worker thread: the scheduler's ScheduledStep
(exact tokens, block tables, store fields) and its update from a StepResult; the model executor
as a pure function of a step on a tiny real model."""
from __future__ import annotations

import dataclasses

import torch

from batch_manager.scheduling.capacity_scheduler import GuaranteedNoEvictScheduler
from runtime.cache.kv_cache_manager import KvCacheManager
from batch_manager.scheduling.llm_request import LlmRequest, RequestState
from runtime.request import FinishReason, RequestSpec
from batch_manager.scheduling.micro_batch_scheduler import MicroBatchScheduler
from batch_manager.model_executor import ModelExecutor
from batch_manager.scheduling.scheduler import Scheduler
from batch_manager.scheduling.step import RequestResult, StepResult
from runtime import Engine, ModelRunner
from runtime.decoding import DecodeOutcome, DecodingParams
from runtime.request import BeamOutputs
from tests.batch_manager.conftest import NUM_NEW_TOKENS


def make_scheduler(num_blocks: int = 16, tokens_per_block: int = 4, max_num_tokens: int = 64,
                   chunked: bool = False) -> Scheduler:
    kv = KvCacheManager(num_blocks, tokens_per_block)
    return Scheduler(kv, GuaranteedNoEvictScheduler(kv, 8), MicroBatchScheduler(8, max_num_tokens, chunked))


def request(request_id: int, prompt: list[int], max_new_tokens: int = 4, beam_width: int = 1) -> LlmRequest:
    return LlmRequest(request_id, RequestSpec(prompt, max_new_tokens, DecodingParams(beam_width=beam_width)),
                      arrival_index=request_id)


def test_a_context_step_then_a_generation_step():
    scheduler = make_scheduler()
    scheduler.add(request(7, [5, 6, 7, 8, 9, 10]))
    step, num_paused = scheduler.schedule()
    assert num_paused == 0 and step.generation_requests == ()
    (r,) = step.context_requests
    assert (r.request_id, r.token_ids, r.past_length, r.block_tables) == (7, ((5, 6, 7, 8, 9, 10),), 0, ((0, 1),))
    assert r.is_last_chunk and r.new is not None and r.new.record.prompt == [5, 6, 7, 8, 9, 10]
    scheduler.update(step, StepResult((RequestResult(7, DecodeOutcome((11,), (-0.5,), cum_log_prob=-0.5)),)))
    state = scheduler.get(7)
    assert (state.generated, state.output.sequences[0].log_probs, state.num_computed_tokens, state.state) == \
        ([11], [-0.5], 6, RequestState.GENERATION)
    step, _ = scheduler.schedule()
    (r,) = step.generation_requests
    assert (r.token_ids, r.past_length, r.block_tables, r.new) == (((11,),), 6, ((0, 1),), None)


def test_a_chunked_context_decodes_only_after_its_last_chunk():
    scheduler = make_scheduler(max_num_tokens=4, chunked=True)
    scheduler.add(request(1, list(range(3, 13))))
    chunks = []
    for _ in range(3):
        step, _ = scheduler.schedule()
        (r,) = step.context_requests
        chunks.append((r.token_ids[0], r.past_length, r.is_last_chunk))
        outcome = DecodeOutcome((50,)) if r.is_last_chunk else None
        scheduler.update(step, StepResult((RequestResult(1, outcome),)))
    assert chunks == [((3, 4, 5, 6), 0, False), ((7, 8, 9, 10), 4, False), ((11, 12), 8, True)]
    assert scheduler.get(1).generated == [50] and scheduler.get(1).state == RequestState.GENERATION


def test_finished_requests_free_their_blocks_and_their_store_in_the_next_step():
    scheduler = make_scheduler()
    scheduler.add(request(1, [3, 4, 5]))
    scheduler.add(request(2, [6, 7]))
    step, _ = scheduler.schedule()
    scheduler.update(step, StepResult((RequestResult(1, DecodeOutcome((9,), finish_reason=FinishReason.END_ID)),
                                       RequestResult(2, error="boom"))))
    assert [r.output.finish_reason for r in (scheduler.get(1), scheduler.get(2))] == [FinishReason.END_ID, FinishReason.ERROR]
    done = scheduler.pop_finished()
    assert sorted(r.request_id for r in done) == [1, 2] and scheduler.num_active == 0
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    scheduler.add(request(3, [1]))
    step, _ = scheduler.schedule()
    assert sorted(step.released_request_ids) == [1, 2]
    assert scheduler.schedule()[0].released_request_ids == ()


def test_a_request_stopped_while_in_flight_keeps_its_blocks_until_its_result_is_applied():
    scheduler = make_scheduler()
    scheduler.add(request(1, [3, 4, 5]))
    step, _ = scheduler.schedule()
    scheduler.stop(1)
    assert scheduler.pop_finished(in_flight_ids=frozenset({1})) == []
    assert scheduler.kv.holds(1)
    scheduler.update(step, StepResult((RequestResult(1, DecodeOutcome((9,))),)))
    assert scheduler.get(1).generated == []            # stopped: the late token is not recorded
    assert [r.request_id for r in scheduler.pop_finished()] == [1] and not scheduler.kv.holds(1)


def test_beams_fork_their_tables_after_the_first_decode():
    scheduler = make_scheduler(num_blocks=32)
    scheduler.add(request(1, [3, 4, 5, 6, 7, 8], max_new_tokens=3, beam_width=2))
    step, _ = scheduler.schedule()
    beams = BeamOutputs(parents=(0, 0), live_tokens=((20,), (21,)), tokens=((20,), (21,)),
                        log_probs=((-0.1,), (-0.2,)), cum_log_probs=(-0.1, -0.2))
    scheduler.update(step, StepResult((RequestResult(1, DecodeOutcome(beams=beams)),)))
    r = scheduler.get(1)
    assert (r.num_live_beams, r.output.beams, r.generated) == (2, [[20], [21]], [20])
    step, _ = scheduler.schedule()
    (scheduled,) = step.generation_requests
    assert scheduled.token_ids == ((20,), (21,)) and scheduled.past_length == 6
    # Both beams share the full prompt block 0; beam 0 writes into a copy of the shared partial block.
    assert scheduled.block_tables == ((0, 2), (0, 1)) and scheduled.block_copies == ((1, 2),)


def test_the_executor_is_a_pure_function_of_the_step(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    engine = Engine.from_dir(engine_dir)
    scheduler = make_scheduler(num_blocks=64, max_num_tokens=128)
    for i in (0, 1):
        scheduler.add(request(i, prompts[i], max_new_tokens=NUM_NEW_TOKENS))
    executors = [ModelExecutor(ModelRunner(engine, 64)) for _ in range(2)]
    while scheduler.num_active:
        step, _ = scheduler.schedule()
        results = [executor.execute(step) for executor in executors]
        assert _tokens(results[0]) == _tokens(results[1])   # same step in, same result out
        scheduler.update(step, results[0])
        for r in scheduler.pop_finished():
            assert r.prompt + r.generated == references[r.request_id]
    step, _ = scheduler.schedule()
    for executor in executors:
        executor.execute(step)                               # frees the finished requests' stores
        assert len(executor.decoder) == 0


def test_a_fault_fails_only_its_forward_group(tiny_engine, prompts):
    engine_dir, _ = tiny_engine
    executor = ModelExecutor(ModelRunner(Engine.from_dir(engine_dir), 64))
    scheduler = make_scheduler(num_blocks=64, max_num_tokens=128)
    scheduler.separate_context_forward = True
    scheduler.add(request(0, prompts[0]))
    step, _ = scheduler.schedule()
    scheduler.update(step, executor.execute(step))
    scheduler.add(request(1, prompts[1]))
    step, _ = scheduler.schedule()
    assert [g[0].request_id for g in step.forward_groups] == [1, 0]

    def fault(group):
        if group[0].request_id == 1:
            raise RuntimeError("injected")
    executor.fault_injector = fault
    by_id = {r.request_id: r for r in executor.execute(step).results}
    assert "injected" in by_id[1].error and by_id[1].outcome is None
    assert by_id[0].error is None and len(by_id[0].outcome.tokens) == 1


def _tokens(result: StepResult) -> list:
    return [(r.request_id, r.error) if r.outcome is None else (r.request_id, r.outcome.tokens, r.outcome.finish_reason)
            for r in result.results]


def test_context_logits_come_back_for_the_whole_prompt(tiny_engine, prompts):
    engine_dir, model = tiny_engine
    executor = ModelExecutor(ModelRunner(Engine.from_dir(engine_dir), 64))
    scheduler = make_scheduler(num_blocks=64, max_num_tokens=128)
    r = request(0, prompts[3])
    r.spec = dataclasses.replace(r.spec, return_context_logits=True)
    scheduler.add(r)
    step, _ = scheduler.schedule()
    (result,) = executor.execute(step).results
    with torch.no_grad():
        expected = model(torch.tensor([prompts[3]])).logits[0]
    torch.testing.assert_close(result.context_logits, expected, rtol=1e-4, atol=1e-4)
