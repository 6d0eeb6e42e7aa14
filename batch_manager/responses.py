"""Response tensors: the six named outputs of API.md for a final or a streamed response."""
from __future__ import annotations

import torch

from . import tensor_names as tn
from .inference_request import NamedTensor
from .llm_request import LlmRequest


def response_tensors(r: LlmRequest, exclude_input_in_output: bool) -> list[NamedTensor]:
    """Streaming: the tokens generated since the last response. Non-streaming: prompt + generated
    (generated only with exclude_input_in_output). Beam width 1: every tensor has beam dim 1."""
    if r.beam_width > 1:
        return _beam_response_tensors(r, exclude_input_in_output)
    start = r.num_sent_tokens if r.is_streaming else 0
    if r.is_streaming:
        tokens = r.generated[start:]
    else:
        tokens = r.generated if exclude_input_in_output else r.prompt + r.generated
    log_probs = r.log_probs[start:] if r.return_log_probs else None
    generation_logits = r.generation_logits[start:]
    top_log_probs = r.top_log_probs[start:]
    num_generated = len(r.generated) - (r.num_sent_tokens if r.is_streaming else 0)
    r.num_sent_tokens = len(r.generated)

    output_ids = torch.tensor(tokens, dtype=torch.int32).view(1, 1, len(tokens))
    sequence_length = torch.tensor([[len(tokens)]], dtype=torch.int32)
    if log_probs is not None:
        output_log_probs = torch.tensor(log_probs, dtype=torch.float32).view(1, 1, len(log_probs))
        cum_log_probs = torch.tensor([[r.cum_log_prob]], dtype=torch.float32)
    else:
        output_log_probs = torch.zeros(1, 1, num_generated, dtype=torch.float32)
        cum_log_probs = torch.zeros(1, 1, dtype=torch.float32)
    context_logits = _context_logits(r)
    if r.return_generation_logits and generation_logits:
        generation_logits_t = torch.stack(generation_logits).to(torch.float32)[None, None]
    elif r.return_generation_logits:
        generation_logits_t = torch.zeros(1, 1, 0, 1, dtype=torch.float32)
    else:
        generation_logits_t = torch.zeros(1, 1, 1, 1, dtype=torch.float32)
    tensors = [NamedTensor(output_ids, tn.OUTPUT_IDS), NamedTensor(sequence_length, tn.SEQUENCE_LENGTH),
               NamedTensor(output_log_probs, tn.OUTPUT_LOG_PROBS), NamedTensor(cum_log_probs, tn.CUM_LOG_PROBS),
               NamedTensor(context_logits, tn.CONTEXT_LOGITS), NamedTensor(generation_logits_t, tn.GENERATION_LOGITS)]
    k = r.decoding.num_top_log_probs if r.decoding is not None else 0
    if k:   # [1, 1, generated, k]
        values = torch.tensor([v for v, _ in top_log_probs], dtype=torch.float32).view(1, 1, -1, k)
        ids = torch.tensor([i for _, i in top_log_probs], dtype=torch.int32).view(1, 1, -1, k)
        tensors += [NamedTensor(values, tn.TOP_LOG_PROBS), NamedTensor(ids, tn.TOP_LOG_PROB_IDS)]
    return tensors


def _context_logits(r: LlmRequest) -> torch.Tensor:
    if r.return_context_logits and r.context_logits is not None and r.is_finished:
        return r.context_logits.to(torch.float32)[None]
    return torch.zeros(1, 1, 1, dtype=torch.float32)


def _beam_response_tensors(r: LlmRequest, exclude_input_in_output: bool) -> list[NamedTensor]:
    """Beam search: every response (streamed or final) carries all current beams whole, best
    first — beams reorder between steps, so "new tokens only" has no meaning for them. Streamed
    responses hold the generated tokens; a final non-streaming one prompt + generated unless
    exclude_input_in_output. Rows are padded with pad_id to the longest beam."""
    # Before its first decoding step (stopped or failed at once) a request has no beams yet:
    # every beam is then the prompt alone, so the beam dimension is still beam_width.
    beams = r.beam_tokens or [list(r.generated)] * r.beam_width
    prefix = [] if (r.is_streaming or exclude_input_in_output) else r.prompt
    rows = [prefix + tokens for tokens in beams]
    width = max(len(row) for row in rows)
    num_beams = len(rows)
    output_ids = torch.full((1, num_beams, width), r.pad_id, dtype=torch.int32)
    for b, row in enumerate(rows):
        output_ids[0, b, :len(row)] = torch.tensor(row, dtype=torch.int32)
    sequence_length = torch.tensor([[len(row) for row in rows]], dtype=torch.int32)
    max_generated = max(len(tokens) for tokens in beams)
    output_log_probs = torch.zeros(1, num_beams, max_generated, dtype=torch.float32)
    cum_log_probs = torch.zeros(1, num_beams, dtype=torch.float32)
    if r.return_log_probs and r.beam_log_probs:
        for b, log_probs in enumerate(r.beam_log_probs):
            output_log_probs[0, b, :len(log_probs)] = torch.tensor(log_probs, dtype=torch.float32)
        cum_log_probs[0] = torch.tensor(r.beam_cum_log_probs, dtype=torch.float32)
    if r.return_generation_logits and r.generation_logits:
        vocab = r.generation_logits[0][0].shape[-1] if r.generation_logits[0] else 1
        generation_logits = torch.zeros(1, num_beams, max_generated, vocab, dtype=torch.float32)
        for b, rows_b in enumerate(r.generation_logits):
            if rows_b:
                generation_logits[0, b, :len(rows_b)] = torch.stack(rows_b).to(torch.float32)
    else:
        generation_logits = torch.zeros(1, 1, 1, 1, dtype=torch.float32)
    r.num_sent_tokens = len(r.generated)
    return [NamedTensor(output_ids, tn.OUTPUT_IDS), NamedTensor(sequence_length, tn.SEQUENCE_LENGTH),
            NamedTensor(output_log_probs, tn.OUTPUT_LOG_PROBS), NamedTensor(cum_log_probs, tn.CUM_LOG_PROBS),
            NamedTensor(_context_logits(r), tn.CONTEXT_LOGITS), NamedTensor(generation_logits, tn.GENERATION_LOGITS)]
