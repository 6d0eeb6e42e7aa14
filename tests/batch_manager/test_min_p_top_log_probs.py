"""min-p and top log probs through GptManager and the Executor, against a direct computation from
transformers' logits of the same sequences; and min-p at the decoder: the draw equals sampling the
explicitly filtered distribution."""
from __future__ import annotations

import pytest
import torch

from batch_manager import GptManager, KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType
from batch_manager import tensor_names as tn
from batch_manager.executor import Executor, ExecutorConfig, ModelType, OutputConfig, Request, SamplingConfig
from runtime import rng
from runtime.decoding import Decoder, DecodeState, DecodingParams
from runtime.kernels import get_kernels
from runtime.kernels.torch_kernels.torch_decoder import sample
from runtime.request import RequestOutput
from tests.batch_manager.conftest import Client, make_request
from tests.batch_manager.executor.helpers import collect

NUM_TOKENS = 8


def hf_log_probs(model, sequence: list[int], prompt_len: int) -> torch.Tensor:
    """float32 [generated, V]: the model's log softmax at each generated position."""
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0].float()
    return torch.log_softmax(logits[prompt_len - 1:len(sequence) - 1], dim=-1)


def serve(engine_dir, requests):
    client = Client(requests)
    with GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *client.callbacks(), optional_params=TrtGptModelOptionalParams(
                        kv_cache_config=KvCacheConfig(max_tokens=400))):
        client.wait()
    return client


def test_top_log_probs_are_the_models_own(tiny_engine, prompts):
    engine_dir, model = tiny_engine
    ids = list(prompts)[:4]
    client = serve(engine_dir, [make_request(i, prompts[i], NUM_TOKENS, streaming=i % 2 == 1,
                                             num_top_log_probs=torch.tensor([[5]], dtype=torch.int32),
                                             temperature=torch.tensor([[0.7]]),   # processing does not enter
                                             runtime_top_k=torch.tensor([[1]], dtype=torch.int32))
                                for i in ids])
    for i in ids:
        responses = [t for t, _, err in client.responses[i] if not err]
        generated = [t for r in responses for t in r[tn.OUTPUT_IDS][0, 0].tolist()] if i % 2 else \
            responses[-1][tn.OUTPUT_IDS][0, 0].tolist()[len(prompts[i]):]
        values = torch.cat([r[tn.TOP_LOG_PROBS] for r in responses], dim=2)[0, 0]
        top_ids = torch.cat([r[tn.TOP_LOG_PROB_IDS] for r in responses], dim=2)[0, 0]
        assert values.shape == top_ids.shape == (NUM_TOKENS, 5) and top_ids.dtype == torch.int32
        expected = hf_log_probs(model, prompts[i] + generated, len(prompts[i]))
        expected_values, expected_ids = expected.topk(5, dim=-1)
        assert top_ids.tolist() == expected_ids.tolist()
        torch.testing.assert_close(values, expected_values, atol=1e-4, rtol=0)
        assert top_ids[:, 0].tolist() == generated   # top-1 (greedy) is what was generated


def test_min_p_keeps_only_tokens_above_the_threshold(tiny_engine, prompts):
    engine_dir, model = tiny_engine
    ids = list(prompts)[:6]
    client = serve(engine_dir, [make_request(i, prompts[i], NUM_TOKENS, min_p=torch.tensor([[0.2]]),
                                             random_seed=torch.tensor([[i]], dtype=torch.int64),
                                             runtime_top_p=torch.tensor([[0.999]]))
                                for i in ids])
    for i in ids:
        tensors, _, err = client.final(i)
        assert err == ""
        sequence = tensors[tn.OUTPUT_IDS][0, 0].tolist()
        log_probs = hf_log_probs(model, sequence, len(prompts[i]))
        chosen = log_probs.gather(1, torch.tensor(sequence[len(prompts[i]):])[:, None])[:, 0]
        assert bool((chosen >= log_probs.max(dim=-1).values + torch.log(torch.tensor(0.2)) - 1e-4).all())


def test_min_p_draw_equals_sampling_the_filtered_distribution():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0)) * 2
    for seed in range(40):
        state = DecodeState(DecodingParams(min_p=0.15, random_seed=seed, top_p=0.95), RequestOutput(0, [1]), 4)
        (outcome,) = Decoder(get_kernels("torch")).step([state], logits.clone())
        filtered = logits.masked_fill(torch.softmax(logits, -1) < 0.15 * torch.softmax(logits, -1).max(), float("-inf"))
        u = torch.from_numpy(rng.uniforms([seed], [0], [0]))
        token, _ = sample(filtered, torch.tensor([0]), torch.tensor([0.95]), u, torch.tensor([True]))
        assert outcome.tokens == (int(token),)


def test_executor_top_log_probs_and_min_p(tiny_engine, prompts):
    engine_dir, model = tiny_engine
    with Executor(engine_dir, ModelType.DECODER_ONLY, ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=400))) \
            as executor:
        rid = executor.enqueue_request(Request(prompts[0], max_tokens=NUM_TOKENS,
                                               sampling_config=SamplingConfig(min_p=0.3, seed=3, top_p=0.99),
                                               output_config=OutputConfig(num_top_log_probs=3,
                                                                          exclude_input_from_output=True)))
        (response,) = collect(executor, [rid])[rid]
    result = response.result
    generated = result.output_token_ids[0]
    expected = hf_log_probs(model, prompts[0] + generated, len(prompts[0]))
    assert result.top_log_prob_ids[0].tolist() == expected.topk(3, dim=-1).indices.tolist()
    torch.testing.assert_close(result.top_log_probs[0], expected.topk(3, dim=-1).values, atol=1e-4, rtol=0)


@pytest.mark.parametrize("field, value, message", [
    ("min_p", torch.tensor([[1.5]]), "min_p: 1.5 outside [0.0, 1.0]"),
    ("num_top_log_probs", torch.tensor([[65]], dtype=torch.int32), "num_top_log_probs: 65 outside [0, 64]"),
])
def test_bad_values_are_refused(tiny_engine, prompts, field, value, message):
    client = serve(tiny_engine[0], [make_request(1, prompts[1], 4, **{field: value})])
    assert message in client.final(1)[2]
