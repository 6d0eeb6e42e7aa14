"""Admission: every bad input of API.md is refused with a message naming the tensor (its wire
name) and the value; InferenceRequest / NamedTensor follow the legacy binding."""
from __future__ import annotations

import logging

import pytest
import torch

from batch_manager import InferenceRequest, NamedTensor, tensor_names
from runtime.request import RequestSpec
from batch_manager.legacy.admission import to_spec
from runtime.request import AdmissionLimits, RequestError

VOCAB = 128


@pytest.fixture
def limits() -> AdmissionLimits:
    return AdmissionLimits(vocab_size=VOCAB, max_input_len=32, max_seq_len=64, max_beam_width=1,
                           max_num_blocks=16, tokens_per_block=4, gather_context_logits=False,
                           gather_generation_logits=False)


def make_request(prompt=(1, 2, 3), max_new_tokens: int = 4, request_id: int = 7, **tensors) -> InferenceRequest:
    r = InferenceRequest(request_id)
    if prompt is not None:
        r.input_ids = torch.tensor(prompt, dtype=torch.int32)
    if max_new_tokens is not None:
        r.max_new_tokens = torch.tensor([[max_new_tokens]], dtype=torch.int32)
    for name, tensor in tensors.items():
        r.emplace_input_tensor(name, tensor)
    return r


def rejection(request: InferenceRequest, limits: AdmissionLimits) -> str:
    with pytest.raises(RequestError) as info:
        to_spec(request, limits)
    return str(info.value)


# -- refused requests ------------------------------------------------------------------------------

def test_missing_input_ids(limits):
    message = rejection(make_request(prompt=None), limits)
    assert "input_ids" in message and "missing" in message


def test_missing_request_output_len(limits):
    message = rejection(make_request(max_new_tokens=None), limits)
    assert "request_output_len" in message and "missing" in message


def test_emplace_unknown_tensor_name_raises():
    with pytest.raises(ValueError, match="Invalid tensor name: 'max_new_tokens'"):
        InferenceRequest(1).emplace_input_tensor("max_new_tokens", torch.tensor([[4]], dtype=torch.int32))


def test_legacy_dict_constructor_unknown_tensor_name_raises():
    with pytest.raises(ValueError, match="Invalid tensor name: 'bogus'"):
        InferenceRequest(1, {"input_ids": torch.tensor([1], dtype=torch.int32), "bogus": torch.tensor([1])})


def test_unknown_tensor_name_that_bypassed_emplace_is_refused(limits):
    r = make_request()
    r._tensors["bogus"] = torch.tensor([1])
    message = rejection(r, limits)
    assert "bogus" in message


def test_float_input_ids(limits):
    r = make_request()
    r.input_ids = torch.tensor([1.0, 2.0], dtype=torch.float32)
    message = rejection(r, limits)
    assert "input_ids" in message and "float32" in message


def test_two_row_input_ids(limits):
    r = make_request()
    r.input_ids = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    message = rejection(r, limits)
    assert "input_ids" in message and "[2, 3]" in message


def test_two_value_request_output_len(limits):
    r = make_request()
    r.max_new_tokens = torch.tensor([[4, 5]], dtype=torch.int32)
    message = rejection(r, limits)
    assert "request_output_len" in message and "[1, 2]" in message


def test_float_request_output_len(limits):
    r = make_request()
    r.max_new_tokens = torch.tensor([[4.0]], dtype=torch.float32)
    message = rejection(r, limits)
    assert "request_output_len" in message and "float32" in message


@pytest.mark.parametrize("shape", [[0], [1, 0]])
def test_empty_prompt(limits, shape):
    r = make_request()
    r.input_ids = torch.zeros(shape, dtype=torch.int32)
    message = rejection(r, limits)
    assert "input_ids" in message and "empty" in message


@pytest.mark.parametrize("bad_token", [VOCAB, VOCAB + 5, -1])
def test_token_id_outside_vocab(limits, bad_token):
    message = rejection(make_request(prompt=[1, bad_token, 2]), limits)
    assert "input_ids" in message and f"token id {bad_token} " in message and str(VOCAB) in message


@pytest.mark.parametrize("max_new_tokens", [0, -3])
def test_non_positive_request_output_len(limits, max_new_tokens):
    message = rejection(make_request(max_new_tokens=max_new_tokens), limits)
    assert "request_output_len" in message and f"got {max_new_tokens}" in message


@pytest.mark.parametrize("beam_width", [2, 0])
def test_beam_width_outside_one_to_max_beam_width(limits, beam_width):
    message = rejection(make_request(beam_width=torch.tensor([beam_width], dtype=torch.int32)), limits)
    assert "beam_width" in message and f"{beam_width} outside [1, 1]" in message


def test_prompt_longer_than_max_input_len(limits):
    message = rejection(make_request(prompt=[1] * 33), limits)
    assert "input_ids" in message and "33" in message and "32" in message


def test_nan_temperature(limits):
    message = rejection(make_request(temperature=torch.tensor([float("nan")])), limits)
    assert "temperature" in message and "nan" in message


def test_top_p_above_one(limits):
    message = rejection(make_request(runtime_top_p=torch.tensor([1.5])), limits)
    assert "runtime_top_p" in message and "1.5" in message


def test_negative_top_k(limits):
    message = rejection(make_request(runtime_top_k=torch.tensor([-1], dtype=torch.int32)), limits)
    assert "runtime_top_k" in message and "-1" in message


def test_end_id_outside_vocab(limits):
    message = rejection(make_request(end_id=torch.tensor([VOCAB], dtype=torch.int32)), limits)
    assert "end_id" in message and str(VOCAB) in message


@pytest.mark.parametrize("name, value", [("input_ids", [1, 2, 3]), ("request_output_len", 4)])
def test_non_tensor_value(limits, name, value):
    r = make_request()
    r.emplace_input_tensor(name, value)
    message = rejection(r, limits)
    assert name in message and type(value).__name__ in message


@pytest.mark.parametrize("name", ["return_context_logits", "return_generation_logits"])
def test_logits_the_engine_does_not_gather(limits, name):
    message = rejection(make_request(**{name: torch.tensor([True])}), limits)
    assert name in message and "true" in message and "gather" in message


def test_request_that_cannot_fit_the_whole_kv_pool(limits):
    small_pool = AdmissionLimits(**{**limits.__dict__, "max_num_blocks": 2})   # 8 tokens
    message = rejection(make_request(prompt=[1] * 5, max_new_tokens=4), small_pool)
    assert "request_output_len" in message and "3 KV blocks" in message


def test_prompt_that_leaves_no_room_to_generate_is_refused(limits):
    full = AdmissionLimits(**{**limits.__dict__, "max_input_len": 64})
    message = rejection(make_request(prompt=[1] * 64, max_new_tokens=1), full)
    assert "request_output_len" in message or "input_ids" in message


@pytest.mark.parametrize("dtype", [torch.uint32, torch.uint64])
def test_unsigned_input_ids_are_accepted_or_refused_by_name(limits, dtype):
    r = make_request()
    r.input_ids = torch.tensor([1, 2, 3], dtype=dtype)
    try:
        assert to_spec(r, limits).prompt == [1, 2, 3]
    except RequestError as e:
        assert "input_ids" in str(e)


# -- accepted requests -----------------------------------------------------------------------------

def test_prompt_plus_output_len_above_max_seq_len_is_clamped_with_a_warning(limits, caplog):
    with caplog.at_level(logging.WARNING, logger="runtime.request.checks"):
        r = to_spec(make_request(prompt=[1] * 10, max_new_tokens=60), limits)
    assert r.max_new_tokens == 54
    [record] = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert "request_output_len" in record.getMessage() and "54" in record.getMessage()


def test_prompt_plus_output_len_at_max_seq_len_is_not_clamped(limits, caplog):
    with caplog.at_level(logging.WARNING, logger="runtime.request.checks"):
        r = to_spec(make_request(prompt=[1] * 10, max_new_tokens=54), limits)
    assert r.max_new_tokens == 54
    assert caplog.records == []


@pytest.mark.parametrize("input_ids", [torch.tensor([5, 6, 7], dtype=torch.int32),
                                       torch.tensor([[5, 6, 7]], dtype=torch.int32),
                                       torch.tensor([5, 6, 7], dtype=torch.int64)])
def test_input_ids_shapes_accepted(limits, input_ids):
    r = make_request()
    r.input_ids = input_ids
    spec = to_spec(r, limits)
    assert isinstance(spec, RequestSpec)
    assert spec.prompt == [5, 6, 7]
    assert spec.max_new_tokens == 4


def test_scalar_shapes_accepted(limits):
    r = make_request(end_id=torch.tensor(2, dtype=torch.int32), pad_id=torch.tensor([[0]], dtype=torch.int32))
    r.max_new_tokens = torch.tensor([3], dtype=torch.int32)
    spec = to_spec(r, limits)
    assert (spec.max_new_tokens, spec.decoding.end_id, spec.pad_id) == (3, 2, 0)


def test_input_lengths_is_accepted_and_ignored(limits):
    r = make_request(input_lengths=torch.tensor([99], dtype=torch.int32))
    spec = to_spec(r, limits)
    assert spec.prompt == [1, 2, 3]


def test_legacy_dict_constructor(limits):
    r = InferenceRequest(9, {"input_ids": torch.tensor([[4, 5]], dtype=torch.int32),
                             "request_output_len": torch.tensor([[2]], dtype=torch.int32)})
    spec = to_spec(r, limits)
    assert (spec.prompt, spec.max_new_tokens) == ([4, 5], 2)


def test_defaults_of_an_accepted_request(limits):
    spec = to_spec(make_request(), limits)
    assert spec.decoding.end_id is None
    assert spec.num_sequences == 1
    assert spec.is_streaming is False
    assert spec.decoding.temperature == 1.0
    assert (spec.return_log_probs, spec.return_context_logits,
            spec.return_generation_logits) == (False, False, False)


def test_end_id_minus_one_means_never_stop(limits):
    spec = to_spec(make_request(end_id=torch.tensor([-1], dtype=torch.int32)), limits)
    assert spec.decoding.end_id is None


# -- InferenceRequest and NamedTensor --------------------------------------------------------------

@pytest.mark.parametrize("prop, wire_name", [("input_ids", "input_ids"), ("max_new_tokens", "request_output_len"),
                                             ("length_penalty", "len_penalty"),
                                             ("no_repeat_ngram_size", "noRepeatNgramSize"),
                                             ("runtime_top_k", "runtime_top_k")])
def test_properties_map_to_wire_names(prop, wire_name):
    r = InferenceRequest(1)
    value = torch.tensor([3], dtype=torch.int32)
    setattr(r, prop, value)
    assert r.input_tensors == {wire_name: value}
    assert r.get_input_tensor(wire_name) is value
    assert r.has_tensor(wire_name)
    other = InferenceRequest(2)
    other.emplace_input_tensor(wire_name, value)
    assert getattr(other, prop) is value


def test_every_input_wire_name_has_a_property():
    r = InferenceRequest(1)
    for wire_name, prop in tensor_names.INPUT_NAME_TO_PROPERTY.items():
        assert getattr(r, prop) is None
        r.emplace_input_tensor(wire_name, torch.tensor([1]))
        assert getattr(r, prop) is not None
    assert tensor_names.MAX_NEW_TOKENS == "request_output_len"
    assert tensor_names.LENGTH_PENALTY == "len_penalty"
    assert tensor_names.NO_REPEAT_NGRAM_SIZE == "noRepeatNgramSize"


def test_setting_a_property_to_none_removes_the_tensor():
    r = make_request()
    r.max_new_tokens = None
    assert not r.has_tensor("request_output_len")
    with pytest.raises(KeyError):
        r.get_input_tensor("request_output_len")


def test_is_streaming(limits):
    r = make_request()
    assert r.is_streaming is False
    r.is_streaming = True
    assert to_spec(r, limits).is_streaming is True


def test_request_id_and_logits_post_processor():
    def fn(*args):
        return None
    assert InferenceRequest(5, fn).logits_post_processor is fn
    assert InferenceRequest(5, logits_post_processor=fn).logits_post_processor is fn
    r = InferenceRequest(5)
    assert r.request_id == 5 and r.logits_post_processor is None
    with pytest.raises(AttributeError):
        r.request_id = 6


def test_named_tensor_name_is_read_only():
    t = torch.zeros(2)
    named = NamedTensor(t, "output_ids")
    assert named.name == "output_ids" and named.tensor is t
    with pytest.raises(AttributeError):
        named.name = "other"
    assert named.name == "output_ids"
