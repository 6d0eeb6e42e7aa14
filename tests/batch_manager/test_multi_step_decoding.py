"""Multi-step decoding (DecodingConfig.max_decode_steps): the scheduler gives a step of plain-greedy
generation requests several steps in one call, taking their blocks ahead only where the policy
reserves them, and one step otherwise; through the Executor and GptManager the tokens and log
probs equal one step per iteration (and transformers' greedy tokens), with end ids, stop words,
streaming, a sampled request in the batch and a request arriving mid-run."""
from __future__ import annotations

import pytest
import torch

from batch_manager import (GptManager, KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType,
                           tensor_names)
from batch_manager.executor import (DecodingConfig, Executor, ExecutorConfig, ModelType, OutputConfig, Request,
                                    SamplingConfig, SchedulerConfig)
from batch_manager.scheduling.capacity_scheduler import GuaranteedNoEvictScheduler, MaxUtilizationScheduler
from batch_manager.scheduling.llm_request import LlmRequest
from batch_manager.scheduling.micro_batch_scheduler import MicroBatchScheduler
from batch_manager.scheduling.scheduler import Scheduler
from batch_manager.request_decoder import RequestDecoder
from batch_manager.scheduling.step import NewRequest, RequestResult, ScheduledRequest, StepResult
from runtime import GreedySteps
from runtime.kernels.interface import NO_TOKEN
from runtime.cache.kv_cache_manager import KvCacheManager
from runtime.decoding import DecodeOutcome, DecodingParams
from runtime.request import FinishReason, RequestSpec
from tests.batch_manager.conftest import NUM_NEW_TOKENS, Client, make_request
from tests.batch_manager.executor.helpers import collect, final_tokens

# -- the scheduler: data in, data out --------------------------------------------------------------


def scheduler(capacity=GuaranteedNoEvictScheduler, num_blocks: int = 16) -> Scheduler:
    kv = KvCacheManager(num_blocks, 4)
    return Scheduler(kv, capacity(kv, 8), MicroBatchScheduler(8, 64))


def generating(s: Scheduler, request_id: int, prompt: list[int], max_new_tokens: int,
               params: DecodingParams = DecodingParams()) -> None:
    """Admit a request and run its context step (first token 40)."""
    s.add(LlmRequest(request_id, RequestSpec(prompt, max_new_tokens, params), arrival_index=request_id))
    step, _ = s.schedule()
    s.update(step, StepResult(tuple(RequestResult(r.request_id, DecodeOutcome((40,))) for r in step.requests)))


def test_plain_greedy_generation_runs_several_steps_on_blocks_taken_ahead():
    s = scheduler()
    generating(s, 1, [1, 2, 3], max_new_tokens=10)
    assert s.kv.block_table(1) == [0]
    step, _ = s.schedule(max_decode_steps=8)
    (r,) = step.generation_requests
    # past 3 + 8 steps: positions 3..10, blocks taken for 11 tokens now
    assert (r.num_decode_steps, r.token_ids, r.past_length, r.block_tables) == (8, ((40,),), 3, ((0, 1, 2),))
    s.update(step, StepResult((RequestResult(1, DecodeOutcome(tuple(range(50, 58)), num_accepted_drafts=7)),)))
    req = s.get(1)
    assert (len(req.generated), req.num_computed_tokens, req.num_tokens) == (9, 11, 12)
    step, _ = s.schedule(max_decode_steps=8)    # one token left to generate
    assert step.generation_requests[0].num_decode_steps == 1
    s.kv.check_invariants()


def test_an_end_mid_call_finishes_the_request_and_frees_its_blocks():
    s = scheduler()
    generating(s, 1, [1, 2, 3], max_new_tokens=10)
    step, _ = s.schedule(max_decode_steps=4)
    outcome = DecodeOutcome((50,), num_accepted_drafts=1, finish_reason=FinishReason.END_ID)
    s.update(step, StepResult((RequestResult(1, outcome),)))
    (done,) = s.pop_finished()
    assert done.generated == [40, 50] and done.output.finish_reason == FinishReason.END_ID
    assert s.kv.num_free_blocks == 16
    s.kv.check_invariants()


def test_max_utilization_stays_within_the_blocks_held():
    s = scheduler(MaxUtilizationScheduler)
    generating(s, 1, [1, 2, 3, 4, 5, 6], max_new_tokens=10)   # 7 tokens in 2 blocks: room for 2 steps
    step, _ = s.schedule(max_decode_steps=8)
    assert (step.generation_requests[0].num_decode_steps, s.kv.block_table(1)) == (2, [0, 1])


@pytest.mark.parametrize("case", ["sampled", "penalty", "stop_words_ok", "one_step", "left_out", "context"])
def test_one_step_unless_every_active_request_is_plain_greedy(case):
    s = scheduler(num_blocks=32)
    generating(s, 1, [1, 2, 3], max_new_tokens=10)
    params = {"sampled": DecodingParams(top_k=5), "penalty": DecodingParams(repetition_penalty=1.2),
              "stop_words_ok": DecodingParams(stop_words=((7, 8),))}.get(case, DecodingParams())
    generating(s, 2, [4, 5, 6], max_new_tokens=10, params=params)
    if case == "context":   # a new request's context step joins the batch
        s.add(LlmRequest(3, RequestSpec([9, 9], 4, DecodingParams()), arrival_index=3))
    if case == "left_out":  # a request the step does not run (its grammar compiles, say) waits
        s.micro_batch = MicroBatchScheduler(1, 64)
    step, _ = s.schedule(max_decode_steps=1 if case == "one_step" else 8)
    expected = 8 if case == "stop_words_ok" else 1   # stop words are checked after the picks
    assert {r.num_decode_steps for r in step.generation_requests} == {expected}


def test_the_steps_are_bounded_by_every_request():
    s = scheduler(num_blocks=32)
    generating(s, 1, [1, 2, 3], max_new_tokens=10)
    generating(s, 2, [4, 5, 6], max_new_tokens=4)     # 3 tokens left
    step, _ = s.schedule(max_decode_steps=8)
    assert [r.num_decode_steps for r in step.generation_requests] == [3, 3]


# -- end to end ------------------------------------------------------------------------------------

def executor_config(max_decode_steps: int, **overrides) -> ExecutorConfig:
    values = dict(kv_cache_config=KvCacheConfig(max_tokens=400),
                  decoding_config=DecodingConfig(max_decode_steps=max_decode_steps), iter_stats_max_iterations=1000)
    values.update(overrides)
    return ExecutorConfig(**values)


def run(engine_dir, requests: list[Request], max_decode_steps: int, streaming: bool, late: Request | None = None,
        **overrides):
    """-> (per request: tokens, log probs), and (the iterations that ran a step, their generation
    tokens, whether some iteration ran several steps)."""
    with Executor(engine_dir, ModelType.DECODER_ONLY, executor_config(max_decode_steps, **overrides)) as executor:
        ids = [executor.enqueue_request(r) for r in requests]
        first = []
        if late is not None:   # arrives once the others generate
            first = executor.await_responses(ids[0], timeout=60.0)
            assert first and not first[0].has_error() and not first[-1].result.is_final
            ids.append(executor.enqueue_request(late))
        responses = collect(executor, ids)
        responses[ids[0]][:0] = first
        stats = executor.get_latest_iteration_stats()
    outputs = []
    for i in ids:
        finals = [r for r in responses[i] if r.result.is_final]
        log_probs = [float(lp) for r in (responses[i] if streaming else finals) for lp in r.result.log_probs[0]]
        outputs.append((final_tokens(responses[i], streaming)[0], log_probs))
    return outputs, (sum(1 for s in stats if s.num_scheduled), sum(s.num_generation_tokens for s in stats),
                     any(s.num_generation_tokens > s.num_generation for s in stats))


def greedy_request(prompt, streaming: bool, end_id: int | None = None, **sampling) -> Request:
    return Request(prompt, max_tokens=NUM_NEW_TOKENS, streaming=streaming, end_id=end_id,
                   sampling_config=SamplingConfig(**sampling) if sampling else None,
                   output_config=OutputConfig(exclude_input_from_output=True, return_log_probs=True))


@pytest.mark.parametrize("streaming", [False, True])
def test_executor_tokens_and_log_probs_equal_one_step_per_iteration(tiny_engine, prompts, references, streaming):
    engine_dir, _ = tiny_engine
    ids = list(prompts)[:6]
    requests = [greedy_request(prompts[i], streaming) for i in ids]
    once, num_once = run(engine_dir, requests, 1, streaming)
    several, num_several = run(engine_dir, requests, 8, streaming)
    for i, (tokens, _) in zip(ids, several):
        assert tokens == references[i][len(prompts[i]):], f"request {i}"
    assert [tokens for tokens, _ in several] == [tokens for tokens, _ in once]
    for (_, a), (_, b) in zip(once, several):
        assert a == pytest.approx(b, abs=1e-5)
    # iterations: fewer; generation tokens (every step of a call counts): the same
    assert num_once[0] == NUM_NEW_TOKENS and num_several[0] < num_once[0] / 2
    assert num_several[1] == num_once[1] == len(ids) * (NUM_NEW_TOKENS - 1)
    assert num_several[2] and not num_once[2]


@pytest.mark.parametrize("policy", [SchedulerPolicy.MAX_UTILIZATION, SchedulerPolicy.GUARANTEED_NO_EVICT])
def test_block_reuse_and_a_tight_pool_under_each_policy(tiny_engine, prompts, references, policy):
    """Two rounds of the same prompts (the second reuses the first's blocks) in a pool that holds
    about half of them at once: MAX_UTILIZATION pauses, GUARANTEED_NO_EVICT queues."""
    engine_dir, _ = tiny_engine
    ids = list(prompts)[:8]
    requests = [greedy_request(prompts[i], False) for i in ids]
    outputs, (_, _, ran_several) = run(engine_dir, requests + requests, 8, False,
                                       kv_cache_config=KvCacheConfig(max_tokens=160, enable_block_reuse=True),
                                       scheduler_config=SchedulerConfig(policy))
    for i, (tokens, _) in zip(ids + ids, outputs):
        assert tokens == references[i][len(prompts[i]):], f"request {i}"
    assert ran_several


def test_end_ids_stop_words_a_sampled_request_and_a_late_arrival(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    continuation = {i: references[i][len(prompts[i]):] for i in range(5)}
    requests = [greedy_request(prompts[0], True, end_id=continuation[0][5]),        # ends at its 6th token
                greedy_request(prompts[1], False),
                Request(prompts[2], max_tokens=NUM_NEW_TOKENS, stop_words=[continuation[2][3:5]],
                        output_config=OutputConfig(exclude_input_from_output=True, return_log_probs=True))]
    late = greedy_request(prompts[4], True)
    sampled = greedy_request(prompts[3], False, top_k=4, seed=11)
    for extra in ([], [sampled]):
        once, _ = run(engine_dir, requests + extra, 1, True, late)
        several, (_, _, ran_several) = run(engine_dir, requests + extra, 8, True, late)
        assert [t for t, _ in several] == [t for t, _ in once]
        assert ran_several   # (with the sampled request: once it has ended)
        first = continuation[0][:continuation[0].index(continuation[0][5])]
        assert several[0][0] == first
        assert several[1][0] == continuation[1]
        assert several[2][0] == continuation[2][:5]
        assert several[-1][0] == continuation[4]


def test_gpt_manager_streams_the_tokens_of_several_steps(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    ids = list(prompts)[:4]
    client = Client([make_request(i, prompts[i], streaming=True) for i in ids])
    params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=400),
                                       decoding_config=DecodingConfig(max_decode_steps=6))
    with GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *client.callbacks(), optional_params=params):
        client.wait()
    for i in ids:
        responses = client.responses[i]
        assert all(err == "" for _, _, err in responses)
        tokens = [t for tensors, _, _ in responses for t in tensors[tensor_names.OUTPUT_IDS][0, 0].tolist()]
        assert tokens == references[i][len(prompts[i]):], f"request {i}"
        assert len(responses) < NUM_NEW_TOKENS   # several tokens per streamed response


def test_a_row_with_no_token_fails_its_request_naming_the_logits():
    """A plain-greedy row whose logits allow nothing (NaN from the model) mid-call ends that request
    with the decoder's error, its store released."""
    decoder = RequestDecoder(kernels=None)
    spec = RequestSpec([1, 2, 3], 8, DecodingParams())
    decoder.open(1, NewRequest(spec, LlmRequest(1, spec, arrival_index=1).output))
    scheduled = ScheduledRequest(1, ((40,),), 3, ((0,),), True, num_decode_steps=3)
    steps = GreedySteps(torch.tensor([[5, NO_TOKEN, 0]]), torch.tensor([[-1.0, float("-inf"), -1.0]]))
    (result,) = decoder.accept_steps([scheduled], steps)
    assert result.error.startswith("logits: no token is allowed at generation step 1: the logits are NaN")
    assert len(decoder) == 0


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_a_bad_max_decode_steps_is_refused_naming_it(tiny_engine, value):
    with pytest.raises(ValueError, match=f"DecodingConfig.max_decode_steps: must be an integer >= 1, got {value!r}"):
        Executor(tiny_engine[0], ModelType.DECODER_ONLY, executor_config(value))
