"""Response tensors (names, dtypes, shapes, streaming chunks) and the stats JSON keys of API.md."""
from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timedelta

import pytest
import torch

from runtime.request import AdmissionLimits
from batch_manager.legacy.callbacks import UserCallbacks
from batch_manager.legacy.front_end import CallbackFrontEnd
from runtime.request import FinishReason, RequestOutput, RequestSpec
from batch_manager.legacy.responses import response_tensors
from batch_manager.stats import IterationStats, stats_json
from runtime.decoding import DecodingParams

VOCAB = 5
OUTPUT_NAMES = ["output_ids", "sequence_length", "output_log_probs", "cum_log_probs", "context_logits",
                "generation_logits"]


class Answered:
    """A request's spec and output, answered as a front end does: it keeps the cursor of the
    generated tokens it sent."""

    def __init__(self, prompt=(1, 2, 3), generated=(10, 11), finished: bool = True, **spec_fields):
        self.spec = RequestSpec(list(prompt), 8, DecodingParams(), **spec_fields)
        self.output = RequestOutput(1, list(prompt), 1)
        self.sequence = self.output.sequences[0]
        self.sent = 0
        self.generate(*generated)
        if finished:
            self.finish(FinishReason.LENGTH)

    def generate(self, *tokens: int) -> None:
        self.sequence.tokens += tokens   # the record's live beam: num_generated follows

    def finish(self, reason: FinishReason) -> None:
        self.output.finish(reason, self.spec.max_new_tokens)


def make_request(**kw) -> Answered:
    return Answered(**kw)


def as_dict(r: Answered, exclude_input_in_output: bool = False) -> dict[str, torch.Tensor]:
    tensors = response_tensors(r.spec, r.output, r.sent, exclude_input_in_output)
    r.sent = r.output.num_generated
    assert [t.name for t in tensors] == OUTPUT_NAMES
    return {t.name: t.tensor for t in tensors}


def assert_tensor(t: torch.Tensor, dtype: torch.dtype, expected) -> None:
    expected = torch.as_tensor(expected, dtype=dtype)
    assert t.dtype == dtype
    assert t.device.type == "cpu"
    assert list(t.shape) == list(expected.shape)
    assert torch.equal(t, expected)


# -- responses -------------------------------------------------------------------------------------

def test_non_streaming_prompt_plus_generated_with_dummies():
    out = as_dict(make_request())
    assert_tensor(out["output_ids"], torch.int32, [[[1, 2, 3, 10, 11]]])
    assert_tensor(out["sequence_length"], torch.int32, [[5]])
    assert_tensor(out["output_log_probs"], torch.float32, torch.zeros(1, 1, 2))
    assert_tensor(out["cum_log_probs"], torch.float32, [[0.0]])
    assert_tensor(out["context_logits"], torch.float32, torch.zeros(1, 1, 1))
    assert_tensor(out["generation_logits"], torch.float32, torch.zeros(1, 1, 1, 1))


def test_non_streaming_exclude_input_in_output():
    out = as_dict(make_request(), exclude_input_in_output=True)
    assert_tensor(out["output_ids"], torch.int32, [[[10, 11]]])
    assert_tensor(out["sequence_length"], torch.int32, [[2]])
    assert_tensor(out["output_log_probs"], torch.float32, torch.zeros(1, 1, 2))


def test_streaming_sends_only_new_tokens():
    r = make_request(generated=[10], finished=False, is_streaming=True)
    out = as_dict(r)
    assert_tensor(out["output_ids"], torch.int32, [[[10]]])
    assert_tensor(out["sequence_length"], torch.int32, [[1]])
    assert_tensor(out["output_log_probs"], torch.float32, torch.zeros(1, 1, 1))
    r.generate(11, 12)
    out = as_dict(r, exclude_input_in_output=False)      # streaming never repeats the prompt
    assert_tensor(out["output_ids"], torch.int32, [[[11, 12]]])
    assert_tensor(out["sequence_length"], torch.int32, [[2]])
    assert_tensor(out["output_log_probs"], torch.float32, torch.zeros(1, 1, 2))
    r.finish(FinishReason.END_ID)                        # final response with nothing new
    out = as_dict(r)
    assert_tensor(out["output_ids"], torch.int32, torch.zeros(1, 1, 0))
    assert_tensor(out["sequence_length"], torch.int32, [[0]])


def test_the_callback_front_end_streams_each_token_once():
    """Its cursor: a streamed response only when tokens were generated since the last one; the
    final one always (with what is left)."""
    sent = []
    callbacks = UserCallbacks(lambda n: [], lambda *args: sent.append(args), lambda: [], None)
    limits = AdmissionLimits(VOCAB, 8, 16, 1, 16, 4, False, False)
    front_end = CallbackFrontEnd(callbacks, limits, None, False, True, False)
    r = make_request(generated=[10], finished=False, is_streaming=True)
    front_end.respond(r.spec, r.output, False)
    front_end.respond(r.spec, r.output, False)          # nothing new: nothing sent
    r.generate(11, 12)
    front_end.respond(r.spec, r.output, False)
    r.finish(FinishReason.END_ID)
    front_end.respond(r.spec, r.output, True)
    tokens = [{t.name: t.tensor for t in tensors}["output_ids"][0, 0].tolist() for _, tensors, _, _ in sent]
    assert tokens == [[10], [11, 12], []]
    assert [is_final for _, _, is_final, _ in sent] == [False, False, True]


def test_log_probs_when_requested():
    r = make_request(return_log_probs=True)
    r.sequence.log_probs = [-0.5, -1.25]
    r.sequence.cum_log_prob = -1.75
    out = as_dict(r)
    assert_tensor(out["output_log_probs"], torch.float32, [[[-0.5, -1.25]]])
    assert_tensor(out["cum_log_probs"], torch.float32, [[-1.75]])


def test_streaming_log_probs_chunk_and_cumulative_sum():
    r = make_request(generated=[10], finished=False, is_streaming=True, return_log_probs=True)
    r.sequence.log_probs, r.sequence.cum_log_prob = [-0.5], -0.5
    as_dict(r)
    r.generate(11)
    r.sequence.log_probs.append(-0.25)
    r.sequence.cum_log_prob = -0.75
    out = as_dict(r)
    assert_tensor(out["output_log_probs"], torch.float32, [[[-0.25]]])
    assert_tensor(out["cum_log_probs"], torch.float32, [[-0.75]])


def test_context_logits_when_requested_in_the_final_response():
    r = make_request(return_context_logits=True, finished=False, is_streaming=True)
    r.output.context_logits = torch.arange(3 * VOCAB, dtype=torch.float16).view(3, VOCAB)
    assert_tensor(as_dict(r)["context_logits"], torch.float32, torch.zeros(1, 1, 1))   # not final yet
    r.finish(FinishReason.LENGTH)
    assert_tensor(as_dict(r)["context_logits"], torch.float32,
                  torch.arange(3 * VOCAB, dtype=torch.float32).view(1, 3, VOCAB))


def test_generation_logits_when_requested():
    rows = [torch.full((VOCAB,), float(i)) for i in range(3)]
    r = make_request(generated=[10, 11], return_generation_logits=True)
    r.sequence.generation_logits = rows[:2]
    assert_tensor(as_dict(r)["generation_logits"], torch.float32, torch.stack(rows[:2]).view(1, 1, 2, VOCAB))

    r = make_request(generated=[10, 11], finished=False, is_streaming=True, return_generation_logits=True)
    r.sequence.generation_logits = rows[:2]
    as_dict(r)
    r.generate(12)
    r.sequence.generation_logits.append(rows[2])
    assert_tensor(as_dict(r)["generation_logits"], torch.float32, rows[2].view(1, 1, 1, VOCAB))


# -- stats -----------------------------------------------------------------------------------------

ALWAYS_KEYS = {"Timestamp", "Iteration Counter", "Active Request Count", "Max Request Count",
               "Runtime CPU Memory Usage", "Runtime GPU Memory Usage", "Runtime Pinned Memory Usage"}
KV_KEYS = {"Max KV cache blocks", "Free KV cache blocks", "Used KV cache blocks", "Tokens per KV cache block",
           "Allocated total KV cache blocks", "Allocated new KV cache blocks", "Reused KV cache blocks"}
LORA_KEYS = {"LoRA Adapters Cached", "LoRA Adapter Evictions"}
INFLIGHT_KEYS = {"Scheduled Requests", "Context Requests", "Generation Requests", "Total Context Tokens",
                 "MicroBatch ID", "Paused Requests"}
V1_KEYS = {"Scheduled Requests", "Context Requests", "Total Generation Tokens", "Total Context Tokens",
           "Empty Generation Slots"}


DRAFT_FIELDS = ("num_draft_tokens_proposed", "num_draft_tokens_accepted")
KV_EVENT_FIELDS = {"num_kv_events_published", "num_kv_events_dropped"}


def make_stats(with_drafts: bool = False, with_kv_events: bool = False) -> IterationStats:
    """Every field a distinct value, so a key wired to the wrong field shows (the draft counters
    only when drafts are on, the dropped KV events only when they are published: None leaves
    their keys out)."""
    left_out = (set() if with_drafts else set(DRAFT_FIELDS)) | (set() if with_kv_events else KV_EVENT_FIELDS)
    names = [f.name for f in dataclasses.fields(IterationStats) if f.name not in left_out]
    return IterationStats(**{name: 100 + i for i, name in enumerate(names)})


def test_stats_json_kv_event_counters_only_when_events_are_published():
    s = make_stats(with_kv_events=True)
    d = json.loads(stats_json(s, is_static_batching=False))
    assert (d["KV Events Published"], d["KV Events Dropped"]) == (s.num_kv_events_published, s.num_kv_events_dropped)
    assert s.num_kv_events_published != s.num_kv_events_dropped
    assert not {"KV Events Published", "KV Events Dropped"} & set(json.loads(stats_json(make_stats(), False)))


def test_stats_json_draft_keys_only_when_drafts_are_on():
    s = make_stats(with_drafts=True)
    d = json.loads(stats_json(s, is_static_batching=False))
    assert (d["Draft Tokens Proposed"], d["Draft Tokens Accepted"]) == (s.num_draft_tokens_proposed,
                                                                        s.num_draft_tokens_accepted)
    assert "Draft Tokens Proposed" not in json.loads(stats_json(make_stats(), is_static_batching=False))


def test_stats_json_in_flight_keys_and_values():
    s = make_stats()
    d = json.loads(stats_json(s, is_static_batching=False))
    assert set(d) == ALWAYS_KEYS | KV_KEYS | LORA_KEYS | INFLIGHT_KEYS
    assert not set(d) & (V1_KEYS - INFLIGHT_KEYS)
    assert {k: v for k, v in d.items() if k != "Timestamp"} == {
        "Iteration Counter": s.iteration, "Active Request Count": s.num_active,
        "Max Request Count": s.max_num_requests, "Runtime CPU Memory Usage": s.cpu_memory_bytes,
        "Runtime GPU Memory Usage": s.gpu_memory_bytes, "Runtime Pinned Memory Usage": s.pinned_memory_bytes,
        "Max KV cache blocks": s.max_blocks, "Free KV cache blocks": s.free_blocks,
        "Used KV cache blocks": s.used_blocks, "Tokens per KV cache block": s.tokens_per_block,
        "Allocated total KV cache blocks": s.allocated_total_blocks,
        "Allocated new KV cache blocks": s.allocated_new_blocks, "Reused KV cache blocks": s.reused_blocks,
        "LoRA Adapters Cached": s.num_lora_adapters, "LoRA Adapter Evictions": s.num_lora_evictions,
        "Scheduled Requests": s.num_scheduled, "Context Requests": s.num_context,
        "Generation Requests": s.num_generation, "Total Context Tokens": s.num_context_tokens,
        "MicroBatch ID": s.micro_batch_id, "Paused Requests": s.num_paused}


def test_stats_json_v1_keys_and_values():
    s = make_stats()
    d = json.loads(stats_json(s, is_static_batching=True))
    assert set(d) == ALWAYS_KEYS | KV_KEYS | LORA_KEYS | V1_KEYS
    assert not set(d) & (INFLIGHT_KEYS - V1_KEYS)
    assert (d["Scheduled Requests"], d["Context Requests"], d["Total Generation Tokens"],
            d["Total Context Tokens"], d["Empty Generation Slots"]) == \
        (s.num_scheduled, s.num_context, s.num_generation_tokens, s.num_context_tokens,
         s.num_empty_generation_slots)
    assert d["Iteration Counter"] == s.iteration and d["Free KV cache blocks"] == s.free_blocks


@pytest.mark.parametrize("is_static_batching", [False, True])
def test_stats_timestamp_format(is_static_batching):
    before = datetime.now().replace(microsecond=0)
    d = json.loads(stats_json(make_stats(), is_static_batching))
    after = datetime.now()
    timestamp = datetime.strptime(d["Timestamp"], "%m-%d-%Y %H:%M:%S")
    slack = timedelta(seconds=2)  # the wall clock may be stepped (NTP) between the three readings
    assert before - slack <= timestamp <= after + slack
