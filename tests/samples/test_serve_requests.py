"""samples.serve's parsed body (params.GenerateParams) -> each engine door's request, without an
engine: the Executor bridge builds its Request straight from the parsed values, no InferenceRequest
made on the way, with exactly the fields the former tensor detour (body -> GptManager's tensors ->
Request) gave; both doors admit the same body to the same decoding settings."""
from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
import torch

from batch_manager import GuidedDecodingParams, GuideType
from batch_manager.legacy.admission import to_spec
from runtime.request import AdmissionLimits
from batch_manager.executor import OutputConfig, Request, SamplingConfig
from batch_manager.executor.conversion import to_spec as executor_to_spec
from samples.serve import params as serve_params
from samples.serve.bridge import ManagerBridge
from samples.serve.executor_bridge import ExecutorBridge
from samples.serve.params import GenerateParams, parse_generate_body

VOCAB = 128
BIAS = [0.5, -1.25, 0.1] + [0.0] * (VOCAB - 3)
GUIDE = GuidedDecodingParams(GuideType.REGEX, "[ab]+")
F32_0_7, F32_0_9, F32_0_1 = 0.699999988079071, 0.8999999761581421, 0.10000000149011612   # float32(0.7) ...

# (name, body, num_return_sequences, the Request's fields that differ from Request(ids, max_tokens)'s
# defaults: sampling_config / output_config as their non-default attributes)
CASES = [
    ("sampling", {"input_ids": [1, 2, 3], "max_new_tokens": 5, "stream": True, "temperature": 0.7, "top_k": 5,
                  "top_p": 0.9, "seed": -1, "min_length": 2, "repetition_penalty": 1.5, "early_stopping": 0},
     1, {"streaming": True, "sampling_config": {"temperature": F32_0_7, "top_k": 5, "top_p": F32_0_9,
                                                "seed": (1 << 64) - 1, "min_tokens": 2, "repetition_penalty": 1.5,
                                                "early_stopping": 0}}),
    ("words", {"input_ids": [5], "max_new_tokens": 3, "stop_words": [[7], [8, 9]], "bad_words": [[10]],
               "end_id": 2, "pad_id": 0},
     1, {"stop_words": [[7], [8, 9]], "bad_words": [[10]], "end_id": 2, "pad_id": 0}),
    ("embedding_bias", {"input_ids": [5, 6], "max_new_tokens": 3, "embedding_bias": BIAS},
     1, {"embedding_bias": [0.5, -1.25, F32_0_1] + [0.0] * (VOCAB - 3)}),
    ("log_probs", {"input_ids": [5, 6], "max_new_tokens": 3, "return_log_probs": True, "num_top_log_probs": 3},
     1, {"output_config": {"return_log_probs": True, "num_top_log_probs": 3}}),
    ("samples", {"input_ids": [5, 6], "max_new_tokens": 3, "temperature": 1.0, "seed": 1 << 63},
     3, {"sampling_config": {"temperature": 1.0, "seed": 1 << 63, "num_return_sequences": 3},
         "guided_decoding_params": GUIDE}),
]


def parsed(body: dict, n: int) -> GenerateParams:
    params = parse_generate_body(body)
    return replace(params, num_return_sequences=n, guided_decoding_params=GUIDE) if n > 1 else params


def fields(request: Request) -> dict:
    """Request attribute -> value (tensors as lists, the configs as their non-default attributes)."""
    sampling = request.sampling_config
    out = {name: getattr(request, name) for name in Request.FIELDS}
    out["sampling_config"] = {n: getattr(sampling, n) for n in SamplingConfig.FIELDS if getattr(sampling, n) is not None
                              and (n, getattr(sampling, n)) != ("beam_width", 1)}
    out["output_config"] = {k: v for k, v in dataclasses.asdict(request.output_config).items()
                            if v != getattr(OutputConfig(exclude_input_from_output=True), k)}
    if request.embedding_bias is not None:
        assert request.embedding_bias.dtype == torch.float32
        out["embedding_bias"] = request.embedding_bias.reshape(-1).tolist()
    return out


@pytest.mark.parametrize("name, body, n, want", CASES, ids=[c[0] for c in CASES])
def test_executor_request_comes_straight_from_the_parsed_body(monkeypatch, name, body, n, want):
    params = parsed(body, n)

    def no_tensors(*_):
        raise AssertionError("the Executor's request went through GptManager's tensors")
    monkeypatch.setattr(serve_params, "InferenceRequest", no_tensors)
    monkeypatch.setattr(GenerateParams, "tensors", property(no_tensors))
    request = ExecutorBridge.build(params, 0)
    expected = fields(Request(body["input_ids"], body["max_new_tokens"],
                              output_config=OutputConfig(exclude_input_from_output=True)))
    assert fields(request) == {**expected, **want}


@pytest.mark.parametrize("name, body, n, want", CASES, ids=[c[0] for c in CASES])
def test_both_doors_admit_the_same_settings(name, body, n, want):
    limits = AdmissionLimits(vocab_size=VOCAB, max_input_len=32, max_seq_len=64, max_beam_width=4,
                             max_num_blocks=64, tokens_per_block=4, gather_context_logits=False,
                             gather_generation_logits=False)
    params = replace(parsed(body, n), guided_decoding_params=None)   # these limits compile no grammar
    manager = to_spec(ManagerBridge.build(params, 7), limits)
    executor, _ = executor_to_spec(ExecutorBridge.build(params, 0), limits, True, {}, False)
    decodings = [{**vars(spec.decoding), "embedding_bias": None if spec.decoding.embedding_bias is None
                  else spec.decoding.embedding_bias.tolist()} for spec in (manager, executor)]
    assert decodings[0] == decodings[1]
    assert (manager.prompt, manager.max_new_tokens, manager.is_streaming, manager.return_log_probs, manager.pad_id) \
        == (executor.prompt, executor.max_new_tokens, executor.is_streaming, executor.return_log_probs, executor.pad_id)


def test_the_manager_tensors_keep_the_legacy_dtypes_and_the_seed_as_int64():
    tensors = parsed(CASES[0][1], 1).tensors
    assert tensors["random_seed"].dtype == torch.int64 and tensors["random_seed"].tolist() == [-1]
    assert tensors["runtime_top_k"].dtype == torch.int32 and tensors["temperature"].dtype == torch.float32
    assert tensors["request_output_len"].tolist() == [[5]] and tensors["input_ids"].tolist() == [1, 2, 3]
    words = parsed(CASES[1][1], 1).tensors["stop_words_list"]
    assert words.tolist() == [[[7, 8, 9], [1, 3, -1]]]
    assert parsed(CASES[4][1], 3).tensors["num_return_sequences"].tolist() == [[3]]
