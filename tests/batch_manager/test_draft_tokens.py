"""Draft tokens through the manager: the request's own draft_input_ids (verified with its last
context chunk) and the built-in prompt-lookup drafter (verified in generation steps). Greedy
outputs equal plain greedy decoding (transformers' generate) under every batching type and
capacity policy, with pauses, block reuse, chunked context and streaming; rejected drafts leave
no KV behind; bad drafts get an error naming the field."""
from __future__ import annotations

import json
import random

import pytest
import torch

from batch_manager import (DecodingConfig, GptManager, KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams,
                           TrtGptModelType, tensor_names)
from batch_manager.scheduling.capacity_scheduler import GuaranteedNoEvictScheduler
from batch_manager.scheduling.llm_request import LlmRequest
from runtime.request import RequestSpec
from batch_manager.scheduling.micro_batch_scheduler import MicroBatchScheduler
from batch_manager.scheduling.scheduler import Scheduler
from batch_manager.scheduling.step import RequestResult, StepResult
from runtime.decoding import DecodeOutcome, DecodingParams
from runtime.cache.kv_cache_manager import KvCacheManager
from tests.batch_manager.conftest import NUM_NEW_TOKENS, Client, make_request

VOCAB = 128   # tests.factories' tiny checkpoints


def drafts_for(request_id: int, prompt: list[int], reference: list[int]) -> list[int]:
    """Per request: the true continuation, a continuation that diverges at once, random ids, or
    a true prefix that then diverges."""
    truth = reference[len(prompt):len(prompt) + 4]
    kind = request_id % 4
    if kind == 0:
        return truth
    if kind == 1:
        return [(t + 1) % VOCAB for t in truth]
    if kind == 2:
        rng = random.Random(request_id)
        return [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 5))]
    return truth[:2] + [(truth[2] + 5) % VOCAB]


def draft_requests(prompts, references, ids, streaming: bool = False, with_drafts=lambda i: i % 5 != 4):
    out = []
    for i in ids:
        extra = {}
        if with_drafts(i):
            extra[tensor_names.DRAFT_INPUT_IDS] = torch.tensor([drafts_for(i, prompts[i], references[i])],
                                                               dtype=torch.int32)
        out.append(make_request(i, prompts[i], streaming=streaming, **extra))
    return out


def params(max_tokens: int = 160, prompt_lookup: int = 3, **kv) -> TrtGptModelOptionalParams:
    return TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=max_tokens, **kv), max_draft_tokens=4,
                                     decoding_config=DecodingConfig(prompt_lookup_max_batch_size=0, prompt_lookup_num_tokens=prompt_lookup,
                                                                    max_matching_ngram_size=2))


def run(engine_dir, client, optional_params, model_type=TrtGptModelType.InflightFusedBatching,
        policy=SchedulerPolicy.GUARANTEED_NO_EVICT) -> GptManager:
    with GptManager(engine_dir, model_type, 1, policy, *client.callbacks(), optional_params=optional_params) as manager:
        client.wait()
    return manager


def check_outputs(client, references, ids, manager) -> list[dict]:
    for i in ids:
        tensors, _, err = client.final(i)
        assert err == "", f"request {i}: {err}"
        assert tensors[tensor_names.OUTPUT_IDS][0, 0].tolist() == references[i], f"request {i}"
    kv = manager.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks
    stats = [json.loads(s) for s in client.stats]
    proposed, accepted = stats[-1]["Draft Tokens Proposed"], stats[-1]["Draft Tokens Accepted"]
    assert 0 < accepted <= proposed
    return stats


@pytest.mark.parametrize("model_type", list(TrtGptModelType))
@pytest.mark.parametrize("policy", list(SchedulerPolicy))
def test_greedy_with_drafts_equals_greedy_under_every_batching_and_policy(tiny_engine, prompts, references,
                                                                        model_type, policy):
    engine_dir, _ = tiny_engine
    ids = list(prompts)[:12]
    rng = random.Random(int(model_type) * 10 + int(policy))
    arrivals = sorted(rng.randrange(0, 20) for _ in ids)
    client = Client(draft_requests(prompts, references, ids), arrivals)
    # 24 blocks of 4 tokens: requests queue (GUARANTEED_NO_EVICT) or pause (MAX_UTILIZATION).
    manager = run(engine_dir, client, params(96), model_type, policy)
    stats = check_outputs(client, references, ids, manager)
    if policy == SchedulerPolicy.MAX_UTILIZATION and model_type != TrtGptModelType.V1:
        assert sum(s["Paused Requests"] for s in stats) > 0, "the small pool should force pauses"


def test_drafts_with_streaming_block_reuse_and_chunked_context(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    ids = list(prompts)[:10]
    client = Client(draft_requests(prompts, references, ids, streaming=True))
    optional = params(400, enable_block_reuse=True)
    optional.enable_chunked_context, optional.max_num_tokens = True, 24
    manager = run(engine_dir, client, optional)
    kv = manager.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks
    for i in ids:   # every accepted token is streamed once, in order
        chunks = client.responses[i]
        assert [final for _, final, _ in chunks] == [False] * (len(chunks) - 1) + [True]
        tokens = [t for tensors, _, _ in chunks for t in tensors[tensor_names.OUTPUT_IDS][0, 0].tolist()]
        assert tokens == references[i][len(prompts[i]):], f"request {i}"
    assert any(len(tensors[tensor_names.OUTPUT_IDS][0, 0]) > 1 for i in ids for tensors, _, _ in client.responses[i]), \
        "some step should have accepted drafts"


def test_drafts_with_overlap(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    ids = list(prompts)[:8]
    client = Client(draft_requests(prompts, references, ids))
    optional = params(400)
    optional.enable_trt_overlap = True
    check_outputs(client, references, ids, run(engine_dir, client, optional))


def test_log_probs_cover_every_accepted_token(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    ids = list(prompts)[:4]
    requests = draft_requests(prompts, references, ids, with_drafts=lambda i: True)
    for r in requests:
        r.return_log_probs = torch.tensor([[True]])
    plain = [make_request(i + 50, prompts[i], return_log_probs=torch.tensor([[True]])) for i in ids]
    client = Client(requests + plain)
    run(engine_dir, client, params(400, prompt_lookup=0))
    for i in ids:
        with_drafts, without = client.final(i)[0], client.final(i + 50)[0]
        assert with_drafts[tensor_names.OUTPUT_LOG_PROBS].shape == (1, 1, NUM_NEW_TOKENS)
        torch.testing.assert_close(with_drafts[tensor_names.OUTPUT_LOG_PROBS], without[tensor_names.OUTPUT_LOG_PROBS],
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(with_drafts[tensor_names.CUM_LOG_PROBS], without[tensor_names.CUM_LOG_PROBS],
                                   atol=1e-4, rtol=1e-4)


def test_sampled_requests_with_drafts_and_draft_logits_run_to_length(tiny_engine, prompts):
    engine_dir, _ = tiny_engine
    requests = []
    for i in range(6):
        extra = dict(runtime_top_k=torch.tensor([[20]], dtype=torch.int32),
                     random_seed=torch.tensor([[i]], dtype=torch.int64),
                     draft_input_ids=torch.tensor([[5, 6, 7]], dtype=torch.int32))
        if i % 2:
            extra["draft_logits"] = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(i))
        requests.append(make_request(i, prompts[i], **extra))
    client = Client(requests)
    run(engine_dir, client, params(400, prompt_lookup=0))
    for i in range(6):
        tensors, _, err = client.final(i)
        assert err == ""
        assert tensors[tensor_names.SEQUENCE_LENGTH].tolist() == [[len(prompts[i]) + NUM_NEW_TOKENS]]


@pytest.mark.parametrize("extra, optional, message", [
    ({"draft_input_ids": torch.tensor([[1, 2]], dtype=torch.int32)}, TrtGptModelOptionalParams(),
     "draft_input_ids: 2 draft tokens exceed max_draft_tokens=0 (set max_draft_tokens"),
    ({"draft_input_ids": torch.tensor([[1, 2, 3, 4, 5]], dtype=torch.int32)}, None,
     "draft_input_ids: 5 draft tokens exceed max_draft_tokens=4"),
    ({"draft_input_ids": torch.tensor([[1, VOCAB]], dtype=torch.int32)}, None,
     f"draft_input_ids: token ids must be in [0, {VOCAB}), got {VOCAB}"),
    ({"draft_input_ids": torch.tensor([[1, 2]], dtype=torch.int32), "draft_logits": torch.zeros(3, VOCAB)}, None,
     f"draft_logits: expected shape [2, {VOCAB}]"),
    ({"draft_input_ids": torch.tensor([[1]], dtype=torch.int32),
      "draft_logits": torch.full((1, VOCAB), float("nan"))}, None, "draft_logits: must be finite"),
    ({"draft_logits": torch.zeros(1, VOCAB)}, None, "draft_logits: given without draft_input_ids"),
    ({"draft_input_ids": torch.tensor([[1, 2]], dtype=torch.int32), "beam_width": torch.tensor([[2]])}, None,
     "draft_input_ids: draft tokens need beam width 1, got 2"),
])
def test_bad_drafts_get_an_error_naming_the_field(tiny_engine, prompts, references, extra, optional, message):
    engine_dir, _ = tiny_engine
    client = Client([make_request(1, prompts[1], **extra), make_request(2, prompts[2])])
    with GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 2, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *client.callbacks(), optional_params=optional or params(400)):
        client.wait()
    assert message in client.final(1)[2]
    assert client.final(2)[0][tensor_names.OUTPUT_IDS][0, 0].tolist() == references[2]


@pytest.mark.parametrize("field, value", [("max_draft_tokens", -1), ("max_draft_tokens", 1.5)])
def test_bad_draft_options_are_refused(tiny_engine, field, value):
    client = Client([])
    with pytest.raises(ValueError, match=f"TrtGptModelOptionalParams.{field}: must be an integer >= 0"):
        GptManager(tiny_engine[0], TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                   *client.callbacks(), optional_params=TrtGptModelOptionalParams(**{field: value}))


# -- KV rollback at the scheduler: data in, data out ---------------------------------------------------

def scheduler(num_blocks=16, reuse=False) -> Scheduler:
    kv = KvCacheManager(num_blocks, 4, enable_block_reuse=reuse)
    return Scheduler(kv, GuaranteedNoEvictScheduler(kv, 8), MicroBatchScheduler(8, 64))


def drafting_request(request_id, prompt, drafts, max_new_tokens=8) -> LlmRequest:
    return LlmRequest(request_id, RequestSpec(prompt, max_new_tokens, DecodingParams(), draft_tokens=tuple(drafts)),
                      arrival_index=request_id)


def test_rejected_drafts_are_rolled_back_and_never_cached():
    s = scheduler(reuse=True)
    s.add(drafting_request(1, [10, 11, 12, 13, 14, 15], [16, 17, 18, 19, 20, 21]))
    step, _ = s.schedule()
    (r,) = step.context_requests
    assert r.token_ids == ((10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21),) and r.num_draft_tokens == 6
    assert r.block_tables == ((0, 1, 2),)                  # 12 tokens: room for every draft
    # Drafts 16, 17 accepted, then the model's own 30: 9 tokens, 8 of them computed.
    s.update(step, StepResult((RequestResult(1, DecodeOutcome((16, 17, 30), num_accepted_drafts=2)),)))
    req = s.get(1)
    assert (req.generated, req.num_computed_tokens, req.draft_tokens) == ([16, 17, 30], 8, [])
    assert s.kv.block_table(1) == [0, 1, 2]                 # 9 tokens still need 3 blocks
    # Only the 2 full blocks of computed, accepted tokens are cached: never one with 18..21.
    assert s.kv.num_stored_tokens(1) == 8
    assert s.kv.find_cached_prefix([10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 0]) == [0, 1]
    assert (s.num_draft_tokens_proposed, s.num_draft_tokens_accepted) == (6, 2)


def test_a_rejection_frees_the_blocks_past_the_new_length():
    s = scheduler()
    s.add(drafting_request(1, [1, 2, 3], [4, 5, 6, 7, 8, 9], max_new_tokens=9))
    step, _ = s.schedule()
    assert step.context_requests[0].block_tables == ((0, 1, 2),)   # 3 + 6 tokens
    free_before = s.kv.num_free_blocks
    s.update(step, StepResult((RequestResult(1, DecodeOutcome((40,))),)))
    assert s.kv.block_table(1) == [0]                              # 4 tokens: one block
    assert s.kv.num_free_blocks == free_before + 2
    s.kv.check_invariants()


def test_drafts_are_clipped_to_the_tokens_left():
    s = scheduler()
    s.add(drafting_request(1, [1, 2, 3], [4, 5, 6, 7], max_new_tokens=3))
    step, _ = s.schedule()
    assert step.context_requests[0].num_draft_tokens == 2          # 2 drafts + 1 token = max_new_tokens


def test_the_drafter_rests_above_its_batch_size():
    """prompt_lookup_max_batch_size: drafts only while at most that many requests generate."""
    kv = KvCacheManager(64, 4)
    s = Scheduler(kv, GuaranteedNoEvictScheduler(kv, 8), MicroBatchScheduler(8, 64), prompt_lookup_num_tokens=3,
                  max_matching_ngram_size=2, prompt_lookup_max_batch_size=2)
    for i in range(3):
        s.add(LlmRequest(i, RequestSpec([5, 6, 7, 5, 6], 8, DecodingParams()), arrival_index=i))
    step, _ = s.schedule()
    s.update(step, StepResult(tuple(RequestResult(i, DecodeOutcome((7,))) for i in range(3))))
    step, _ = s.schedule()                      # 3 generating > 2: no drafts
    assert [r.num_draft_tokens for r in step.generation_requests] == [0, 0, 0]
    s.stop(2)
    s.update(step, StepResult(tuple(RequestResult(i, DecodeOutcome((5,))) for i in range(3))))
    s.pop_finished()
    step, _ = s.schedule()                      # 2 generating: prompt lookup proposes [6, 7, 5]
    assert [r.drafts for r in step.generation_requests] == [(6, 7, 5), (6, 7, 5)]
