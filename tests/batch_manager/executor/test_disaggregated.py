"""Disaggregated context and generation: a context-only request on one Executor (another process)
and a generation-only request given its ContextPhaseParams on this one give one request's tokens
(greedy; float32 and int8 KV; LoRA); a dead or timed-out context side gives a clear error; the
parameters a generation-only request must repeat are checked at enqueue."""
from __future__ import annotations

import time
from pathlib import Path

import msgpack
import pytest
import torch

from batch_manager import load_peft_adapter
from batch_manager.executor import (ContextPhaseParams, FinishReason, KvCacheConfig, LoraConfig, OutputConfig, Request,
                                    RequestType, SamplingConfig)
from runtime import build_engine
from tests.batch_manager.conftest import NUM_NEW_TOKENS
from tests.batch_manager.executor import disaggregated_peer as peer
from tests.batch_manager.executor.helpers import collect, executor_for
from tests.factories import make_checkpoint
from tests.lora_helpers import ALL_TARGETS, make_peft_adapter

POOL = 400   # KV tokens
CONTEXT_ONLY, GENERATION_ONLY = RequestType.REQUEST_TYPE_CONTEXT_ONLY, RequestType.REQUEST_TYPE_GENERATION_ONLY
BLOCKS_OF_4 = list(range(3, 19))   # 16 tokens: whole blocks only


@pytest.fixture(scope="module")
def engines(tiny_engine, tmp_path_factory):
    """({"float32": dir, "int8": dir (int8 KV with scales)}, a PEFT LoRA adapter dir) of the tiny LLaMA."""
    engine_dir, model = tiny_engine
    root = tmp_path_factory.mktemp("disaggregated")
    build_engine(Path(engine_dir).parent / "hf", root / "int8", tokens_per_block=4, max_batch_size=8,
                 max_input_len=48, max_seq_len=96, max_num_tokens=128, kv_cache_dtype="int8")
    make_peft_adapter(model, root / "adapter", 4, 8, ALL_TARGETS["llama"], seed=1)
    return {"float32": engine_dir, "int8": str(root / "int8")}, str(root / "adapter")


@pytest.fixture(scope="module")
def context_instances(engines):
    """kind -> the pipe of a context instance (its own process) on that engine."""
    started = {kind: peer.start(engine_dir) for kind, engine_dir in engines[0].items()}
    yield {kind: connection for kind, (_, connection) in started.items()}
    for process, connection in started.values():
        connection.send(("exit",))
        process.join(60)


def run_context(connection, specs: list[dict]) -> list[dict]:
    connection.send(("context", specs))
    return connection.recv()


def generation_request(prompt, params: bytes, streaming=False, **fields) -> Request:
    output = OutputConfig(return_log_probs=True)
    return Request(prompt, NUM_NEW_TOKENS, streaming=streaming, output_config=output, request_type=GENERATION_ONLY,
                   context_phase_params=ContextPhaseParams.from_bytes(params), **fields)


def joined(responses: list) -> tuple[list[int], list[float], float]:
    """(tokens, log probs, cum log prob) of a request's results, streamed ones joined."""
    assert not any(r.has_error() for r in responses), [r.error_msg for r in responses]
    results = [r.result for r in responses]
    return ([t for r in results for t in r.output_token_ids[0]], [v for r in results for v in r.log_probs[0].tolist()],
            float(results[-1].cum_log_probs[0]))


def kv_is_whole(executor) -> bool:
    kv = executor.kv_cache_manager
    return kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_context_only_then_generation_only_across_two_processes_equals_one_process(
        engines, context_instances, prompts, kind, streaming):
    engine_dir = engines[0][kind]
    chosen = [prompts[i] for i in range(6)] + [BLOCKS_OF_4]
    contexts = run_context(context_instances[kind], [dict(prompt=p, max_tokens=NUM_NEW_TOKENS, streaming=streaming)
                                                     for p in chosen])
    for prompt, context in zip(chosen, contexts):
        assert context["num_results"] == 1 and context["finish_reasons"] == [FinishReason.NOT_FINISHED]
        assert context["tokens"][:-1] == ([] if streaming else prompt) and context["params"] is not None
    with executor_for(engine_dir, kv_cache_config=KvCacheConfig(max_tokens=POOL)) as executor:
        output = OutputConfig(return_log_probs=True)
        single_ids = executor.enqueue_requests([Request(p, NUM_NEW_TOKENS, streaming=streaming, output_config=output)
                                                for p in chosen])
        single = collect(executor, single_ids)
        generation_ids = executor.enqueue_requests([generation_request(p, c["params"], streaming)
                                                    for p, c in zip(chosen, contexts)])
        generation = collect(executor, generation_ids)
        assert kv_is_whole(executor)
    for prompt, context, single_id, generation_id in zip(chosen, contexts, single_ids, generation_ids):
        tokens, log_probs, cum = joined(single[single_id])
        got_tokens, got_log_probs, got_cum = joined(generation[generation_id])
        first = context["tokens"][-1]
        if streaming:   # the generation side's tokens start after the first one
            assert [first] + got_tokens == tokens
        else:           # its input (prompt + first token), then the rest: the single request's output
            assert got_tokens == tokens and tokens[len(prompt)] == first
        assert len(got_log_probs) == NUM_NEW_TOKENS - 1
        torch.testing.assert_close(got_log_probs, log_probs[1:], atol=1e-4, rtol=0)
        assert got_cum == pytest.approx(cum, abs=1e-4)                   # counts the first token
        assert context["cum_log_prob"] == pytest.approx(log_probs[0], abs=1e-4)
        assert generation[generation_id][-1].result.finish_reasons == [FinishReason.LENGTH]
    assert context_instances[kind].send(("kv", 10)) is None
    free, total, reserved = context_instances[kind].recv()
    assert (free, reserved) == (total, 0)   # every block freed once fetched


def test_a_lora_request_across_two_processes_equals_one_process(engines, context_instances, prompts):
    (engine_dirs, adapter_dir), chosen = engines, [prompts[i] for i in range(4)]
    contexts = run_context(context_instances["float32"], [
        dict(prompt=p, max_tokens=NUM_NEW_TOKENS, lora=adapter_dir, task_id=7) for p in chosen])
    weights, config = load_peft_adapter(adapter_dir)
    output = OutputConfig(return_log_probs=True)
    with executor_for(engine_dirs["float32"], kv_cache_config=KvCacheConfig(max_tokens=POOL)) as executor:
        base_ids = executor.enqueue_requests([Request(p, NUM_NEW_TOKENS, output_config=output) for p in chosen])
        single_ids = executor.enqueue_requests([Request(p, NUM_NEW_TOKENS, output_config=output,
                                                        lora_config=LoraConfig(7, weights, config)) for p in chosen])
        responses = collect(executor, base_ids + single_ids)
        generation_ids = executor.enqueue_requests([
            generation_request(p, c["params"], lora_config=LoraConfig(7)) for p, c in zip(chosen, contexts)])
        responses.update(collect(executor, generation_ids))
    singles = [joined(responses[i]) for i in single_ids]
    assert singles != [joined(responses[i]) for i in base_ids]   # the adapter changes the tokens
    for single, generation_id, context in zip(singles, generation_ids, contexts):
        tokens, log_probs, cum = joined(responses[generation_id])
        assert tokens == single[0] and context["tokens"][-1] == single[0][len(tokens) - NUM_NEW_TOKENS]
        torch.testing.assert_close(log_probs, single[1][1:], atol=1e-4, rtol=0)


def test_a_generation_only_request_whose_context_instance_died_gets_an_error_naming_the_params(engines, prompts):
    engine_dir = engines[0]["float32"]
    process, connection = peer.start(engine_dir)
    [context] = run_context(connection, [dict(prompt=prompts[0], max_tokens=NUM_NEW_TOKENS)])
    process.kill()
    process.join(30)
    state = msgpack.unpackb(ContextPhaseParams.from_bytes(context["params"]).opaque_state)
    with executor_for(engine_dir, kv_cache_config=KvCacheConfig(max_tokens=POOL)) as executor:
        request_id = executor.enqueue_request(generation_request(prompts[0], context["params"]))
        [response] = collect(executor, [request_id])[request_id]
        assert response.has_error()
        assert response.error_msg.startswith("context_phase_params: the KV blocks could not be fetched")
        assert f"{state['host']}:{state['port']}" in response.error_msg
        assert kv_is_whole(executor) and executor.get_bookkeeping_counts()["active"] == 0


def test_blocks_left_unfetched_are_freed_after_the_timeout(engines, prompts):
    with executor_for(engines[0]["float32"], kv_cache_config=KvCacheConfig(max_tokens=POOL),
                      kv_transfer_timeout_ms=1000) as executor:
        request_id = executor.enqueue_request(Request(prompts[1], NUM_NEW_TOKENS, request_type=CONTEXT_ONLY))
        [response] = collect(executor, [request_id])[request_id]
        ended = time.monotonic()
        blocks = -(-len(prompts[1]) // 4)
        kv = executor.kv_cache_manager
        assert kv.num_blocks - kv.num_free_blocks == blocks   # kept after the final result
        assert executor.get_bookkeeping_counts()["kv_exports"] == 1
        while not kv_is_whole(executor):
            assert time.monotonic() - ended < 10, "the reserved blocks were never freed"
            time.sleep(0.01)
        assert time.monotonic() - ended >= 0.5 and executor.get_bookkeeping_counts()["kv_exports"] == 0
        # The generation side now finds nothing under that handle.
        late = executor.enqueue_request(generation_request(prompts[1], response.result.context_phase_params.to_bytes()))
        [error] = collect(executor, [late])[late]
        assert error.has_error() and "context_phase_params" in error.error_msg and "timed out" in error.error_msg
        kv.check_invariants()


def test_a_first_token_that_ends_the_request_finishes_it_normally_with_no_params(engines, prompts):
    with executor_for(engines[0]["float32"], kv_cache_config=KvCacheConfig(max_tokens=POOL)) as executor:
        probe = executor.enqueue_request(Request(prompts[2], 1))
        first = collect(executor, [probe])[probe][-1].result.output_token_ids[0][-1]
        ids = executor.enqueue_requests([Request(prompts[2], 1, request_type=CONTEXT_ONLY),
                                         Request(prompts[2], NUM_NEW_TOKENS, end_id=first, request_type=CONTEXT_ONLY)])
        responses = collect(executor, ids)
        results = [responses[i][-1].result for i in ids]
        assert [r.finish_reasons for r in results] == [[FinishReason.LENGTH], [FinishReason.END_ID]]
        assert [r.context_phase_params for r in results] == [None, None]
        assert kv_is_whole(executor)


def test_a_generation_only_request_must_repeat_the_prompt_max_tokens_sampling_and_adapter(engines, prompts):
    engine_dirs, adapter_dir = engines
    prompt = prompts[3]
    with executor_for(engine_dirs["float32"], kv_cache_config=KvCacheConfig(max_tokens=POOL)) as executor:
        sampling = SamplingConfig(temperature=0.5, top_k=1)
        context_id = executor.enqueue_request(Request(prompt, NUM_NEW_TOKENS, sampling_config=sampling,
                                                      request_type=CONTEXT_ONLY))
        params = collect(executor, [context_id])[context_id][-1].result.context_phase_params.to_bytes()

        def refused(match: str, prompt=prompt, params=params, **fields) -> None:
            fields.setdefault("sampling_config", SamplingConfig(temperature=0.5, top_k=1))
            with pytest.raises(ValueError, match=match):
                executor.enqueue_request(Request(prompt, fields.pop("max_tokens", NUM_NEW_TOKENS),
                                                 request_type=fields.pop("request_type", GENERATION_ONLY),
                                                 context_phase_params=params, **fields))

        refused(r"^input_token_ids: differ from the prompt context_phase_params record", prompt=prompt[:-1])
        refused(r"^input_token_ids: differ", prompt=prompt[:-1] + [prompt[-1] ^ 1])
        refused(rf"^max_tokens: {NUM_NEW_TOKENS - 1}, but context_phase_params record {NUM_NEW_TOKENS}",
                max_tokens=NUM_NEW_TOKENS - 1)
        refused(r"^sampling_config\.temperature: 1\.0, but context_phase_params record 0\.5",
                sampling_config=SamplingConfig(top_k=1))
        refused(r"^lora_config\.task_id: 3, but context_phase_params record None", lora_config=LoraConfig(3))
        refused(r"^context_phase_params: REQUEST_TYPE_GENERATION_ONLY needs", params=None)
        refused(r"^context_phase_params: given with REQUEST_TYPE_CONTEXT_ONLY", request_type=CONTEXT_ONLY)
        refused(r"^context_phase_params: given with REQUEST_TYPE_CONTEXT_AND_GENERATION",
                request_type=RequestType.REQUEST_TYPE_CONTEXT_AND_GENERATION)
        refused(r"^sampling_config\.beam_width: REQUEST_TYPE_CONTEXT_ONLY takes one sequence", params=None,
                request_type=CONTEXT_ONLY, sampling_config=SamplingConfig(beam_width=2))
        refused(r"^output_config\.return_context_logits: REQUEST_TYPE_GENERATION_ONLY computes no context",
                output_config=OutputConfig(return_context_logits=True))
        with pytest.raises(ValueError, match=r"^context_phase_params: not the bytes of a ContextPhaseParams"):
            ContextPhaseParams.from_bytes(b"\x93junk")
        assert executor.get_num_active_requests() == 0
        # The refusals fetched nothing: the blocks wait, and a request that repeats it all gets them.
        assert executor.get_bookkeeping_counts()["kv_exports"] == 1
        good = executor.enqueue_request(generation_request(prompt, params, sampling_config=SamplingConfig(
            temperature=0.5, top_k=1)))
        assert not collect(executor, [good])[good][-1].has_error()
    with executor_for(engine_dirs["int8"], kv_cache_config=KvCacheConfig(max_tokens=POOL)) as other:
        with pytest.raises(ValueError, match=r"^context_phase_params: the context instance differs from this one in "
                                             r"kv_cache_dtype: 'float32' there, 'int8' here"):
            other.enqueue_request(generation_request(prompt, params))


def test_context_phase_params_round_trip_through_bytes():
    params = ContextPhaseParams([5], 42, b"\x00state")
    assert ContextPhaseParams.from_bytes(params.to_bytes()) == params
    assert msgpack.unpackb(params.to_bytes()) == {"first_gen_tokens": [5], "req_id": 42, "opaque_state": b"\x00state"}


def test_a_generation_only_request_reuses_a_cached_prefix_and_fetches_only_the_rest(engines, prompts):
    """The generation instance holds the prompt's first blocks already (block reuse): it installs
    only the fetched blocks past them; the tokens stay those of one request."""
    engine_dir, prompt = engines[0]["float32"], BLOCKS_OF_4 + prompts[4]
    with executor_for(engine_dir, kv_cache_config=KvCacheConfig(max_tokens=POOL)) as context, \
            executor_for(engine_dir, kv_cache_config=KvCacheConfig(max_tokens=POOL, enable_block_reuse=True)) as gen:
        context_id = context.enqueue_request(Request(prompt, NUM_NEW_TOKENS, request_type=CONTEXT_ONLY))
        params = collect(context, [context_id])[context_id][-1].result.context_phase_params.to_bytes()
        warm = gen.enqueue_request(Request(BLOCKS_OF_4 + [5], 2))   # caches the first 4 blocks
        single = gen.enqueue_request(Request(prompt, NUM_NEW_TOKENS))
        responses = collect(gen, [warm, single])
        reused = gen.kv_cache_manager.num_reused
        later = gen.enqueue_request(generation_request(prompt, params))
        responses.update(collect(gen, [later]))
        assert gen.kv_cache_manager.num_reused > reused
        gen.kv_cache_manager.check_invariants()
    assert responses[later][-1].result.output_token_ids == responses[single][-1].result.output_token_ids


def test_generation_only_results_take_the_output_config(engines, prompts):
    """Excluding the input: only the tokens after the first; every streamed token so far
    (return_all_generated_tokens): those after the first too."""
    with executor_for(engines[0]["float32"], kv_cache_config=KvCacheConfig(max_tokens=POOL)) as executor:
        context_ids = executor.enqueue_requests([Request(prompts[5], NUM_NEW_TOKENS, request_type=CONTEXT_ONLY)
                                                 for _ in range(2)])
        contexts = collect(executor, context_ids)
        single = executor.enqueue_request(Request(prompts[5], NUM_NEW_TOKENS,
                                                  output_config=OutputConfig(exclude_input_from_output=True)))
        params = [contexts[i][-1].result.context_phase_params for i in context_ids]
        excluded, everything = executor.enqueue_requests([
            Request(prompts[5], NUM_NEW_TOKENS, request_type=GENERATION_ONLY, context_phase_params=params[0],
                    output_config=OutputConfig(exclude_input_from_output=True)),
            Request(prompts[5], NUM_NEW_TOKENS, streaming=True, return_all_generated_tokens=True,
                    request_type=GENERATION_ONLY, context_phase_params=params[1])])
        responses = collect(executor, [single, excluded, everything])
    expected = responses[single][-1].result.output_token_ids[0]
    assert responses[excluded][-1].result.output_token_ids[0] == expected[1:]
    assert responses[everything][-1].result.output_token_ids[0] == expected[1:]
    assert [len(r.result.output_token_ids[0]) for r in responses[everything]] == list(range(1, NUM_NEW_TOKENS))


def test_seeded_sampling_split_in_two_draws_as_one_request(engines, prompts):
    """The draw of token t depends on (seed, t): the generation side continues the context side's
    sequence of draws (top-p decay and the penalties see the first token too)."""
    def sampling(i: int) -> SamplingConfig:
        return SamplingConfig(temperature=1.0, top_p=0.9, top_p_decay=0.9, seed=100 + i, repetition_penalty=1.1)

    chosen = [prompts[i] for i in range(6, 12)]
    with executor_for(engines[0]["float32"], kv_cache_config=KvCacheConfig(max_tokens=800)) as executor:
        single_ids = executor.enqueue_requests([Request(p, NUM_NEW_TOKENS, sampling_config=sampling(i))
                                                for i, p in enumerate(chosen)])
        context_ids = executor.enqueue_requests([Request(p, NUM_NEW_TOKENS, sampling_config=sampling(i),
                                                         request_type=CONTEXT_ONLY) for i, p in enumerate(chosen)])
        responses = collect(executor, single_ids + context_ids)
        generation_ids = executor.enqueue_requests([
            Request(p, NUM_NEW_TOKENS, sampling_config=sampling(i), request_type=GENERATION_ONLY,
                    context_phase_params=responses[c][-1].result.context_phase_params)
            for i, (p, c) in enumerate(zip(chosen, context_ids))])
        responses.update(collect(executor, generation_ids))
    assert [responses[g][-1].result.output_token_ids for g in generation_ids] == \
        [responses[s][-1].result.output_token_ids for s in single_ids]


def test_instances_that_differ_in_weights_or_block_size_refuse_the_params(engines, prompts, tmp_path):
    engine_dir = engines[0]["float32"]
    make_checkpoint(tmp_path / "other", "llama", seed=1)   # the same shapes, other weights
    limits = dict(max_batch_size=8, max_input_len=48, max_seq_len=96, max_num_tokens=128)
    build_engine(tmp_path / "other", tmp_path / "other_engine", tokens_per_block=4, **limits)
    build_engine(Path(engine_dir).parent / "hf", tmp_path / "blocks_of_8", tokens_per_block=8, **limits)
    with executor_for(engine_dir, kv_cache_config=KvCacheConfig(max_tokens=POOL)) as executor:
        context_id = executor.enqueue_request(Request(prompts[0], NUM_NEW_TOKENS, request_type=CONTEXT_ONLY))
        params = collect(executor, [context_id])[context_id][-1].result.context_phase_params.to_bytes()
    for other, field in (("other_engine", "weights_digest"), ("blocks_of_8", "tokens_per_block: 4 there, 8 here")):
        with executor_for(str(tmp_path / other), kv_cache_config=KvCacheConfig(max_tokens=POOL)) as executor:
            with pytest.raises(ValueError, match=rf"^context_phase_params: the context instance differs from this "
                                                 rf"one in {field}"):
                executor.enqueue_request(generation_request(prompts[0], params))
