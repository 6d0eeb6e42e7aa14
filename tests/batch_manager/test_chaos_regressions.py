"""Bugs the chaos soak (samples.chaos_soak) found, each reproduced through GptManager."""
from __future__ import annotations

import pytest
import torch

from batch_manager import GptManager, SchedulerPolicy, TrtGptModelType, tensor_names
from tests.batch_manager.conftest import Client, make_request, inject_faults
from tests.batch_manager.test_gpt_manager import small_pool

BEAM = dict(beam_width=torch.tensor([3], dtype=torch.int32))


def run(engine_dir, client: Client, max_beam_width: int = 4) -> GptManager:
    manager = GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, max_beam_width,
                         SchedulerPolicy.GUARANTEED_NO_EVICT, *client.callbacks(), optional_params=small_pool())
    with manager:
        client.wait()
    return manager


@pytest.mark.parametrize("pad_id", [1 << 40, (1 << 63) - 1, -(1 << 31) - 1])
def test_a_pad_id_outside_int32_is_refused_and_the_worker_lives_on(tiny_engine, prompts, references, pad_id):
    """Was: accepted, then writing it into the int32 beam output raised in the worker loop,
    which died and failed every other request (and the soak's later ones hung unanswered)."""
    engine_dir, _ = tiny_engine
    bad = make_request(0, prompts[0], max_new_tokens=3, pad_id=torch.tensor([pad_id], dtype=torch.int64), **BEAM)
    client = Client([bad, make_request(1, prompts[1])])
    manager = run(engine_dir, client)
    tensors, _, err = client.final(0)
    assert tensors == {} and "pad_id" in err
    assert client.final(1)[0][tensor_names.OUTPUT_IDS][0, 0].tolist() == references[1]
    assert manager.kv_cache_manager.num_free_blocks == manager.kv_cache_manager.num_blocks


def test_a_beam_request_stopped_before_its_first_step_still_has_every_beam(tiny_engine, prompts):
    """Was: output_ids [1, 1, T] and sequence_length [1, 1] for a beam-3 request stopped (or
    failed) before any decoding step: the beam dimension must be beam_width (API.md)."""
    engine_dir, _ = tiny_engine
    client = Client([make_request(0, prompts[0], max_new_tokens=8, **BEAM)])
    client.stop_ids = {0}    # polled in the iteration that admits it, before its first step
    run(engine_dir, client)
    tensors, _, err = client.final(0)
    assert err == ""
    assert tensors[tensor_names.OUTPUT_IDS].shape == (1, 3, len(prompts[0]))
    assert tensors[tensor_names.SEQUENCE_LENGTH].tolist() == [[len(prompts[0])] * 3]
    assert tensors[tensor_names.CUM_LOG_PROBS].shape == (1, 3)


def test_a_response_that_cannot_be_built_fails_only_its_request(tiny_engine, prompts, references, monkeypatch):
    """Defence in depth: an exception while building one response is that request's error, not
    the worker's death."""
    from batch_manager.legacy import front_end as worker_module   # where GptManager builds its responses
    build = worker_module.response_tensors

    def fragile(spec, output, start, exclude_input_in_output):
        if output.request_id == 0:
            raise RuntimeError("cannot build")
        return build(spec, output, start, exclude_input_in_output)
    monkeypatch.setattr(worker_module, "response_tensors", fragile)
    client = Client([make_request(0, prompts[0], streaming=True), make_request(1, prompts[1]),
                     make_request(2, prompts[2], streaming=True)])
    manager = run(tiny_engine[0], client)
    tensors, _, err = client.final(0)
    assert tensors == {} and "cannot build" in err and len(client.responses[0]) == 1
    assert client.final(1)[0][tensor_names.OUTPUT_IDS][0, 0].tolist() == references[1]
    streamed = [t for tensors, _, _ in client.responses[2] for t in tensors[tensor_names.OUTPUT_IDS][0, 0].tolist()]
    assert streamed == references[2][len(prompts[2]):]
    assert manager.get_num_active_requests() == 0
    assert manager.kv_cache_manager.num_free_blocks == manager.kv_cache_manager.num_blocks


def test_overlap_a_group_failing_while_prepared_is_completed_once(tiny_engine, prompts, references):
    """Was: with overlap and InflightBatching (a context and a generation group per step), a
    group failing while prepared was completed at once and again when its micro-batch's
    responses went out: a KeyError killed the worker (or, with the id reused meanwhile, the
    new request would have been dropped)."""
    engine_dir, _ = tiny_engine
    client = Client([make_request(i, prompts[i]) for i in range(8)], [0, 0, 0, 0, 6, 6, 6, 6])
    params = small_pool(400)
    params.enable_trt_overlap = True
    manager = GptManager(engine_dir, TrtGptModelType.InflightBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                         *client.callbacks(), optional_params=params)
    failed = []

    def inject(group):   # a context group with a later request
        if not failed and any(r.request_id >= 4 for r in group) and group[0].new is not None:
            failed.extend(r.request_id for r in group)
            raise RuntimeError("injected fault")
    inject_faults(manager, inject)
    with manager:
        client.wait()
    assert failed
    for i in range(8):
        tensors, _, err = client.final(i)
        if i in failed:
            assert tensors == {} and "injected fault" in err
        else:
            assert err == "" and tensors[tensor_names.OUTPUT_IDS][0, 0].tolist() == references[i]
    assert manager.kv_cache_manager.num_free_blocks == manager.kv_cache_manager.num_blocks
