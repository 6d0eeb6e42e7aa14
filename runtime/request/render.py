"""A request's values for a response, as lists: every door answers from these (the tensor doors
make their tensors of them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .output import RequestOutput
from .spec import RequestSpec


@dataclass(frozen=True)
class Rendered:
    """One response's values, per output sequence (1 at beam width 1), from its start on."""
    token_ids: list[list[int]]            # per sequence; with the prompt first when asked
    log_probs: list[list[float]]          # per sequence, rows of one length (zeros unless return_log_probs)
    cum_log_probs: list[float]
    generation_logits: list[list[Any]] | None   # per sequence, float32 [V] rows, when return_generation_logits
    top_log_probs: list[tuple] | None     # with num_top_log_probs k: per token, (k log probs, k ids)


def render(spec: RequestSpec, output: RequestOutput, start: int, with_prompt: bool) -> Rendered:
    """Width 1: the generated tokens from `start` on (a stream's new tokens), after the prompt when
    `with_prompt`. Beam search and samples: every sequence whole (beams reorder between steps, so
    "new tokens only" has no meaning for them), from 0."""
    sequences = output.sequences
    if len(sequences) > 1:
        start = 0
    prefix = spec.prompt if with_prompt else []
    token_ids = [prefix + s.tokens[start:] for s in sequences]
    if len(sequences) == 1:   # the end token has no log prob: the row is one shorter then
        num_log_probs = len(sequences[0].log_probs[start:]) if spec.return_log_probs else len(sequences[0].tokens[start:])
    else:
        num_log_probs = max(len(s.tokens) for s in sequences)
    log_probs = [[0.0] * num_log_probs for _ in sequences]
    cum_log_probs = [0.0] * len(sequences)
    if spec.return_log_probs:
        for i, s in enumerate(sequences):
            values = s.log_probs[start:start + num_log_probs]
            log_probs[i][:len(values)] = values
            cum_log_probs[i] = s.cum_log_prob
    generation_logits = [s.generation_logits[start:] for s in sequences] if spec.return_generation_logits else None
    top_log_probs = sequences[0].top_log_probs[start:] if spec.decoding.num_top_log_probs else None
    return Rendered(token_ids, log_probs, cum_log_probs, generation_logits, top_log_probs)
