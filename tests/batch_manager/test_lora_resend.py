"""LoRA weights sent again for a task id, through GptManager and the Executor (API.md): identical
weights are a repeat, other weights are refused while the id is cached or queued (a ValueError at
enqueue naming lora_config.weights and the id; one final error response naming lora_weights),
the original adapter's outputs stay those of its peft model, and an evicted id takes new weights."""
from __future__ import annotations

import pytest
import torch

from batch_manager import PeftCacheManagerConfig, load_peft_adapter
from batch_manager.executor import Executor, ExecutorConfig, LoraConfig, OutputConfig, PeftCacheConfig, Request
from runtime import build_engine
from tests.batch_manager.executor.helpers import collect
from tests.batch_manager.test_lora import NUM_NEW, PROMPTS, check_parity, lora_request, run
from tests.factories import make_checkpoint
from tests.lora_helpers import ALL_TARGETS, SOME_TARGETS, make_peft_adapter, prompt_embeds, teacher_forced_logits


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(engine_dir, {None: base model, 1: peft model, 2: another}, {1: (weights, config), 2: ...}) on
    the tiny LLaMA."""
    root = tmp_path_factory.mktemp("lora_resend")
    base = make_checkpoint(root / "hf", "llama")
    build_engine(root / "hf", root / "engine", tokens_per_block=4, max_batch_size=8, max_input_len=48,
                 max_seq_len=64, max_num_tokens=128, gather_generation_logits=True)
    models = {None: base, 1: make_peft_adapter(base, root / "a1", 4, 8, ALL_TARGETS["llama"], seed=1),
              2: make_peft_adapter(base, root / "a2", 8, 16, SOME_TARGETS["llama"], seed=2)}
    return str(root / "engine"), models, {1: load_peft_adapter(root / "a1"), 2: load_peft_adapter(root / "a2")}


def copy(adapter):
    """The same adapter in fresh tensors."""
    weights, config = adapter
    return weights.clone(), config.clone()


def altered(adapter):
    weights, config = adapter
    weights = weights.clone()
    weights[0, 0] += 0.5
    return weights, config


def test_gpt_manager_accepts_a_repeat_and_refuses_other_weights_for_a_cached_id(setup):
    engine_dir, models, adapters = setup
    # One fetch: the first brings the weights, then the same again, other weights, the id alone.
    tasks = [(1, adapters[1]), (1, copy(adapters[1])), (1, altered(adapters[1])), (1, None), (None, None)]
    client = run(engine_dir, [lora_request(i, PROMPTS[i], task, adapter) for i, (task, adapter) in enumerate(tasks)])
    for i in (0, 1, 3):
        check_parity(client, i, PROMPTS[i], models[1])
    check_parity(client, 4, PROMPTS[4], models[None])
    responses = client.responses[2]
    assert len(responses) == 1 and responses[0][1] is True
    assert responses[0][2].startswith("lora_weights: task id 1 is cached with other weights")


def test_gpt_manager_evicted_id_takes_new_weights(setup):
    engine_dir, models, adapters = setup
    one = max(int(a[1].shape[0]) for a in adapters.values())
    # id 1 with adapter 1; id 2 (evicts the idle 1 from the host cache); id 1 again with adapter 2
    requests = [lora_request(0, PROMPTS[0], 1, adapters[1]), lora_request(1, PROMPTS[1], 2, adapters[2]),
                lora_request(2, PROMPTS[2], 1, adapters[2])]
    client = run(engine_dir, requests, arrival_calls=[0, 40, 80],
                 peft_cache_manager_config=PeftCacheManagerConfig(num_host_module_layer=one))
    check_parity(client, 0, PROMPTS[0], models[1])
    check_parity(client, 1, PROMPTS[1], models[2])
    check_parity(client, 2, PROMPTS[2], models[2])


def executor_result(responses, request_id, prompt, model) -> None:
    """The final result of `request_id` equals the teacher-forced reference of `model`."""
    finals = [r for r in responses[request_id] if r.has_error() or r.result.is_final]
    assert len(finals) == 1 and not finals[0].has_error(), finals[0].error_msg
    generated = finals[0].result.output_token_ids[0]
    assert len(generated) == NUM_NEW
    ref = teacher_forced_logits(model, prompt_embeds(model, prompt), generated)
    assert ref.argmax(-1).tolist() == generated
    torch.testing.assert_close(finals[0].result.generation_logits[0], ref, atol=2e-4, rtol=0)


def request(prompt, lora_config) -> Request:
    output = OutputConfig(return_generation_logits=True, exclude_input_from_output=True)
    return Request(prompt, NUM_NEW, output_config=output, lora_config=lora_config)


def test_executor_refuses_other_weights_at_enqueue_and_keeps_the_original_adapter(setup):
    engine_dir, models, adapters = setup
    with Executor(engine_dir, executor_config=ExecutorConfig()) as executor:
        first = executor.enqueue_request(request(PROMPTS[0], LoraConfig(1, *adapters[1])))
        # Queued or cached by now: either way the id names adapter 1's weights.
        with pytest.raises(ValueError, match=r"^lora_config\.weights: task id 1 (is cached|was sent) with other"):
            executor.enqueue_request(request(PROMPTS[1], LoraConfig(1, *altered(adapters[1]))))
        repeat = executor.enqueue_request(request(PROMPTS[1], LoraConfig(1, *copy(adapters[1]))))
        responses = collect(executor, [first, repeat])
        with pytest.raises(ValueError, match=r"^lora_config\.weights: task id 1 is cached with other weights"):
            executor.enqueue_request(request(PROMPTS[2], LoraConfig(1, *adapters[2])))
        later = executor.enqueue_request(request(PROMPTS[3], LoraConfig(1)))
        plain = executor.enqueue_request(request(PROMPTS[4], None))
        responses.update(collect(executor, [later, plain]))
    executor_result(responses, first, PROMPTS[0], models[1])
    executor_result(responses, repeat, PROMPTS[1], models[1])
    executor_result(responses, later, PROMPTS[3], models[1])
    assert not responses[plain][-1].has_error()


def test_executor_evicted_id_takes_new_weights(setup):
    engine_dir, models, adapters = setup
    one = max(int(a[1].shape[0]) for a in adapters.values())
    config = ExecutorConfig(peft_cache_config=PeftCacheConfig(num_host_module_layer=one))
    with Executor(engine_dir, executor_config=config) as executor:
        first = executor.enqueue_request(request(PROMPTS[0], LoraConfig(1, *adapters[1])))
        responses = collect(executor, [first])
        second = executor.enqueue_request(request(PROMPTS[1], LoraConfig(2, *adapters[2])))
        responses.update(collect(executor, [second]))   # id 1, idle, left the host cache for it
        third = executor.enqueue_request(request(PROMPTS[2], LoraConfig(1, *adapters[2])))
        responses.update(collect(executor, [third]))
    executor_result(responses, first, PROMPTS[0], models[1])
    executor_result(responses, second, PROMPTS[1], models[2])
    executor_result(responses, third, PROMPTS[2], models[2])
