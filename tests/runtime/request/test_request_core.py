"""The request core (runtime/request/): the one record, the straight checks, the frozen spec and
the list rendering, without a model."""
import dataclasses

import pytest

from runtime.decoding import DecodeOutcome, DecodingParams
from runtime.request import (AdmissionLimits, BeamOutputs, FinishReason, RequestError, RequestOutput, RequestSpec,
                             make_spec, render)

LIMITS = AdmissionLimits(vocab_size=100, max_input_len=16, max_seq_len=32, max_beam_width=2, max_num_blocks=16,
                         tokens_per_block=4, gather_context_logits=False, gather_generation_logits=True,
                         max_draft_tokens=4)
NAMES = {"max_new_tokens": "max_new", "pad_id": "pad", "draft_input_ids": "drafts", "draft_logits": "draft_rows",
         "num_return_sequences": "n", "beam_width": "beams", "return_context_logits": "ctx_logits",
         "return_generation_logits": "gen_logits"}


def spec(**fields) -> RequestSpec:
    fields = {"names": NAMES, "decoding_names": {}, **fields}
    return make_spec([1, 2, 3], fields.pop("max_new_tokens", 8), LIMITS, fields.pop("decoding", DecodingParams()),
                     **fields)


def test_width_one_appends_to_the_one_list_the_decoder_reads():
    record = RequestOutput(7, [1, 2], 1)
    record.apply(DecodeOutcome(tokens=(5, 6), log_probs=(-0.5, -0.25), cum_log_prob=-0.75))
    assert record.beams[0] is record.sequences[0].tokens
    assert (record.beams, record.sequence(0), record.num_generated) == ([[5, 6]], [1, 2, 5, 6], 2)
    assert (record.sequences[0].log_probs, record.sequences[0].cum_log_prob) == ([-0.5, -0.25], -0.75)


def test_beam_search_takes_the_live_beams_then_the_best_output():
    record = RequestOutput(7, [1], 2)
    live = BeamOutputs(parents=(0, 0), live_tokens=((4,), (5,)), tokens=((5,), (4,)), log_probs=((-1.0,), (-2.0,)),
                       cum_log_probs=(-1.0, -2.0))
    record.apply(DecodeOutcome(beams=live))
    assert (record.beams, [s.tokens for s in record.sequences]) == ([[4], [5]], [[5], [4]])
    done = dataclasses.replace(live, live_tokens=(), tokens=((5, 9), (4, 8)))
    record.apply(DecodeOutcome(beams=done, finish_reason=FinishReason.END_ID))
    assert record.beams == [[5, 9]]
    record.finish(FinishReason.END_ID, max_new_tokens=2)
    assert [s.finish_reason for s in record.sequences] == [FinishReason.LENGTH, FinishReason.LENGTH]


def test_a_resumed_record_counts_its_first_token():
    record = RequestOutput(7, [1, 2], 1)
    record.start_after(9, -0.5, num_top_log_probs=0, gather_generation_logits=False)
    assert (record.beams, record.num_generated, record.sequences[0].cum_log_prob) == ([[9]], 1, -0.5)


def test_the_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec().max_new_tokens = 1


@pytest.mark.parametrize("fields, message", [
    ({"max_new_tokens": 0}, "max_new: must be positive, got 0"),
    ({"pad_id": 1 << 31}, "pad: 2147483648 outside"),
    ({"decoding": DecodingParams(beam_width=3)}, "beam_width"),
    ({"draft_tokens": []}, "drafts: must not be empty"),
    ({"draft_tokens": [1, 100]}, r"drafts: token ids must be in \[0, 100\), got 100"),
    ({"draft_tokens": [1], "decoding": DecodingParams(beam_width=2)}, "drafts: draft tokens need beam width 1, got 2"),
    ({"return_context_logits": True}, "ctx_logits: true, but the engine was not built with gather_context_logits"),
    ({"max_new_tokens": 29, "decoding": DecodingParams(beam_width=2)}, "max_new: prompt 3 \\+ 29 new tokens need 18 KV blocks; the whole pool has 16"),
])
def test_make_spec_names_the_field_as_the_door_knows_it(fields, message):
    with pytest.raises(RequestError, match=message):
        spec(**fields)


def test_make_spec_clamps_and_a_context_only_request_runs_to_its_first_token():
    assert spec(max_new_tokens=100).max_new_tokens == 29
    assert spec(max_new_tokens=100, context_only=True).max_new_tokens == 1


def test_render_gives_lists_from_a_start():
    s = spec(return_log_probs=True)
    record = RequestOutput(7, s.prompt, 1)
    record.apply(DecodeOutcome(tokens=(5, 6, 7), log_probs=(-1.0, -2.0, -3.0), cum_log_prob=-6.0))
    rendered = render(s, record, 1, with_prompt=True)
    assert rendered.token_ids == [[1, 2, 3, 6, 7]]
    assert (rendered.log_probs, rendered.cum_log_probs) == ([[-2.0, -3.0]], [-6.0])
    assert (rendered.generation_logits, rendered.top_log_probs) == (None, None)
