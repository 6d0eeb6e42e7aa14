"""The one record of a request's tokens and of what was asked with them (plain Python).

Its owner (the manager's scheduler, or GptSession) applies each decoder step's `DecodeOutcome`
to it once; the decoder reads it (penalties, bans, stop words, logits post-processors) and keeps
no copy of the tokens; front ends render their responses from it. Beam search keeps its own
hypotheses besides (the beam bank) and hands the live and the output beams over as `BeamOutputs`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .spec import FinishReason


@dataclass(frozen=True)
class BeamOutputs:
    """A beam-search (or samples) request after its step."""
    parents: tuple[int, ...]                     # per live beam: the previous beam it continues
    live_tokens: tuple[tuple[int, ...], ...]     # per live beam: every generated token (next inputs)
    tokens: tuple[tuple[int, ...], ...]          # the output beams, best first (final once finished)
    log_probs: tuple[tuple[float, ...], ...]
    cum_log_probs: tuple[float, ...]
    generation_logits: tuple = ()                # per output beam: float32 [V] rows, when gathered


@dataclass
class SequenceOutput:
    """One output sequence (a beam, or a returned sample): its generated tokens and what was asked
    with them."""
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)   # when return_log_probs; none for an end token
    cum_log_prob: float = 0.0                               # includes the end token's log prob
    top_log_probs: list[tuple] = field(default_factory=list)   # per token: (k log probs, k ids)
    generation_logits: list[Any] = field(default_factory=list)   # float32 [V] per token, when gathered
    finish_reason: FinishReason | None = None


class RequestOutput:
    """`sequences`: the output sequences (best first for beam search; whole after each step, as
    beams reorder; width 1 grows by appending). `beams[b]`: the generated tokens of live beam b,
    which the next step extends: at width 1 the very list of sequence 0; for beam search the live
    beams until it finishes, then the best output."""

    def __init__(self, request_id: int, prompt: list[int], num_sequences: int = 1):
        self.request_id = request_id
        self.prompt = prompt
        self.sequences = [SequenceOutput() for _ in range(num_sequences)]
        self.beams: list[list[int]] = [self.sequences[0].tokens]
        self.context_logits: Any = None      # float32 [prompt_len, V] when requested
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None

    @property
    def num_generated(self) -> int:
        """Generated tokens so far (of live beam 0)."""
        return len(self.beams[0])

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def sequence(self, beam: int) -> list[int]:
        """Prompt + live beam `beam`'s generated tokens (a new list)."""
        return self.prompt + self.beams[beam]

    def start_after(self, first_token: int, first_log_prob: float, num_top_log_probs: int,
                    gather_generation_logits: bool) -> None:
        """A request whose first token was decoded elsewhere (a generation-only request): it counts
        as generated; its top log probs and logits are never rendered (streams start after it)."""
        self.sequences[0] = SequenceOutput([first_token], [first_log_prob], first_log_prob,
                                           [None] if num_top_log_probs else [],
                                           [None] if gather_generation_logits else [])
        self.beams = [self.sequences[0].tokens]

    def apply(self, outcome) -> None:
        """One decoder step's outcome (runtime.decoding.DecodeOutcome), applied once: width 1
        appends; beam search and samples replace every sequence and take the live beams (or,
        once finished, the best output)."""
        beams: BeamOutputs | None = outcome.beams
        if beams is None:
            sequence = self.sequences[0]
            sequence.tokens += outcome.tokens
            sequence.log_probs += outcome.log_probs
            sequence.top_log_probs += outcome.top_log_probs
            sequence.generation_logits += outcome.logits
            sequence.cum_log_prob = outcome.cum_log_prob
            return
        logits = beams.generation_logits or [()] * len(beams.tokens)
        self.sequences = [SequenceOutput(list(tokens), list(log_probs), cum, [], list(rows))
                          for tokens, log_probs, cum, rows
                          in zip(beams.tokens, beams.log_probs, beams.cum_log_probs, logits)]
        finished = outcome.finish_reason is not None
        self.beams = [list(t) for t in (beams.tokens[:1] if finished else beams.live_tokens)]

    def finish(self, reason: FinishReason, max_new_tokens: int, error: str | None = None) -> None:
        """Every sequence's reason: beams shorter than max_new_tokens ended on the end id (or a
        stop word), the others on the length; a stop or an error ends all alike."""
        self.finish_reason, self.error = reason, error
        per_sequence = len(self.sequences) > 1 and reason in (FinishReason.END_ID, FinishReason.STOP_WORDS,
                                                               FinishReason.LENGTH)
        for s in self.sequences:
            if per_sequence and len(s.tokens) >= max_new_tokens:
                s.finish_reason = FinishReason.LENGTH
            elif per_sequence:
                s.finish_reason = FinishReason.STOP_WORDS if reason == FinishReason.STOP_WORDS else FinishReason.END_ID
            else:
                s.finish_reason = reason
