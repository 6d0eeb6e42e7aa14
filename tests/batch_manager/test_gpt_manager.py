"""End-to-end GptManager tests on a tiny real checkpoint, against transformers' greedy generate."""
from __future__ import annotations

import json
import random
import threading
import time

import pytest
import torch

from batch_manager import (GptManager, KvCacheConfig, SchedulerConfig, SchedulerPolicy, TrtGptModelOptionalParams,
                           TrtGptModelType, tensor_names)
from tests.batch_manager.conftest import NUM_NEW_TOKENS, Client, make_request, wait_until, inject_faults


def small_pool(max_tokens: int = 160) -> TrtGptModelOptionalParams:
    return TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=max_tokens))


def run_to_completion(engine_dir, client: Client, model_type=TrtGptModelType.InflightFusedBatching,
                      policy=SchedulerPolicy.GUARANTEED_NO_EVICT, params=None, **kwargs) -> GptManager:
    manager = GptManager(engine_dir, model_type, 1, policy, *client.callbacks(),
                         optional_params=params or small_pool(), **kwargs)
    with manager:
        client.wait()
    return manager


@pytest.mark.parametrize("model_type", list(TrtGptModelType))
@pytest.mark.parametrize("policy", list(SchedulerPolicy))
def test_batching_never_changes_results(tiny_engine, prompts, references, model_type, policy):
    engine_dir, _ = tiny_engine
    rng = random.Random(int(model_type) * 10 + int(policy))
    ids = list(prompts)
    rng.shuffle(ids)
    arrivals = sorted(rng.randrange(0, 40) for _ in ids)
    client = Client([make_request(i, prompts[i]) for i in ids], arrivals)
    # 40 blocks of 4 tokens: fewer than the requests want at once, so requests queue or pause.
    manager = run_to_completion(engine_dir, client, model_type, policy, small_pool(160))
    for i in ids:
        tensors, _, err = client.final(i)
        assert err == ""
        assert tensors[tensor_names.OUTPUT_IDS][0, 0].tolist() == references[i], f"request {i}"
        assert tensors[tensor_names.SEQUENCE_LENGTH].tolist() == [[len(references[i])]]
    kv = manager.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_invariants()
    stats = [json.loads(s) for s in client.stats]
    if policy == SchedulerPolicy.MAX_UTILIZATION and model_type != TrtGptModelType.V1:
        assert sum(s["Paused Requests"] for s in stats) > 0, "the small pool should force pauses"
    if policy == SchedulerPolicy.GUARANTEED_NO_EVICT and model_type != TrtGptModelType.V1:
        assert any(s["Scheduled Requests"] < s["Active Request Count"] for s in stats), "requests should queue"
        assert all(s["Paused Requests"] == 0 for s in stats)


def test_streaming_chunks_concatenate_to_the_reference(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    ids = list(prompts)[:6]
    client = Client([make_request(i, prompts[i], streaming=True) for i in ids])
    run_to_completion(engine_dir, client)
    for i in ids:
        chunks = client.responses[i]
        assert [final for _, final, _ in chunks] == [False] * (len(chunks) - 1) + [True]
        tokens = [t for tensors, _, _ in chunks for t in tensors[tensor_names.OUTPUT_IDS][0, 0].tolist()]
        assert tokens == references[i][len(prompts[i]):]
        for tensors, _, _ in chunks:
            assert tensors[tensor_names.SEQUENCE_LENGTH].item() == tensors[tensor_names.OUTPUT_IDS].shape[2]


def test_exclude_input_in_output(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    client = Client([make_request(i, prompts[i]) for i in (0, 1)])
    run_to_completion(engine_dir, client, exclude_input_in_output=True)
    for i in (0, 1):
        tensors, _, _ = client.final(i)
        assert tensors[tensor_names.OUTPUT_IDS][0, 0].tolist() == references[i][len(prompts[i]):]


def test_end_id_stops_generation(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    generated = references[0][len(prompts[0]):]
    end_id = generated[4]
    first = generated.index(end_id)
    client = Client([make_request(0, prompts[0], end_id=torch.tensor([end_id], dtype=torch.int32))])
    run_to_completion(engine_dir, client)
    tensors, _, _ = client.final(0)
    assert tensors[tensor_names.OUTPUT_IDS][0, 0].tolist() == prompts[0] + generated[:first]


def test_all_six_output_tensors_with_logits_and_log_probs(tiny_engine, prompts, references):
    engine_dir, model = tiny_engine
    flag = torch.tensor([True])
    client = Client([make_request(0, prompts[0], return_log_probs=flag, return_context_logits=flag,
                                  return_generation_logits=flag), make_request(1, prompts[1])])
    run_to_completion(engine_dir, client)
    tensors, _, _ = client.final(0)
    full = torch.tensor([references[0]])
    with torch.no_grad():
        ref_logits = model(full).logits[0]
    n = len(prompts[0])
    torch.testing.assert_close(tensors[tensor_names.CONTEXT_LOGITS][0], ref_logits[:n], atol=1e-4, rtol=0)
    torch.testing.assert_close(tensors[tensor_names.GENERATION_LOGITS][0, 0], ref_logits[n - 1:-1], atol=1e-4, rtol=0)
    ref_log_probs = torch.log_softmax(ref_logits[n - 1:-1], -1).gather(1, full[0, n:, None])[:, 0]
    torch.testing.assert_close(tensors[tensor_names.OUTPUT_LOG_PROBS][0, 0], ref_log_probs, atol=1e-4, rtol=0)
    torch.testing.assert_close(tensors[tensor_names.CUM_LOG_PROBS], ref_log_probs.sum().view(1, 1), atol=1e-3, rtol=0)
    dummies, _, _ = client.final(1)
    assert dummies[tensor_names.CONTEXT_LOGITS].shape == (1, 1, 1)
    assert dummies[tensor_names.GENERATION_LOGITS].shape == (1, 1, 1, 1)
    assert dummies[tensor_names.OUTPUT_LOG_PROBS].shape == (1, 1, NUM_NEW_TOKENS)
    assert not dummies[tensor_names.OUTPUT_LOG_PROBS].any() and not dummies[tensor_names.CUM_LOG_PROBS].any()


def test_stop_signal_mid_stream_returns_what_was_generated(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    client = Client([make_request(0, prompts[0], max_new_tokens=80, streaming=True)])
    original_send = client.send

    def send(request_id, tensors, is_final, err):
        original_send(request_id, tensors, is_final, err)
        if len(client.responses[request_id]) == 3:
            client.stop_ids |= {request_id, 12345}  # an unknown id is ignored
    client.send = send
    manager = run_to_completion(engine_dir, client)
    chunks = client.responses[0]
    assert chunks[-1][1] and sum(1 for c in chunks if c[1]) == 1
    tokens = [t for tensors, _, _ in chunks for t in tensors[tensor_names.OUTPUT_IDS][0, 0].tolist()]
    assert 3 <= len(tokens) < 80
    assert tokens[:NUM_NEW_TOKENS] == references[0][len(prompts[0]):][:len(tokens)]
    assert manager.kv_cache_manager.num_free_blocks == manager.kv_cache_manager.num_blocks


def test_stop_signal_contract_applies_to_held_ids_and_drops_the_others(tiny_engine, prompts):
    """The README's contract (TensorRT-LLM's): a stop id ends a request the manager holds, also one
    handed over by the get callback of the same iteration (stop signals are polled after it); a
    stop id the manager does not hold is dropped, not kept for a later request with that id."""
    engine_dir, _ = tiny_engine
    client = Client([make_request(5, prompts[5], max_new_tokens=20), make_request(6, prompts[6], max_new_tokens=20)],
                    arrival_calls=[3, 6])
    client.stop_ids = {5}   # polled at the first iteration, before request 5 arrives
    original_get = client.get

    def get(max_num_requests):
        requests = original_get(max_num_requests)
        if any(r.request_id == 6 for r in requests):
            client.stop_ids |= {6}   # polled in the iteration that hands request 6 over
        return requests
    client.get = get
    run_to_completion(engine_dir, client, exclude_input_in_output=True)
    lengths = {i: client.final(i)[0][tensor_names.SEQUENCE_LENGTH].item() for i in (5, 6)}
    assert lengths == {5: 20, 6: 0} and client.final(6)[2] == ""


def test_bad_requests_get_one_error_and_do_not_disturb_others(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    bad = [make_request(100, [1, 2, 500]),                          # token outside the vocab
           make_request(101, []),                                    # empty prompt
           make_request(102, prompts[2], max_new_tokens=0),
           make_request(103, prompts[3], beam_width=torch.tensor([4], dtype=torch.int32)),
           make_request(104, prompts[4], temperature=torch.tensor([float("nan")]))]
    good = [make_request(i, prompts[i]) for i in (0, 1)]
    client = Client(good[:1] + bad + good[1:])
    run_to_completion(engine_dir, client)
    for r, word in zip(bad, ["input_ids", "input_ids", "request_output_len", "beam_width", "temperature"]):
        tensors, final, err = client.final(r.request_id)
        assert tensors == {} and final and word in err, err
    for i in (0, 1):
        assert client.final(i)[0][tensor_names.OUTPUT_IDS][0, 0].tolist() == references[i]


def test_duplicate_active_id_is_rejected_and_ids_are_reusable(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    client = Client([make_request(7, prompts[0], max_new_tokens=30), make_request(7, prompts[1])], [0, 2])
    client.num_expected = 1
    with GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *client.callbacks()) as manager:
        assert wait_until(lambda: len(client.responses.get(7, [])) >= 2)
        rejected, original = client.responses[7]
        assert "already exists" in rejected[2] and rejected[1]
        assert original[2] == "" and len(original[0][tensor_names.OUTPUT_IDS][0, 0]) == len(prompts[0]) + 30
        client.pending.append(make_request(7, prompts[1]))
        client.arrival_calls.append(0)
        assert wait_until(lambda: len(client.responses[7]) == 3)
        assert client.responses[7][2][0][tensor_names.OUTPUT_IDS][0, 0].tolist() == references[1]
        assert manager.get_num_active_requests() == 0


def test_a_duplicate_of_a_streaming_id_leaves_its_stream_alone(tiny_engine, prompts, references):
    """The duplicate's refusal once reset the original's stream cursor: its next response repeated
    every token already streamed (found by the chaos soak)."""
    engine_dir, _ = tiny_engine
    client = Client([make_request(7, prompts[0], streaming=True), make_request(7, prompts[1])], [0, 5])
    with GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *client.callbacks()):
        assert wait_until(lambda: any(final and not error for _, final, error in client.responses.get(7, [])))
    refusals = [error for _, _, error in client.responses[7] if error]
    assert len(refusals) == 1 and "already exists" in refusals[0]
    streamed = [t for tensors, _, error in client.responses[7] if not error
                for t in tensors[tensor_names.OUTPUT_IDS][0, 0].tolist()]
    assert len([r for r in client.responses[7] if not r[2]]) > 2   # the duplicate came mid-stream
    assert streamed == references[0][len(prompts[0]):]


def test_raising_callbacks_are_contained(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    client = Client([make_request(i, prompts[i]) for i in range(4)], [0, 3, 6, 9])
    calls = {"get": 0, "send": 0, "stop": 0, "stats": 0}
    get, send = client.get, client.send

    def flaky_get(n):
        calls["get"] += 1
        if calls["get"] % 2 == 0:
            raise RuntimeError("get failed")
        return get(n)

    def flaky_send(*args):
        calls["send"] += 1
        send(*args)
        if calls["send"] % 2:
            raise RuntimeError("send failed")

    def flaky(name):
        def fn(*args):
            calls[name] += 1
            raise RuntimeError(f"{name} failed")
        return fn

    with GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    flaky_get, flaky_send, flaky("stop"), flaky("stats")):
        client.wait()
    for i in range(4):
        assert client.final(i)[0][tensor_names.OUTPUT_IDS][0, 0].tolist() == references[i]
    assert calls["stop"] > 0 and calls["stats"] > 0


def test_step_failure_fails_only_that_steps_requests(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    client = Client([make_request(0, prompts[0])] + [make_request(i, prompts[i]) for i in (1, 2)], [0, 30, 30])
    manager = GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                         *client.callbacks())
    failed = []

    def inject(group):   # request 0 in a generation step
        if not failed and group[0].request_id == 0 and group[0].new is None:
            failed.append(True)
            raise RuntimeError("injected fault")
    inject_faults(manager, inject)
    with manager:
        client.wait()
    tensors, final, err = client.final(0)
    assert tensors == {} and "injected fault" in err
    for i in (1, 2):
        assert client.final(i)[0][tensor_names.OUTPUT_IDS][0, 0].tolist() == references[i]
    assert manager.kv_cache_manager.num_free_blocks == manager.kv_cache_manager.num_blocks


def test_shutdown_drains_requests_in_flight(tiny_engine, prompts, references):
    engine_dir, _ = tiny_engine
    client = Client([make_request(i, prompts[i]) for i in range(6)])
    manager = GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                         *client.callbacks())
    assert wait_until(lambda: manager.get_num_active_requests() > 0)
    manager.shutdown()
    manager.shutdown()  # idempotent
    for i in range(6):
        if i in client.responses:
            assert client.final(i)[0][tensor_names.OUTPUT_IDS][0, 0].tolist() == references[i]
    assert manager.get_num_active_requests() == 0
    assert not manager.worker.thread.is_alive()


def test_idle_manager_shuts_down_promptly_and_does_not_spin(tiny_engine):
    engine_dir, _ = tiny_engine
    client = Client([])
    began = time.monotonic()
    manager = GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                         *client.callbacks())
    from batch_manager.worker import IDLE_SLEEP_S
    time.sleep(0.3)
    start = time.monotonic()
    manager.shutdown()
    print(f"shutdown of an idle manager: {(time.monotonic() - start) * 1e3:.1f} ms")
    assert time.monotonic() - start < 5   # seconds: the worker notices at its next poll (0.5-5 ms)
    # A correct worker sleeps IDLE_SLEEP_S or more between polls (x 2: margin), however slow the machine; a busy
    # loop would poll hundreds of thousands of times in 0.3 s.
    assert 1 <= client.num_get_calls <= 2 * (time.monotonic() - began) / IDLE_SLEEP_S + 20, client.num_get_calls
    assert client.stats == []  # no stats while nothing is active


def test_an_idle_manager_polls_less_once_idle_and_still_serves(tiny_engine, prompts, references):
    """0.5 ms polls while requests came in the last 0.1 s, then 5 ms ones (~6 % of a core ->
    under 1 %); a request after the backoff is served as any other. The bounds are counts per
    measured second (a slow machine polls less, never more); samples/microbench/idle_cost.py
    prints the rates and the share of a core."""
    from batch_manager.worker import IDLE_BACKOFF_AFTER_S, IDLE_BACKOFF_SLEEP_S
    engine_dir, _ = tiny_engine
    client = Client([make_request(0, prompts[0], 8)], arrival_calls=[10**9])   # held back for now
    with GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *client.callbacks()):
        time.sleep(IDLE_BACKOFF_AFTER_S + 0.1)
        before, start = client.num_get_calls, time.monotonic()
        time.sleep(0.5)
        polls, elapsed_s = client.num_get_calls - before, time.monotonic() - start
        print(f"idle polls: {polls} in {elapsed_s:.3f} s")
        # about one per IDLE_BACKOFF_SLEEP_S (a slow machine polls less, never more): not 1000 at 0.5 ms
        assert 1 <= polls <= 2 * elapsed_s / IDLE_BACKOFF_SLEEP_S + 5, (polls, elapsed_s)
        client.arrival_calls[0] = 0
        client.wait(60)
    tensors, _, error = client.final(0)
    assert not error
    assert tensors[tensor_names.OUTPUT_IDS][0, 0].tolist() == references[0][:len(prompts[0]) + 8]


def test_legacy_usage_pattern(tiny_engine, prompts, references):
    """As the old Python binding's test wrote it: positional constructor, tensor_names, [1, 1]
    max_new_tokens, stats read with json.loads, a terminate id ending the loop."""
    engine_dir, _ = tiny_engine
    remaining = {i: prompts[i] for i in range(3)}
    queue = list(remaining)
    outputs, stats = {}, []

    def fetch_requests(max_num_requests):
        requests = []
        while queue and len(requests) < max_num_requests:
            i = queue.pop(0)
            from batch_manager import InferenceRequest
            ir = InferenceRequest(i)
            ir.input_ids = torch.tensor(remaining[i], dtype=torch.int32)
            ir.max_new_tokens = torch.tensor([[NUM_NEW_TOKENS]], dtype=torch.int32)
            ir.end_id = torch.tensor([-1], dtype=torch.int32)
            ir.pad_id = torch.tensor([0], dtype=torch.int32)
            ir.beam_width = torch.tensor([1], dtype=torch.int32)
            ir.random_seed = torch.tensor([0], dtype=torch.int64)
            requests.append(ir)
        return requests

    def response_cb(req_id, tensors, is_ok, err_msg):
        assert err_msg == ""
        tensor_dict = {t.name: t.tensor for t in tensors}
        outputs[req_id] = tensor_dict[tensor_names.OUTPUT_IDS][0, 0, :].tolist()
        assert tensor_dict[tensor_names.SEQUENCE_LENGTH].item() == len(outputs[req_id])

    def should_stop():
        return set()

    def stats_cb(stats_json):
        stats.append(json.loads(stats_json))

    with GptManager(engine_dir, TrtGptModelType.InflightBatching, 1, SchedulerPolicy.MAX_UTILIZATION,
                    fetch_requests, response_cb, should_stop, stats_cb, TrtGptModelOptionalParams(), 10000):
        while len(outputs) < 3:
            time.sleep(0.01)
    assert outputs == {i: references[i] for i in range(3)}
    counters = [s["Iteration Counter"] for s in stats]
    assert counters == sorted(counters) and len(set(counters)) == len(counters)


def test_terminate_request_id_ends_the_loop(tiny_engine, prompts):
    engine_dir, _ = tiny_engine
    client = Client([make_request(0, prompts[0], max_new_tokens=60), make_request(10000, [1]),
                     make_request(1, prompts[1])], [0, 3, 3])
    manager = GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1,
                         SchedulerConfig(SchedulerPolicy.MAX_UTILIZATION), *client.callbacks(),
                         terminate_req_id=10000)
    done = threading.Event()
    threading.Thread(target=lambda: (manager.wait_until_terminate(), done.set()), daemon=True).start()
    assert done.wait(30)
    for i in (0, 1):
        tensors, final, err = client.final(i)
        assert final and "terminated" in err
    assert 10000 not in client.responses
    manager.shutdown()
    assert manager.kv_cache_manager.num_free_blocks == manager.kv_cache_manager.num_blocks


def test_logits_post_processor_forces_a_token(tiny_engine, prompts):
    engine_dir, _ = tiny_engine
    from batch_manager import InferenceRequest

    def force_42(request_id, logits, token_ids, stream, client_id):
        logits[:] = float("-inf")
        logits[..., 42] = 0

    r = InferenceRequest(0, logits_post_processor=force_42)
    r.input_ids = torch.tensor(prompts[0], dtype=torch.int32)
    r.max_new_tokens = torch.tensor([[5]], dtype=torch.int32)
    def broken(*args):
        raise RuntimeError("post-processor bug")

    failing = InferenceRequest(2, logits_post_processor=broken)
    failing.input_ids = torch.tensor(prompts[2], dtype=torch.int32)
    failing.max_new_tokens = torch.tensor([[5]], dtype=torch.int32)
    client = Client([r, make_request(1, prompts[1], max_new_tokens=5), failing])
    run_to_completion(engine_dir, client)
    assert client.final(0)[0][tensor_names.OUTPUT_IDS][0, 0].tolist()[-5:] == [42] * 5
    tensors, _, err = client.final(2)
    assert tensors == {} and "post-processor bug" in err
    assert client.final(1)[0][tensor_names.OUTPUT_IDS][0, 0].tolist()[-5:] != [42] * 5


def test_max_new_tokens_is_clamped_to_the_max_sequence_length(tiny_engine, prompts, caplog):
    engine_dir, _ = tiny_engine
    client = Client([make_request(0, prompts[0], max_new_tokens=500)])
    run_to_completion(engine_dir, client, params=TrtGptModelOptionalParams())
    tensors, _, err = client.final(0)
    assert err == "" and tensors[tensor_names.OUTPUT_IDS].shape[2] == 96
    assert any("clamped" in rec.message for rec in caplog.records)


@pytest.mark.parametrize("field, value", [("max_attention_window", 0), ("max_attention_window", 2.5),
                                          ("sink_token_length", -1)])
def test_bad_window_options_are_refused(tiny_engine, field, value):
    engine_dir, _ = tiny_engine
    with pytest.raises(ValueError, match=field):
        GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                   *Client([]).callbacks(), TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(**{field: value})))


def test_chunking_and_overlap_are_ignored_with_a_warning_for_static_batching(tiny_engine, caplog):
    engine_dir, _ = tiny_engine
    params = TrtGptModelOptionalParams(enable_chunked_context=True, enable_trt_overlap=True)
    with GptManager(engine_dir, TrtGptModelType.V1, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *Client([]).callbacks(), params) as manager:
        assert not manager.worker.scheduler.micro_batch.enable_chunked_context
        assert manager.worker.forward_pool is None
    assert any("no effect with TrtGptModelType.V1" in rec.message for rec in caplog.records)


def test_an_unreferenced_manager_is_shut_down_when_collected(tiny_engine):
    import gc
    engine_dir, _ = tiny_engine
    client = Client([])
    manager = GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                         *client.callbacks())
    thread = manager.worker.thread
    assert thread.is_alive()
    del manager
    gc.collect()
    thread.join(10)   # seconds: a collected manager stops its worker at its next poll
    assert not thread.is_alive()


def test_the_model_is_built_and_run_on_the_worker_thread(tiny_engine, monkeypatch):
    """The caller's thread runs no torch work of ours (an OpenMP pool left on it slows CPU steps)."""
    import runtime.models.transformer as model_module
    engine_dir, _ = tiny_engine
    threads = []
    original = model_module.Transformer.__init__

    def recording_init(self, *args, **kwargs):
        threads.append(threading.current_thread())
        original(self, *args, **kwargs)

    monkeypatch.setattr(model_module.Transformer, "__init__", recording_init)
    with GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *Client([]).callbacks()) as manager:
        assert threads == [manager.worker.thread]
        assert threads[0] is not threading.current_thread() and threads[0].name == "GptManagerWorker"


def test_a_failure_while_building_is_raised_by_the_constructor(tiny_engine):
    engine_dir, _ = tiny_engine
    params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=-5))
    before = threading.active_count()
    with pytest.raises(ValueError, match="KvCacheConfig.max_tokens: must be a positive integer, got -5"):
        GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                   *Client([]).callbacks(), params)
    assert wait_until(lambda: threading.active_count() == before)  # the building thread is gone


def test_an_interrupted_constructor_leaves_no_worker_running(tiny_engine, monkeypatch):
    """Ctrl-C while the worker thread builds the model: the worker, once built, stops."""
    import concurrent.futures
    engine_dir, _ = tiny_engine
    before = threading.active_count()
    real_result = concurrent.futures.Future.result

    def interrupted(self, timeout=None):
        real_result(self, timeout)  # let the build finish, then interrupt the waiting caller
        raise KeyboardInterrupt

    monkeypatch.setattr(concurrent.futures.Future, "result", interrupted, raising=True)
    with pytest.raises(KeyboardInterrupt):
        GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                   *Client([]).callbacks())
    monkeypatch.undo()
    assert wait_until(lambda: threading.active_count() == before)
