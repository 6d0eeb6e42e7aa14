"""num_return_sequences: n samples of one prompt share its KV (one context) and equal n separate
requests with seeds seed + i, through GptManager (sequence i at beam index i) and the Executor."""
from __future__ import annotations

import json

import pytest
import torch

from batch_manager import GptManager, KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType
from batch_manager import tensor_names as tn
from batch_manager.executor import Executor, ExecutorConfig, ModelType, OutputConfig, Request, SamplingConfig
from tests.batch_manager.conftest import Client, make_request
from tests.batch_manager.executor.helpers import collect

NUM_TOKENS = 10


def sampled(request_id, prompt, seed, n=1, streaming=False, **extra):
    tensors = dict(random_seed=torch.tensor([[seed]], dtype=torch.int64),
                   runtime_top_k=torch.tensor([[8]], dtype=torch.int32), temperature=torch.tensor([[1.3]]), **extra)
    if n > 1:
        tensors["num_return_sequences"] = torch.tensor([[n]], dtype=torch.int32)
    return make_request(request_id, prompt, NUM_TOKENS, streaming=streaming, **tensors)


def run(engine_dir, requests, policy=SchedulerPolicy.GUARANTEED_NO_EVICT, max_tokens=600):
    client = Client(requests)
    with GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, policy, *client.callbacks(),
                    optional_params=TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=max_tokens))) \
            as manager:
        client.wait()
    kv = manager.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks
    return client


def sequences(tensors) -> list[list[int]]:
    lengths = tensors[tn.SEQUENCE_LENGTH][0].tolist()
    return [tensors[tn.OUTPUT_IDS][0, i, :n].tolist() for i, n in enumerate(lengths)]


@pytest.mark.parametrize("policy, max_tokens", [(SchedulerPolicy.GUARANTEED_NO_EVICT, 600),
                                                (SchedulerPolicy.MAX_UTILIZATION, 200)])
@pytest.mark.parametrize("end_id", [None, 50])
def test_n_samples_equal_n_requests_with_the_matching_seeds(tiny_engine, prompts, policy, max_tokens, end_id):
    engine_dir, _ = tiny_engine
    extra = {} if end_id is None else {"end_id": torch.tensor([[end_id]], dtype=torch.int32)}
    families = {100 + i: (prompts[i], 10 * i) for i in range(3)}
    together = run(engine_dir, [sampled(rid, p, seed, n=4, **extra) for rid, (p, seed) in families.items()],
                   policy, max_tokens)
    alone = run(engine_dir, [sampled(rid * 10 + k, p, seed + k, **extra) for rid, (p, seed) in families.items()
                             for k in range(4)], policy, max_tokens)
    for rid, (prompt, _) in families.items():
        tensors, _, err = together.final(rid)
        assert err == ""
        assert tensors[tn.OUTPUT_IDS].shape[1] == 4
        expected = [alone.final(rid * 10 + k)[0][tn.OUTPUT_IDS][0, 0].tolist() for k in range(4)]
        assert sequences(tensors) == expected, f"request {rid}"
        assert len({tuple(s) for s in expected}) > 1, "the samples should differ"


def test_the_prompt_is_computed_once_and_streaming_sends_every_sequence(tiny_engine, prompts):
    engine_dir, _ = tiny_engine
    prompt = prompts[5]
    streamed = run(engine_dir, [sampled(1, prompt, 3, n=3, streaming=True)])
    stats = [json.loads(s) for s in streamed.stats]
    assert sum(s["Total Context Tokens"] for s in stats) == len(prompt)
    plain = run(engine_dir, [sampled(1, prompt, 3, n=3)])
    final_streamed = streamed.final(1)[0]
    assert sequences(final_streamed) == [s[len(prompt):] for s in sequences(plain.final(1)[0])]
    assert all(t[tn.OUTPUT_IDS].shape[1] == 3 for t, _, _ in streamed.responses[1])


@pytest.mark.parametrize("streaming", [False, True])
def test_executor_num_return_sequences(tiny_engine, prompts, streaming):
    """One result per sequence (sequence_index), as TensorRT-LLM's: streamed, each sequence's new
    tokens; the request's last result is_final, every result of the final response is_sequence_final."""
    engine_dir, _ = tiny_engine
    config = ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=600))
    with Executor(engine_dir, ModelType.DECODER_ONLY, config) as executor:
        family = executor.enqueue_request(Request(prompts[0], max_tokens=NUM_TOKENS, streaming=streaming,
                                                  sampling_config=SamplingConfig(top_k=8, temperature=1.3, seed=21,
                                                                                 num_return_sequences=3),
                                                  output_config=OutputConfig(exclude_input_from_output=True,
                                                                             return_log_probs=True)))
        singles = [executor.enqueue_request(Request(prompts[0], max_tokens=NUM_TOKENS, sampling_config=SamplingConfig(
            top_k=8, temperature=1.3, seed=21 + k), output_config=OutputConfig(exclude_input_from_output=True)))
            for k in range(3)]
        responses = collect(executor, [family, *singles])
    results = [r.result for r in responses[family]]
    assert [r.is_final for r in results] == [False] * (len(results) - 1) + [True]
    by_sequence = {i: [r for r in results if r.sequence_index == i] for i in range(3)}
    for i, own in by_sequence.items():
        assert [r.is_sequence_final for r in own] == [False] * (len(own) - 1) + [True]
        tokens = [t for r in own for t in r.output_token_ids[0]]
        assert tokens == responses[singles[i]][-1].result.output_token_ids[0]
        assert sum(r.log_probs.shape[1] for r in own) == len(tokens)
    if streaming:
        assert len(results) > 3


@pytest.mark.parametrize("extra, message", [
    ({"beam_width": torch.tensor([[2]])}, "num_return_sequences: 3 needs beam width 1, got 2"),
    ({"num_return_sequences": torch.tensor([[9]], dtype=torch.int32)},
     "num_return_sequences: 9 sequences exceed max_batch_size 8"),
    ({"draft_input_ids": torch.tensor([[1, 2]], dtype=torch.int32)}, "draft tokens need beam width 1, got 1 and "
                                                                     "num_return_sequences 3"),
])
def test_bad_combinations_are_refused(tiny_engine, prompts, extra, message):
    request = make_request(1, prompts[1], 4, num_return_sequences=torch.tensor([[3]], dtype=torch.int32))
    for name, value in extra.items():
        setattr(request, name, value)
    client = Client([request])
    optional = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=600), max_draft_tokens=4)
    with GptManager(tiny_engine[0], TrtGptModelType.InflightFusedBatching, 2, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *client.callbacks(), optional_params=optional):
        client.wait()
    assert message in client.final(1)[2]
