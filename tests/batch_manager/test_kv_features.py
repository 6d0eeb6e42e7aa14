"""KV-cache features end to end: block reuse, chunked context, attention window with sink tokens,
overlapped micro-batches. Each leaves the greedy tokens equal to transformers (with the
window/sink mask where one is set), and each shows its effect in the stats."""
from __future__ import annotations

import json
import random

import threading

import pytest
import torch

from batch_manager import (GptManager, KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType,
                           tensor_names)
from runtime.cache.kv_cache_manager import max_blocks_held
from tests.batch_manager.conftest import NUM_NEW_TOKENS, Client, make_request, inject_faults

SYSTEM_PROMPT = [(7 * i + 3) % 120 + 3 for i in range(24)]   # 6 blocks of 4 tokens


def greedy(model, prompt: list[int], num_new_tokens: int, window: int | None = None, sink: int = 0) -> list[int]:
    """transformers greedy tokens (prompt + generated); with a window, a full recompute per
    token under the mask k <= q and (k > q - window or k < sink)."""
    if window is None:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=num_new_tokens, min_new_tokens=num_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        return ids[0].tolist()
    tokens = list(prompt)
    for _ in range(num_new_tokens):
        n = len(tokens)
        q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
        mask = torch.zeros(n, n).masked_fill(~((k <= q) & ((k > q - window) | (k < sink))), float("-inf"))
        with torch.no_grad():
            tokens.append(int(model(torch.tensor([tokens]), attention_mask=mask[None, None]).logits[0, -1].argmax()))
    return tokens


@pytest.fixture(scope="module")
def shared_prompts():
    """request id -> prompt: most share SYSTEM_PROMPT, a few do not."""
    rng = random.Random(1)
    out = {}
    for i in range(14):
        suffix = [rng.randrange(3, 128) for _ in range(rng.randrange(1, 12))]
        out[i] = suffix + SYSTEM_PROMPT[:8] if i % 5 == 4 else SYSTEM_PROMPT + suffix
    return out


@pytest.fixture(scope="module")
def shared_references(tiny_engine, shared_prompts):
    _, model = tiny_engine
    return {i: greedy(model, p, NUM_NEW_TOKENS) for i, p in shared_prompts.items()}


def run(engine_dir, client: Client, params: TrtGptModelOptionalParams,
        model_type=TrtGptModelType.InflightFusedBatching, policy=SchedulerPolicy.GUARANTEED_NO_EVICT) -> GptManager:
    with GptManager(engine_dir, model_type, 1, policy, *client.callbacks(), optional_params=params) as manager:
        client.wait()
    return manager


def outputs(client: Client, ids) -> dict[int, list[int]]:
    out = {}
    for i in ids:
        tensors, _, err = client.final(i)
        assert err == "", err
        out[i] = tensors[tensor_names.OUTPUT_IDS][0, 0].tolist()
    return out


def assert_all_blocks_free(manager: GptManager) -> None:
    kv = manager.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks


# -- block reuse ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", [SchedulerPolicy.GUARANTEED_NO_EVICT, SchedulerPolicy.MAX_UTILIZATION])
@pytest.mark.parametrize("model_type", [TrtGptModelType.InflightFusedBatching, TrtGptModelType.InflightBatching])
def test_reuse_of_a_shared_system_prompt_keeps_outputs_and_skips_context(tiny_engine, shared_prompts,
                                                                           shared_references, policy, model_type):
    engine_dir, _ = tiny_engine
    ids = sorted(shared_prompts)
    computed = {}
    for reuse in (False, True):
        client = Client([make_request(i, shared_prompts[i]) for i in ids], [2 * i for i in ids])
        params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=160, enable_block_reuse=reuse))
        manager = run(engine_dir, client, params, model_type, policy)
        assert outputs(client, ids) == {i: shared_references[i] for i in ids}
        assert_all_blocks_free(manager)
        stats = [json.loads(s) for s in client.stats]
        computed[reuse] = sum(s["Total Context Tokens"] for s in stats)
        last = stats[-1]
        assert last["Allocated total KV cache blocks"] == \
            last["Allocated new KV cache blocks"] + last["Reused KV cache blocks"]
        if reuse:
            assert last["Reused KV cache blocks"] >= 6 * 8      # most requests reuse the 6 system blocks
            assert manager.kv_cache_manager.num_cached_free_blocks > 0
        else:
            assert last["Reused KV cache blocks"] == 0
    assert computed[True] <= computed[False] - 6 * 4 * 8


def test_a_prefix_shared_with_a_request_still_running(tiny_engine, shared_prompts, shared_references):
    engine_dir, model = tiny_engine
    long_reference = greedy(model, shared_prompts[0], 40)
    client = Client([make_request(0, shared_prompts[0], max_new_tokens=40), make_request(1, shared_prompts[1])],
                    [0, 6])
    params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=400, enable_block_reuse=True))
    sharing = []
    with GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *client.callbacks(), optional_params=params) as manager:
        kv = manager.kv_cache_manager
        original = manager.worker.scheduler.capacity.schedule

        def schedule(*args):
            out = original(*args)
            if kv.holds(0) and kv.holds(1):
                sharing.append([kv.ref_count(b) for b in kv.block_table(1)[:6]])
            return out
        manager.worker.scheduler.capacity.schedule = schedule
        client.wait()
    assert sharing and sharing[0] == [2] * 6            # both hold the 6 system-prompt blocks
    assert outputs(client, [0, 1]) == {0: long_reference, 1: shared_references[1]}
    assert_all_blocks_free(manager)


def test_reuse_with_a_tight_pool_evicts_and_stays_exact(tiny_engine, shared_prompts, shared_references):
    engine_dir, _ = tiny_engine
    ids = sorted(shared_prompts)
    client = Client([make_request(i, shared_prompts[i]) for i in ids], [3 * i for i in ids])
    params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=48, enable_block_reuse=True))
    manager = run(engine_dir, client, params, policy=SchedulerPolicy.MAX_UTILIZATION)
    assert outputs(client, ids) == {i: shared_references[i] for i in ids}
    assert_all_blocks_free(manager)


# -- chunked context -----------------------------------------------------------------------------------

@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("max_num_tokens", [5, 16])
def test_chunked_context_keeps_outputs_and_the_token_budget(tiny_engine, prompts, references, max_num_tokens, reuse):
    engine_dir, _ = tiny_engine
    ids = sorted(prompts)[:10]
    client = Client([make_request(i, prompts[i]) for i in ids], [3 * i for i in ids])
    params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=400, enable_block_reuse=reuse),
                                       enable_chunked_context=True, max_num_tokens=max_num_tokens)
    manager = run(engine_dir, client, params)
    assert outputs(client, ids) == {i: references[i] for i in ids}
    stats = [json.loads(s) for s in client.stats]
    assert all(s["Total Context Tokens"] + s["Generation Requests"] <= max_num_tokens for s in stats)
    assert max(len(prompts[i]) for i in ids) > max_num_tokens    # some prompt really was chunked
    assert_all_blocks_free(manager)


# -- attention window and sink tokens ------------------------------------------------------------------

@pytest.mark.parametrize("window, sink", [(8, 4), (6, 0), (13, 2)])
def test_window_and_sinks_equal_the_masked_reference(tiny_engine, prompts, window, sink):
    engine_dir, model = tiny_engine
    ids = sorted(prompts)[:6]
    client = Client([make_request(i, prompts[i]) for i in ids], [2 * i for i in ids])
    params = TrtGptModelOptionalParams(
        kv_cache_config=KvCacheConfig(max_tokens=400, max_attention_window=window, sink_token_length=sink),
        enable_chunked_context=True, max_num_tokens=20)
    manager = run(engine_dir, client, params)
    got = outputs(client, ids)
    for i in ids:
        assert got[i] == greedy(model, prompts[i], NUM_NEW_TOKENS, window, sink), f"request {i}"
    assert_all_blocks_free(manager)


def test_window_bounds_the_blocks_of_a_long_generation(tiny_engine):
    engine_dir, model = tiny_engine
    prompt, window, sink, num_new = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41], 8, 4, 86   # 96 = max_seq_len
    client = Client([make_request(0, prompt, max_new_tokens=num_new)])
    params = TrtGptModelOptionalParams(
        kv_cache_config=KvCacheConfig(max_tokens=96, max_attention_window=window, sink_token_length=sink))
    manager = run(engine_dir, client, params)
    assert outputs(client, [0])[0] == greedy(model, prompt, num_new, window, sink)
    bound = max_blocks_held(len(prompt), len(prompt) + num_new, 4, window, sink)
    assert bound == 1 + 5 + 1                            # vs 24 blocks for 96 tokens without a window
    used = [json.loads(s)["Used KV cache blocks"] for s in client.stats]
    # (no stats after the last step: nothing is active then)
    assert len(used) == num_new - 1 and max(used) <= bound and used[-1] <= 1 + 3 + 1
    assert_all_blocks_free(manager)


def test_window_lets_guaranteed_no_evict_admit_more(tiny_engine, prompts):
    engine_dir, _ = tiny_engine
    ids = sorted(prompts)[:8]
    concurrency = {}
    for window in (None, 8):
        client = Client([make_request(i, prompts[i], max_new_tokens=40) for i in ids])
        params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=96, max_attention_window=window))
        manager = run(engine_dir, client, params)
        concurrency[window] = max(json.loads(s)["Scheduled Requests"] for s in client.stats)
        assert_all_blocks_free(manager)
    assert concurrency[8] > concurrency[None]


# -- overlap -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", [TrtGptModelType.InflightFusedBatching, TrtGptModelType.InflightBatching])
@pytest.mark.parametrize("policy", [SchedulerPolicy.GUARANTEED_NO_EVICT, SchedulerPolicy.MAX_UTILIZATION])
def test_overlap_keeps_outputs(tiny_engine, prompts, references, model_type, policy):
    engine_dir, _ = tiny_engine
    ids = sorted(prompts)
    client = Client([make_request(i, prompts[i], streaming=i % 3 == 0) for i in ids], [i for i in ids])
    params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=160), enable_trt_overlap=True)
    manager = run(engine_dir, client, params, model_type, policy)
    for i in ids:
        tokens = [t for tensors, _, _ in client.responses[i] for t in tensors[tensor_names.OUTPUT_IDS][0, 0].tolist()]
        assert tokens == (references[i][len(prompts[i]):] if i % 3 == 0 else references[i]), f"request {i}"
    stats = [json.loads(s) for s in client.stats]
    assert {s["MicroBatch ID"] for s in stats} == {0, 1}
    assert_all_blocks_free(manager)


def test_overlap_stop_signal_for_a_request_in_flight(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    client = Client([make_request(0, prompts[0], max_new_tokens=60, streaming=True),
                     make_request(1, prompts[1])])
    original_send = client.send

    def send(request_id, tensors, is_final, err):
        original_send(request_id, tensors, is_final, err)
        if request_id == 0 and len(client.responses[0]) == 3:
            client.stop_ids |= {0}
    client.send = send
    params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=400), enable_trt_overlap=True)
    manager = run(engine_dir, client, params)
    chunks = client.responses[0]
    assert sum(1 for c in chunks if c[1]) == 1 and chunks[-1][1] and chunks[-1][2] == ""
    tokens = [t for tensors, _, _ in chunks for t in tensors[tensor_names.OUTPUT_IDS][0, 0].tolist()]
    assert 3 <= len(tokens) < 60 and tokens[:NUM_NEW_TOKENS] == references[0][len(prompts[0]):][:len(tokens)]
    assert outputs(client, [1])[1] == references[1]
    assert_all_blocks_free(manager)


@pytest.mark.parametrize("policy", [SchedulerPolicy.GUARANTEED_NO_EVICT, SchedulerPolicy.MAX_UTILIZATION])
def test_every_feature_together(tiny_engine, shared_prompts, policy):
    engine_dir, model = tiny_engine
    ids = sorted(shared_prompts)
    client = Client([make_request(i, shared_prompts[i]) for i in ids], [2 * i for i in ids])
    params = TrtGptModelOptionalParams(
        kv_cache_config=KvCacheConfig(max_tokens=200, enable_block_reuse=True, max_attention_window=12,
                                      sink_token_length=4),
        enable_chunked_context=True, max_num_tokens=16, enable_trt_overlap=True)
    manager = run(engine_dir, client, params, policy=policy)
    got = outputs(client, ids)
    for i in ids:
        assert got[i] == greedy(model, shared_prompts[i], NUM_NEW_TOKENS, 12, 4), f"request {i}"
    assert json.loads(client.stats[-1])["Reused KV cache blocks"] > 0
    assert_all_blocks_free(manager)


def test_overlap_a_forward_failing_on_its_thread_fails_only_its_requests(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    client = Client([make_request(i, prompts[i]) for i in range(4)], [0, 0, 20, 20])
    params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=400), enable_trt_overlap=True)
    manager = GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                         *client.callbacks(), optional_params=params)
    failed = []

    def forward(group):   # runs on the forward thread, before the group's forward
        assert threading.current_thread().name.startswith("GptManagerForward")
        if not failed and any(r.request_id == 0 and r.new is None for r in group):
            failed.append([r.request_id for r in group])
            raise RuntimeError("injected fault")
    inject_faults(manager, forward)
    with manager:
        client.wait()
    assert failed and 0 in failed[0]
    for i in range(4):
        tensors, final, err = client.final(i)
        if i in failed[0]:
            assert tensors == {} and "injected fault" in err
        else:
            assert err == "" and tensors[tensor_names.OUTPUT_IDS][0, 0].tolist() == references[i]
    assert_all_blocks_free(manager)
