"""The decoder through GptManager: seeded sampling that does not depend on the batch, its
position, the batching type or the policy; the same tokens as GptSession for the same settings;
word lists, embedding bias, log probs and the batched logits post-processor."""
from __future__ import annotations

import json
import random

import pytest
import torch

from batch_manager import (GptManager, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType, tensor_names)
from runtime import Engine, GenerationInput, GenerationOutput, GptSession, SamplingConfig, WorldConfig
from runtime.decoding import to_word_list
from tests.batch_manager.conftest import NUM_NEW_TOKENS, Client, make_request, inject_faults
from tests.batch_manager.test_gpt_manager import run_to_completion, small_pool

SEEDED = dict(temperature=torch.tensor([0.9]), runtime_top_k=torch.tensor([20], dtype=torch.int32),
              runtime_top_p=torch.tensor([0.9]), random_seed=torch.tensor([4242], dtype=torch.int64))


def mixed_settings(rng: random.Random, beams: bool = False) -> dict:
    """A random mix of decoding settings for the other requests of a batch (beam search too
    when the manager allows a beam width of 4)."""
    choice = rng.randrange(7 if beams else 6)
    if choice == 6:
        return dict(beam_width=torch.tensor([rng.randrange(2, 5)], dtype=torch.int32))
    if choice == 0:
        return {}
    if choice == 1:
        return dict(temperature=torch.tensor([rng.uniform(0.5, 1.5)]),
                    random_seed=torch.tensor([rng.randrange(1000)], dtype=torch.int64))
    if choice == 2:
        return dict(runtime_top_k=torch.tensor([rng.randrange(1, 50)], dtype=torch.int32),
                    random_seed=torch.tensor([rng.randrange(1000)], dtype=torch.int64))
    if choice == 3:
        return dict(runtime_top_p=torch.tensor([rng.uniform(0.1, 0.95)]),
                    repetition_penalty=torch.tensor([1.2]), presence_penalty=torch.tensor([0.3]))
    if choice == 4:
        return dict(no_repeat_ngram_size=torch.tensor([2], dtype=torch.int32), min_length=torch.tensor([3]))
    return dict(frequency_penalty=torch.tensor([0.5]), runtime_top_k=torch.tensor([5], dtype=torch.int32),
                random_seed=torch.tensor([rng.randrange(1000)], dtype=torch.int64))


def output_tokens(client: Client, request_id: int, prompt_len: int) -> list[int]:
    tensors, _, err = client.final(request_id)
    assert err == ""
    n = int(tensors[tensor_names.SEQUENCE_LENGTH][0, 0])
    return tensors[tensor_names.OUTPUT_IDS][0, 0, prompt_len:n].tolist()


@pytest.fixture(scope="module")
def seeded_alone(tiny_engine, prompts):
    client = Client([make_request(0, prompts[3], **SEEDED)])
    run_to_completion(tiny_engine[0], client)
    return output_tokens(client, 0, len(prompts[3]))


@pytest.mark.parametrize("model_type, policy", [
    (TrtGptModelType.InflightFusedBatching, SchedulerPolicy.GUARANTEED_NO_EVICT),
    (TrtGptModelType.InflightFusedBatching, SchedulerPolicy.MAX_UTILIZATION),
    (TrtGptModelType.InflightBatching, SchedulerPolicy.GUARANTEED_NO_EVICT),
    (TrtGptModelType.V1, SchedulerPolicy.GUARANTEED_NO_EVICT)])
def test_seeded_request_is_the_same_alone_and_in_a_mixed_batch_of_32(tiny_engine, prompts, seeded_alone,
                                                                       model_type, policy):
    rng = random.Random(int(model_type) * 7 + int(policy))
    position = rng.randrange(32)
    requests, arrivals = [], []
    for i in range(32):
        if i == position:
            requests.append(make_request(100, prompts[3], **SEEDED))
        else:
            requests.append(make_request(i, prompts[i % len(prompts)], max_new_tokens=rng.randrange(2, 16),
                                         **mixed_settings(rng, beams=True)))
        arrivals.append(rng.randrange(0, 20))
    client = Client(requests, sorted(arrivals))
    manager = run_with_beams(tiny_engine[0], client, model_type, policy, small_pool(400))
    assert output_tokens(client, 100, len(prompts[3])) == seeded_alone
    kv = manager.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_sampling_through_the_manager_equals_gpt_session(tiny_engine, prompts, seeded_alone):
    engine = Engine.from_dir(tiny_engine[0])
    session = GptSession(GptSession.Config(max_batch_size=2, max_beam_width=1, max_sequence_length=96),
                         engine.model_config, WorldConfig(), engine)
    p = prompts[3]
    out = GenerationOutput()
    session.generate(out, GenerationInput(-1, 0, torch.tensor([p], dtype=torch.int32), torch.tensor([len(p)]),
                                          max_new_tokens=NUM_NEW_TOKENS),
                     SamplingConfig(temperature=0.9, top_k=20, top_p=0.9, random_seed=4242))
    assert out.ids[0, 0, len(p):out.lengths[0, 0]].tolist() == seeded_alone


def word_list(words: list[list[int]]) -> torch.Tensor:
    """TensorRT-LLM's [1, 2, L] request format."""
    return to_word_list(words)[None]


def test_stop_words_bad_words_and_embedding_bias(tiny_engine, prompts, references):
    p, ref = prompts[5], references[5][len(prompts[5]):]
    bias = torch.zeros(1, 128)
    bias[0, 7] = 1e4  # forces token 7 everywhere
    client = Client([
        make_request(1, p, stop_words_list=word_list([[999 % 128], ref[2:4]])),
        make_request(2, p, bad_words_list=word_list([ref[:1]])),
        make_request(3, p, embedding_bias=bias),
        make_request(4, p, stop_words_list=word_list([ref[:1]]), streaming=True),
    ])
    run_to_completion(tiny_engine[0], client)
    assert output_tokens(client, 1, len(p)) == ref[:4]
    assert output_tokens(client, 2, len(p))[0] != ref[0]
    assert output_tokens(client, 3, len(p)) == [7] * NUM_NEW_TOKENS
    streamed = [t for tensors, _, _ in client.responses[4] for t in tensors[tensor_names.OUTPUT_IDS][0, 0].tolist()]
    assert streamed == ref[:1]


def test_sampled_log_probs_are_reported_and_sum_to_the_cumulative(tiny_engine, prompts):
    client = Client([make_request(1, prompts[2], return_log_probs=torch.tensor([True]), **SEEDED)])
    run_to_completion(tiny_engine[0], client)
    tensors, _, _ = client.final(1)
    log_probs = tensors[tensor_names.OUTPUT_LOG_PROBS][0, 0]
    assert log_probs.shape == (NUM_NEW_TOKENS,) and bool((log_probs <= 0).all()) and bool((log_probs < 0).any())
    assert tensors[tensor_names.CUM_LOG_PROBS][0, 0].item() == pytest.approx(log_probs.sum().item(), abs=1e-4)


def test_batched_post_processor_sees_every_opted_in_request_once_per_step(tiny_engine, prompts, references):
    calls = []

    def batched(request_ids, logits, token_ids, stream, client_ids):
        calls.append(sorted(request_ids))
        for rows in logits:
            rows[:, 9] = 1e4  # force token 9
        if 3 in request_ids and len(token_ids[request_ids.index(3)][0]) > len(prompts[3]) + 2:
            raise RuntimeError("boom")

    def make(i, opt_in, max_new_tokens):
        r = make_request(i, prompts[i], max_new_tokens=max_new_tokens)
        r.use_batched_logits_post_processor = opt_in
        return r

    # Request 3's processor call raises once it holds 3 tokens: request 1 (2 tokens) is done by then.
    client = Client([make(1, True, 2), make(2, False, 4), make(3, True, 6)])
    params = small_pool()
    params.logits_post_processor_batched = batched
    run_to_completion(tiny_engine[0], client, params=params)
    assert output_tokens(client, 1, len(prompts[1])) == [9] * 2
    assert output_tokens(client, 2, len(prompts[2])) == references[2][len(prompts[2]):][:4]
    _, _, err = client.final(3)
    assert "batched logits post-processor raised" in err and "boom" in err
    assert all(2 not in ids for ids in calls)
    assert calls[0] == [1, 3]


def test_nan_logits_are_named_in_the_no_token_error_not_blamed_on_bad_words(tiny_engine, prompts):
    def batched(request_ids, logits, token_ids, stream, client_ids):
        for request_id, rows in zip(request_ids, logits):
            if request_id == 1:
                rows.fill_(float("nan"))

    requests = [make_request(i, prompts[i], max_new_tokens=2) for i in (1, 2)]
    for r in requests:
        r.use_batched_logits_post_processor = True
    client = Client(requests)
    params = small_pool()
    params.logits_post_processor_batched = batched
    run_to_completion(tiny_engine[0], client, params=params)
    _, _, err = client.final(1)
    assert err.startswith("logits: no token is allowed at generation step 0: the logits are NaN"), err
    assert "bad_words" not in err
    assert client.final(2)[2] == ""


@pytest.mark.parametrize("tensors, message", [
    (dict(stop_words_list=torch.tensor([[1, 2], [3, -1]], dtype=torch.int32)), "stop_words_list"),
    (dict(stop_words_list=torch.tensor([[5, 6, 7], [-7, -1, -1]], dtype=torch.int32)), "stop_words_list: offsets"),
    (dict(bad_words_list=torch.tensor([[5, 6, 7], [1, -2, -1]], dtype=torch.int32)), "bad_words_list: offsets"),
    (dict(bad_words_list=torch.tensor([[[500], [1]]], dtype=torch.int32)), "bad_words_list: token id 500"),
    (dict(embedding_bias=torch.zeros(1, 5)), "embedding_bias"),
    (dict(embedding_bias=torch.full((128,), float("nan"))), "embedding_bias"),
    (dict(runtime_top_p=torch.tensor([1.5])), "runtime_top_p"),
    (dict(beam_width=torch.tensor([9], dtype=torch.int32)), "beam_width"),
])
def test_bad_decoding_inputs_get_one_error_naming_the_tensor(tiny_engine, prompts, tensors, message):
    client = Client([make_request(1, prompts[1], **tensors)])
    run_to_completion(tiny_engine[0], client)
    _, _, err = client.final(1)
    assert message in err


# --- beam search ----------------------------------------------------------------------------------

def session_beams(engine_dir, prompt, beam_width, max_new_tokens, end_id=-1, **sampling):
    engine = Engine.from_dir(engine_dir)
    session = GptSession(GptSession.Config(max_batch_size=1, max_beam_width=4, max_sequence_length=96),
                         engine.model_config, WorldConfig(), engine)
    out = GenerationOutput()
    session.generate(out, GenerationInput(end_id, 0, torch.tensor([prompt], dtype=torch.int32),
                                          torch.tensor([len(prompt)]), max_new_tokens=max_new_tokens),
                     SamplingConfig(beam_width=beam_width, **sampling))
    beams = [out.ids[0, b, len(prompt):out.lengths[0, b]].tolist() for b in range(beam_width)]
    return beams, out.cum_log_probs[0].tolist()


def run_with_beams(engine_dir, client: Client, model_type=TrtGptModelType.InflightFusedBatching,
                   policy=SchedulerPolicy.GUARANTEED_NO_EVICT, params=None) -> GptManager:
    manager = GptManager(engine_dir, model_type, 4, policy, *client.callbacks(), optional_params=params or small_pool())
    with manager:
        client.wait()
    return manager


def beam_outputs(tensors, prompt_len):
    lengths = tensors[tensor_names.SEQUENCE_LENGTH][0].tolist()
    ids = tensors[tensor_names.OUTPUT_IDS][0]
    return [ids[b, prompt_len:lengths[b]].tolist() for b in range(len(lengths))]


@pytest.mark.parametrize("model_type, policy, max_tokens", [
    (TrtGptModelType.InflightFusedBatching, SchedulerPolicy.GUARANTEED_NO_EVICT, 400),
    (TrtGptModelType.InflightFusedBatching, SchedulerPolicy.MAX_UTILIZATION, 200),
    (TrtGptModelType.InflightBatching, SchedulerPolicy.GUARANTEED_NO_EVICT, 400),
    (TrtGptModelType.V1, SchedulerPolicy.GUARANTEED_NO_EVICT, 400)])
def test_beam_search_through_the_manager_equals_gpt_session(tiny_engine, prompts, model_type, policy, max_tokens):
    """Requests of beam widths 1-4 mixed with sampled ones in one manager; a small pool under
    MAX_UTILIZATION pauses beam requests (their beams are recomputed on resume)."""
    engine_dir = tiny_engine[0]
    widths = {10: 2, 11: 3, 12: 4, 13: 1, 14: 4}
    rng = random.Random(int(model_type) + 10 * int(policy))
    requests = [make_request(i, prompts[i], max_new_tokens=10, beam_width=torch.tensor([k], dtype=torch.int32),
                             return_log_probs=torch.tensor([True]), len_penalty=torch.tensor([1.0]))
                for i, k in widths.items()]
    requests += [make_request(i, prompts[i], **mixed_settings(rng)) for i in range(6)]
    rng.shuffle(requests)
    client = Client(requests, sorted(rng.randrange(0, 10) for _ in requests))
    params = small_pool(max_tokens)
    manager = run_with_beams(engine_dir, client, model_type, policy, params)
    for i, k in widths.items():
        tensors, _, err = client.final(i)
        assert err == ""
        expected, cum = session_beams(engine_dir, prompts[i], k, 10, length_penalty=1.0)
        assert beam_outputs(tensors, len(prompts[i])) == expected, f"request {i}"
        torch.testing.assert_close(tensors[tensor_names.CUM_LOG_PROBS][0], torch.tensor(cum), atol=1e-4, rtol=0)
    kv = manager.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_invariants()
    if policy == SchedulerPolicy.MAX_UTILIZATION:
        assert sum(json.loads(s)["Paused Requests"] for s in client.stats) > 0, "the pool should force pauses"


def test_streaming_beams_carry_the_current_beams_each_step(tiny_engine, prompts):
    engine_dir = tiny_engine[0]
    client = Client([make_request(1, prompts[4], max_new_tokens=6, streaming=True,
                                  beam_width=torch.tensor([3], dtype=torch.int32))])
    run_with_beams(engine_dir, client)
    responses = client.responses[1]
    assert len(responses) >= 2 and responses[-1][1]
    for step, (tensors, _, err) in enumerate(responses[:-1]):
        assert err == ""
        beams = beam_outputs(tensors, 0)
        assert len(beams) == 3 and all(len(b) == step + 1 for b in beams)
    expected, _ = session_beams(engine_dir, prompts[4], 3, 6)
    assert beam_outputs(responses[-1][0], 0) == expected


def test_normalize_log_probs_renormalises_over_the_top_k_set(tiny_engine, prompts):
    """normalize_log_probs (the manager option): log probs of the sampled tokens under the top-k
    renormalised distribution; off: over the whole vocabulary. Same seed, same tokens."""
    settings = dict(runtime_top_k=torch.tensor([5], dtype=torch.int32), random_seed=torch.tensor([7]),
                    return_log_probs=torch.tensor([True]))
    results = {}
    for normalize in (True, False):
        client = Client([make_request(1, prompts[6], **settings)])
        params = small_pool()
        params.normalize_log_probs = normalize
        run_to_completion(tiny_engine[0], client, params=params)
        tensors, _, _ = client.final(1)
        results[normalize] = (output_tokens(client, 1, len(prompts[6])), tensors[tensor_names.OUTPUT_LOG_PROBS][0, 0])
    assert results[True][0] == results[False][0]
    assert bool((results[True][1] > results[False][1]).all())
    assert bool((results[True][1] <= 0).all())


def test_beam_generation_logits_and_log_probs_follow_each_beam(tiny_engine, prompts):
    """Gathered generation logits and log probs of a beam request: per beam, in beam order, equal
    to GptSession's for the same request."""
    engine_dir = tiny_engine[0]
    p = prompts[8]
    client = Client([make_request(1, p, max_new_tokens=5, beam_width=torch.tensor([2], dtype=torch.int32),
                                  return_generation_logits=torch.tensor([True]),
                                  return_log_probs=torch.tensor([True]))])
    run_with_beams(engine_dir, client)
    tensors, _, err = client.final(1)
    assert err == ""
    engine = Engine.from_dir(engine_dir)
    session = GptSession(GptSession.Config(max_batch_size=1, max_beam_width=2, max_sequence_length=96),
                         engine.model_config, WorldConfig(), engine)
    out = GenerationOutput()
    session.generate(out, GenerationInput(-1, 0, torch.tensor([p], dtype=torch.int32), torch.tensor([len(p)]),
                                          max_new_tokens=5), SamplingConfig(beam_width=2))
    logits = tensors[tensor_names.GENERATION_LOGITS]
    assert logits.shape == (1, 2, 5, 128)
    torch.testing.assert_close(logits[0], out.generation_logits[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(tensors[tensor_names.OUTPUT_LOG_PROBS][0], out.log_probs[0], atol=1e-4, rtol=0)
    assert not torch.equal(logits[0, 0], logits[0, 1]), "the beams diverge, so must their logits"
