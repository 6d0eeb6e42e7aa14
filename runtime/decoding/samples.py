"""Several independent samples of one prompt (`num_return_sequences` n, beam width 1).

The n sequences share the prompt's KV blocks: one context, then they fork like beams (the
manager's beam block bookkeeping carries them). Unlike beams they never reorder: live row b is
the b-th unfinished sequence in index order, and a finished sequence leaves the live rows (the
others stay equally long: each adds one token per step). Sequence i draws exactly as a request
with seed `random_seed + i` would (its own top-p decay, its own end), so n samples equal n
separate requests with those seeds.
"""
from __future__ import annotations

import torch

from ..kernels.interface import NO_TOKEN
from ..request.spec import FinishReason
from .beam_search import Hypothesis


class Samples:
    def __init__(self, num_sequences: int, random_seed: int, top_p: float, gather_logits: bool):
        self.num_sequences = num_sequences
        self.seeds = [(random_seed + i) % (1 << 64) for i in range(num_sequences)]
        self.top_p = [top_p] * num_sequences
        self.outputs = [Hypothesis([], [], 0.0, 0.0, [] if gather_logits else None) for _ in range(num_sequences)]
        self.reasons: list[FinishReason | None] = [None] * num_sequences
        self.live: list[int] = []    # sequence index of each live row; empty before the first step

    def rows(self) -> tuple[list[int], list[int]]:
        """(the sequences that draw this step, the logits row each draws from): before the first
        step every sequence draws from the one prompt row."""
        if not self.live:
            return list(range(self.num_sequences)), [0] * self.num_sequences
        return list(self.live), list(range(len(self.live)))

    def finish_step(self, sequences: list[int], rows: list[int]) -> list[int]:
        """After the sequences drew (their outputs and reasons updated): the new live rows ->
        the row each continues (its parent), in order."""
        parents = [row for i, row in zip(sequences, rows) if self.reasons[i] is None]
        self.live = [i for i in sequences if self.reasons[i] is None]
        return parents

    @property
    def done(self) -> bool:
        return all(reason is not None for reason in self.reasons)

    def step(self, kernels, state, logits: torch.Tensor, raw: torch.Tensor | None, first_row: int) -> list[int]:
        """Every live sequence draws its token from its row of the processed logits (its own seed
        and top-p); ends per sequence as a single request's would. -> the new live rows' parents."""
        sequences, rows = self.rows()
        p, device = state.params, logits.device
        index = torch.tensor([first_row + r for r in rows], device=device)
        count = len(sequences)
        if p.is_greedy:
            tokens, log_probs = kernels.greedy(logits[index])
        else:
            seeds = [s - (1 << 64) if s >= 1 << 63 else s for s in (self.seeds[i] for i in sequences)]
            draws = kernels.uniforms(torch.tensor(seeds, dtype=torch.int64, device=device),
                                     torch.full((count,), state.num_generated, dtype=torch.int64, device=device),
                                     torch.zeros(count, dtype=torch.int64, device=device))
            tokens, log_probs = kernels.sample(
                logits[index], torch.full((count,), p.top_k, dtype=torch.int64, device=device),
                torch.tensor([self.top_p[i] for i in sequences], dtype=torch.float32, device=device), draws,
                torch.full((count,), p.normalize_log_probs, dtype=torch.bool, device=device))
        for i, row, token, log_prob in zip(sequences, rows, tokens.tolist(), log_probs.tolist()):
            self.reasons[i] = self._append(state, i, row, token, log_prob, raw, first_row)
        parents = self.finish_step(sequences, rows)
        if state.guide is not None and parents and FinishReason.NO_TOKEN not in self.reasons:
            state.guide.fork(parents, [self.outputs[i].tokens[-1] for i in self.live])
        return parents

    def _append(self, state, i: int, row: int, token: int, log_prob: float, raw, first_row: int) -> FinishReason | None:
        """Sequence i's token, as a single request's (end id not output) -> why it ends, or None."""
        p, h = state.params, self.outputs[i]
        if token == NO_TOKEN:   # every logit -inf: nothing to draw
            return FinishReason.NO_TOKEN
        reason = state.ends_beam(h.tokens, token)
        if state.guide is not None and state.guide.ends(row, token):
            reason = FinishReason.END_ID
        h.cum_log_prob += log_prob
        if reason == FinishReason.END_ID:
            return reason
        h.tokens.append(token)
        h.log_probs.append(log_prob)
        if h.logits is not None:
            h.logits.append(raw[first_row + row].cpu())
        if p.top_p_decay != 1.0 or p.top_p_reset_id >= 0:
            self.top_p[i] = p.top_p if token == p.top_p_reset_id else max(self.top_p[i] * p.top_p_decay, p.top_p_min)
        if reason is None and len(h.tokens) >= state.max_new_tokens:
            reason = FinishReason.LENGTH
        return reason
