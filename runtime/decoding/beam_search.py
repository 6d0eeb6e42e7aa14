"""Beam search for one request: candidate selection, the bank of finished hypotheses, and the
stopping rule (Hugging Face transformers 5's algorithm; see runtime/decoding/params.py).

The decoder hands `BeamSearch.step` the processed log-probs of the live beams; it returns, for
each new beam, the beam it continues (`parents`) so the caller can share that beam's KV blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_EXCLUDED = -1.0e9  # Hugging Face's "cannot be chosen" offset


@dataclass
class Hypothesis:
    tokens: list[int]          # generated tokens, the end token included when it ended the beam
    log_probs: list[float]     # one per token
    cum_log_prob: float
    score: float               # cum_log_prob / len(tokens) ** length_penalty
    logits: list[torch.Tensor] | None = None  # raw generation logits per token, when gathered


class BeamSearch:
    def __init__(self, beam_width: int, length_penalty: float, early_stopping: int, diversity_rate: float,
                 max_new_tokens: int):
        self.beam_width = beam_width
        self.length_penalty = length_penalty
        self.early_stopping = {1: True, 0: False}.get(early_stopping, "never")
        self.diversity_rate = diversity_rate
        self.max_new_tokens = max_new_tokens
        self.num_candidates = 2 * beam_width
        self.bank: list[Hypothesis] = []          # best first, at most beam_width
        self.improvement_possible = True
        self.running_scores: list[float] = [0.0]  # cum log prob of each live beam
        self.done = False

    def _normalise(self, cum_log_prob: float, length: int) -> float:
        return cum_log_prob / (length ** self.length_penalty)

    def step(self, candidates, step_log_probs: list[float], histories: list[Hypothesis], hits_stop,
             raw_logits: torch.Tensor | None = None) -> list[int]:
        """One step over the live beams `histories`. candidates: the kernel's beam_candidates
        (cumulative scores, parents, tokens), best first, for 2 * beam_width continuations;
        step_log_probs: each candidate's own log prob. hits_stop(parent, token) -> True when that
        continuation ends its beam (end id, stop word); raw_logits [num_beams, V]: the model's
        logits, kept per token when gathered. Returns the parent of each new live beam (empty
        when the search is done); the new live beams are left in self.live."""
        cum_scores, parents, tokens = (c.tolist() for c in candidates)
        generated_len = len(histories[0].tokens) + 1
        at_max_length = generated_len >= self.max_new_tokens
        hits = [at_max_length or hits_stop(p, t) for p, t in zip(parents, tokens)]

        bank_full = len(self.bank) == self.beam_width
        can_add = self.improvement_possible and not (bank_full and self.early_stopping is True)
        if can_add:
            for rank in range(min(self.beam_width, len(parents))):
                if hits[rank]:
                    self._add(self._extend(histories[parents[rank]], tokens[rank], step_log_probs[rank],
                                           cum_scores[rank], raw_logits, parents[rank]))

        running = sorted(range(len(parents)), key=lambda c: -(cum_scores[c] + (_EXCLUDED if hits[c] else 0.0)))
        running = running[:self.beam_width]
        self.live = [self._extend(histories[parents[c]], tokens[c], step_log_probs[c], cum_scores[c], raw_logits,
                                  parents[c]) for c in running]
        self.running_scores = [cum_scores[c] + (_EXCLUDED if hits[c] else 0.0) for c in running]

        if len(self.bank) == self.beam_width:
            length = (self.max_new_tokens if self.early_stopping == "never" and self.length_penalty > 0
                      else generated_len)
            best_running = self._normalise(max(self.running_scores), length)
            self.improvement_possible &= best_running > min(h.score for h in self.bank)
        all_full = len(self.bank) == self.beam_width and self.early_stopping is True
        self.done = not self.improvement_possible or all_full or all(hits)
        return [] if self.done else [parents[c] for c in running]

    def _extend(self, history: Hypothesis, token: int, log_prob: float, cum: float,
                raw_logits: torch.Tensor | None, parent: int) -> Hypothesis:
        tokens = history.tokens + [token]
        logits = None if raw_logits is None else (history.logits or []) + [raw_logits[parent]]
        return Hypothesis(tokens, history.log_probs + [log_prob], cum, self._normalise(cum, len(tokens)), logits)

    def _add(self, hypothesis: Hypothesis) -> None:
        self.bank.append(hypothesis)
        self.bank.sort(key=lambda h: -h.score)  # stable: earlier entries win ties
        del self.bank[self.beam_width:]

    def final(self, live: list[Hypothesis]) -> list[Hypothesis]:
        """The beam_width best hypotheses, best first: the bank, topped up (or, when the request
        was stopped early, competed) by the live beams scored at their current length."""
        pool = list(self.bank)
        if len(pool) < self.beam_width or not self.done:
            pool += [h for h in live if h.tokens and h.cum_log_prob > _EXCLUDED / 2]
        pool.sort(key=lambda h: -h.score)
        return pool[:self.beam_width]
