"""Rendering a `RequestOutput` for a tensor door: `render_tensors` makes tensors of
`runtime.request.render`'s values (the Executor's `Result` takes them as they are; GptManager's
`legacy/responses.py` names them), `context_logits` the prompt's logits of a final response. Each
front end keeps its own cursor of the generated tokens it sent (`StreamCursors`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.request import RequestOutput, RequestSpec, render


class StreamCursors:
    """A front end's record of what it streamed: request id -> generated tokens already sent."""

    def __init__(self):
        self._sent: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._sent)

    def start(self, output: RequestOutput, is_final: bool) -> int | None:
        """Where the next response starts, or None when a streamed one would carry nothing new."""
        sent = self._sent.get(output.request_id, 0)
        return None if not is_final and output.num_generated <= sent else sent

    def advance(self, output: RequestOutput, is_final: bool) -> None:
        """After a response went out: a final one ends the request's cursor."""
        if is_final:
            self._sent.pop(output.request_id, None)
        else:
            self._sent[output.request_id] = output.num_generated

    def forget(self, request_id) -> None:
        if type(request_id) is int:
            self._sent.pop(request_id, None)


@dataclass(frozen=True)
class RenderedTensors:
    """`runtime.request.render`'s values as tensors, per output sequence S (1 at beam width 1)."""
    token_ids: list[list[int]]            # per sequence; with the prompt first when asked
    log_probs: torch.Tensor               # float32 [S, n] (zeros unless return_log_probs)
    cum_log_probs: torch.Tensor           # float32 [S]
    generation_logits: torch.Tensor | None   # float32 [S, n, V] when return_generation_logits
    top_log_probs: torch.Tensor | None    # float32 [1, n, k] with num_top_log_probs k
    top_log_prob_ids: torch.Tensor | None  # int32 [1, n, k]


def render_tensors(spec: RequestSpec, output: RequestOutput, start: int, with_prompt: bool) -> RenderedTensors:
    """`render` (see there), its values made tensors: the tensor doors' shared answer."""
    rendered = render(spec, output, start, with_prompt)
    generation_logits = None
    if rendered.generation_logits is not None:
        rows = rendered.generation_logits
        vocab = next((r[0].shape[-1] for r in rows if r), 1)
        generation_logits = torch.zeros(len(rows), max(len(r) for r in rows), vocab, dtype=torch.float32)
        for i, r in enumerate(rows):
            if r:
                generation_logits[i, :len(r)] = torch.stack(r).to(torch.float32)
    top_log_probs = top_log_prob_ids = None
    k = spec.decoding.num_top_log_probs
    if rendered.top_log_probs is not None:   # width 1 only
        top_log_probs = torch.tensor([v for v, _ in rendered.top_log_probs], dtype=torch.float32).view(1, -1, k)
        top_log_prob_ids = torch.tensor([i for _, i in rendered.top_log_probs], dtype=torch.int32).view(1, -1, k)
    return RenderedTensors(rendered.token_ids, torch.tensor(rendered.log_probs, dtype=torch.float32),
                           torch.tensor(rendered.cum_log_probs, dtype=torch.float32),
                           generation_logits, top_log_probs, top_log_prob_ids)


def context_logits(spec: RequestSpec, output: RequestOutput) -> torch.Tensor | None:
    """float32 [prompt_len, V] in a final response, when asked."""
    if spec.return_context_logits and output.context_logits is not None and output.is_finished:
        return output.context_logits.to(torch.float32)
    return None
