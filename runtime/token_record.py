"""The one record of a request's tokens (plain Python, a leaf module like the block bookkeeping).

Its owner (the manager's scheduler, or GptSession) applies each decoder step's outcome to it;
the decoder reads it (penalties, bans, stop words, logits post-processors) and keeps no copy of
the tokens. Beam search keeps its own hypotheses besides (the beam bank: log probs, scores and
the finished beams), and hands the live beams over as `BeamOutputs`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BeamOutputs:
    """A beam-search request after its step."""
    parents: tuple[int, ...]                     # per live beam: the previous beam it continues
    live_tokens: tuple[tuple[int, ...], ...]     # per live beam: every generated token (next inputs)
    tokens: tuple[tuple[int, ...], ...]          # the output beams, best first (final once finished)
    log_probs: tuple[tuple[float, ...], ...]
    cum_log_probs: tuple[float, ...]
    generation_logits: tuple = ()                # per output beam: float32 [V] rows, when gathered


class TokenRecord:
    """prompt, and `beams[b]`: the generated tokens of live beam b (one list at beam width 1;
    the best output beam once a beam search finished)."""
    __slots__ = ("prompt", "beams")

    def __init__(self, prompt: list[int]):
        self.prompt = prompt
        self.beams: list[list[int]] = [[]]

    @property
    def num_generated(self) -> int:
        return len(self.beams[0])

    def sequence(self, beam: int) -> list[int]:
        """Prompt + the beam's generated tokens (a new list)."""
        return self.prompt + self.beams[beam]

    def apply(self, new_tokens: tuple[int, ...], beams: BeamOutputs | None, finished: bool) -> None:
        """One decoder step's outcome: width 1 appends its new tokens; beam search takes the live
        beams (or, once finished, the best output)."""
        if beams is None:
            self.beams[0] += new_tokens
        else:
            self.beams = [list(t) for t in (beams.tokens[:1] if finished else beams.live_tokens)]
