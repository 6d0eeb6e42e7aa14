"""GptManager's responses: `response_tensors`, the six named output tensors (API.md) of a final or a
streamed response, made from the tensor doors' shared rendering (`batch_manager.doors.rendering`)."""
from __future__ import annotations

import torch

from runtime.request import RequestOutput, RequestSpec

from ..doors.rendering import context_logits, render_tensors
from . import tensor_names as tn
from .inference_request import NamedTensor


def response_tensors(spec: RequestSpec, output: RequestOutput, start: int,
                     exclude_input_in_output: bool) -> list[NamedTensor]:
    """GptManager's response: streaming, the tokens generated from `start` on (beam width 1);
    otherwise prompt + generated (generated only with exclude_input_in_output). Beam search:
    every beam whole, rows padded with pad_id to the longest. Tensors not asked for keep their
    legacy placeholder shapes ([1, 1, 1] context logits, [1, 1, 1, 1] generation logits)."""
    with_prompt = not spec.is_streaming and not exclude_input_in_output
    rendered = render_tensors(spec, output, start if spec.is_streaming else 0, with_prompt)
    rows = rendered.token_ids
    output_ids = torch.full((1, len(rows), max(len(row) for row in rows)), spec.pad_id, dtype=torch.int32)
    for b, row in enumerate(rows):
        output_ids[0, b, :len(row)] = torch.tensor(row, dtype=torch.int32)
    sequence_length = torch.tensor([[len(row) for row in rows]], dtype=torch.int32)
    log_probs, cum_log_probs = rendered.log_probs[None], rendered.cum_log_probs[None]
    logits = context_logits(spec, output)
    logits = torch.zeros(1, 1, 1, dtype=torch.float32) if logits is None else logits[None]
    generation_logits = rendered.generation_logits
    if generation_logits is None or (len(rows) > 1 and generation_logits.shape[1] == 0):
        generation_logits = torch.zeros(1, 1, 1, 1, dtype=torch.float32)
    elif generation_logits.shape[1] == 0:   # asked, none yet: [1, 1, 0, 1]
        generation_logits = torch.zeros(1, 1, 0, 1, dtype=torch.float32)
    else:
        generation_logits = generation_logits[None]
    tensors = [NamedTensor(output_ids, tn.OUTPUT_IDS), NamedTensor(sequence_length, tn.SEQUENCE_LENGTH),
               NamedTensor(log_probs, tn.OUTPUT_LOG_PROBS), NamedTensor(cum_log_probs, tn.CUM_LOG_PROBS),
               NamedTensor(logits, tn.CONTEXT_LOGITS), NamedTensor(generation_logits, tn.GENERATION_LOGITS)]
    if rendered.top_log_probs is not None:   # [1, 1, generated, k]
        tensors += [NamedTensor(rendered.top_log_probs[None], tn.TOP_LOG_PROBS),
                    NamedTensor(rendered.top_log_prob_ids[None], tn.TOP_LOG_PROB_IDS)]
    return tensors
