"""Response tensors: the six named outputs of API.md for a final or a streamed response."""
from __future__ import annotations

import torch

from . import tensor_names as tn
from .inference_request import NamedTensor
from .llm_request import LlmRequest


def response_tensors(r: LlmRequest, exclude_input_in_output: bool) -> list[NamedTensor]:
    """Streaming: the tokens generated since the last response. Non-streaming: prompt + generated
    (generated only with exclude_input_in_output). Beam width 1: every tensor has beam dim 1."""
    if r.is_streaming:
        start = r.num_sent_tokens
        tokens = r.generated[start:]
        log_probs = r.log_probs[start:] if r.return_log_probs else None
        generation_logits = r.generation_logits[start:]
    else:
        tokens = r.generated if exclude_input_in_output else r.prompt + r.generated
        log_probs = r.log_probs if r.return_log_probs else None
        generation_logits = r.generation_logits
    num_generated = len(r.generated) - (r.num_sent_tokens if r.is_streaming else 0)
    r.num_sent_tokens = len(r.generated)

    output_ids = torch.tensor(tokens, dtype=torch.int32).view(1, 1, len(tokens))
    sequence_length = torch.tensor([[len(tokens)]], dtype=torch.int32)
    if log_probs is not None:
        output_log_probs = torch.tensor(log_probs, dtype=torch.float32).view(1, 1, len(log_probs))
        cum_log_probs = torch.tensor([[sum(r.log_probs)]], dtype=torch.float32)
    else:
        output_log_probs = torch.zeros(1, 1, num_generated, dtype=torch.float32)
        cum_log_probs = torch.zeros(1, 1, dtype=torch.float32)
    if r.return_context_logits and r.context_logits is not None and r.is_finished:
        context_logits = r.context_logits.to(torch.float32)[None]
    else:
        context_logits = torch.zeros(1, 1, 1, dtype=torch.float32)
    if r.return_generation_logits and generation_logits:
        generation_logits_t = torch.stack(generation_logits).to(torch.float32)[None, None]
    elif r.return_generation_logits:
        generation_logits_t = torch.zeros(1, 1, 0, 1, dtype=torch.float32)
    else:
        generation_logits_t = torch.zeros(1, 1, 1, 1, dtype=torch.float32)
    return [NamedTensor(output_ids, tn.OUTPUT_IDS), NamedTensor(sequence_length, tn.SEQUENCE_LENGTH),
            NamedTensor(output_log_probs, tn.OUTPUT_LOG_PROBS), NamedTensor(cum_log_probs, tn.CUM_LOG_PROBS),
            NamedTensor(context_logits, tn.CONTEXT_LOGITS), NamedTensor(generation_logits_t, tn.GENERATION_LOGITS)]
