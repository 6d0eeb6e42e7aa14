"""The field table of the sampling settings (runtime.decoding.fields) and every front door that
converts through it: each field, set alone to a value other than its default, reaches the same
DecodingParams through GptManager's tensors, the Executor's Request, GptSession's SamplingConfig,
the serving sample's body (both of its bridges); left unset, it is DecodingParams' default.
Before the table, the serving sample's Executor bridge dropped min_p (its own field map missed it)."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from batch_manager import tensor_names as tn
from batch_manager.executor import OutputConfig, Request, SamplingConfig
from batch_manager.executor.conversion import to_spec as executor_to_spec
from batch_manager.legacy.admission import to_spec
from runtime.request import AdmissionLimits
from runtime import SamplingConfig as SessionSamplingConfig
from runtime.decoding import DecodingParams
from runtime.decoding.fields import BY_PARAM, SAMPLING_FIELDS
from samples.serve.params import parse_generate_body
from tests.batch_manager.test_admission import make_request

VOCAB = 128
# A value other than the default for each field, valid alone (exact in float32: tensors carry them).
VALUES = {"beam_width": 2, "temperature": 0.5, "top_k": 5, "top_p": 0.875, "top_p_decay": 0.5, "top_p_min": 0.125,
          "top_p_reset_id": 3, "min_p": 0.25, "num_top_log_probs": 3, "num_return_sequences": 2, "min_length": 2,
          "repetition_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": 0.25, "no_repeat_ngram_size": 2,
          "length_penalty": 0.5, "early_stopping": 0, "diversity_rate": 0.5, "random_seed": 42}
# What a front door sets itself (not from the table): left out of the comparison.
PER_REQUEST = {"end_id", "normalize_log_probs", "bad_words", "stop_words", "embedding_bias", "draft_logits",
               "draft_acceptance_threshold", "guide"}


@pytest.fixture
def limits() -> AdmissionLimits:
    return AdmissionLimits(vocab_size=VOCAB, max_input_len=32, max_seq_len=64, max_beam_width=4,
                           max_num_blocks=64, tokens_per_block=4, gather_context_logits=False,
                           gather_generation_logits=False)


def settings(params: DecodingParams) -> dict:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(DecodingParams) if f.name not in PER_REQUEST}


def expected(param: str | None) -> dict:
    want = settings(DecodingParams())
    if param is not None:
        want[param] = VALUES[param]
    return want


def _tensor(field, value) -> torch.Tensor:
    dtype = torch.int64 if field.param == "random_seed" else torch.int32 if field.kind == "int" else torch.float32
    return torch.tensor([[value]], dtype=dtype)


def test_the_table_covers_every_scalar_setting():
    """A DecodingParams scalar missing from the table would be settable at no front door."""
    scalars = {f.name for f in dataclasses.fields(DecodingParams)} - PER_REQUEST
    assert {f.param for f in SAMPLING_FIELDS} == scalars == set(VALUES)
    assert {f.tensor for f in SAMPLING_FIELDS} <= tn.INPUT_NAMES


def test_each_front_door_spells_every_field_of_its_own():
    executor_args = set(inspect.signature(SamplingConfig.__init__).parameters) - {"self", "older_names"}
    assert executor_args == set(SamplingConfig.FIELDS)
    assert set(SamplingConfig.FIELDS) == {f.executor for f in SAMPLING_FIELDS if f.executor and "." not in f.executor}
    session_fields = {f.name for f in dataclasses.fields(SessionSamplingConfig)}
    assert {f.session for f in SAMPLING_FIELDS if f.session} <= session_fields


@pytest.mark.parametrize("param", [None] + list(VALUES))
def test_manager_tensors(limits, param):
    tensors = {} if param is None else {BY_PARAM[param].tensor: _tensor(BY_PARAM[param], VALUES[param])}
    r = to_spec(make_request(**tensors), limits)
    assert settings(r.decoding) == expected(param)


def executor_request(param: str | None) -> Request:
    sampling, output = {}, {}
    if param is not None:
        f = BY_PARAM[param]
        if "." in f.executor:
            output[f.executor.split(".", 1)[1]] = VALUES[param]
        else:
            sampling[f.executor] = VALUES[param]
    return Request([1, 2, 3], 4, sampling_config=SamplingConfig(**sampling), output_config=OutputConfig(**output))


@pytest.mark.parametrize("param", [None] + list(VALUES))
def test_executor_request(limits, param):
    r, _ = executor_to_spec(executor_request(param), limits, True, {}, False)
    assert settings(r.decoding) == expected(param)


@pytest.mark.parametrize("param", [None] + [f.param for f in SAMPLING_FIELDS if f.session is not None])
def test_session_sampling_config(param):
    kwargs = {} if param is None else {BY_PARAM[param].session: VALUES[param]}
    config = SessionSamplingConfig(beam_width=1, **kwargs)
    (params,) = config.decoding_params(1, end_id=2, vocab_size=VOCAB)
    assert settings(params) == expected(param)


@pytest.mark.parametrize("param", [None] + [f.param for f in SAMPLING_FIELDS if f.body is not None])
@pytest.mark.parametrize("bridge", ["manager", "executor"])
def test_serving_body(limits, param, bridge):
    """/generate's body through GptManager's tensors, or straight to the Executor bridge's Request."""
    body = {"input_ids": [1, 2, 3], "max_new_tokens": 4}
    if param is not None:
        body[BY_PARAM[param].body] = VALUES[param]
    params = parse_generate_body(body)
    if bridge == "manager":
        r = to_spec(params.to_inference_request(7), limits)
    else:
        r, _ = executor_to_spec(params.to_executor_request(), limits, True, {}, False)
    assert settings(r.decoding) == expected(param)
