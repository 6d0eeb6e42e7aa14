"""Logits processing of one decoder step, in place on the step's rows, through the kernel backend:
penalties (embedding bias, temperature, repetition / presence / frequency, min length), bans (bad
words, no-repeat n-grams), guides (the grammar's mask; the end tokens only where the grammar is
complete), then min-p over what is left. A token left at -inf is never chosen; a row left with
no finite logit is reported by the samplers (interface.NO_TOKEN). Called by `Decoder.step`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .guided import bitmask_words


@dataclass
class StepRows:
    """Row bookkeeping of one step: row -> (state, beam, draft offset j) and each state's first row."""
    state_of_row: list          # DecodeState per row
    beam_of_row: list[int]
    offset_of_row: list[int]          # j: the row follows drafts[:j] of its state (0 without drafts)
    drafts_of_row: list[tuple[int, ...]]
    first_row: list[int]

    @classmethod
    def of(cls, states: list, drafts: list[tuple[int, ...]]) -> "StepRows":
        rows = cls([], [], [], [], [])
        for s, d in zip(states, drafts):
            assert not s.is_finished, "a finished request has no rows"
            assert not d or (s.search is None and s.samples is None and s.num_rows == 1), "drafts need one sequence"
            rows.first_row.append(len(rows.state_of_row))
            n = s.num_rows + len(d)
            rows.state_of_row += [s] * n
            rows.beam_of_row += range(s.num_rows) if not d else [0] * n
            rows.offset_of_row += range(n) if d else [0] * n
            rows.drafts_of_row += [tuple(d)] * n
        return rows

    def sequence(self, r: int) -> list[int]:
        """Prompt + generated tokens the row's logits follow (drafts included)."""
        drafts = self.drafts_of_row[r][:self.offset_of_row[r]]
        return self.state_of_row[r].record.sequence(self.beam_of_row[r]) + list(drafts)

    def num_generated(self, r: int) -> int:
        return self.state_of_row[r].num_generated + self.offset_of_row[r]


def process_logits(kernels, states: list, drafts: list[tuple[int, ...]], logits: torch.Tensor,
                   rows: StepRows) -> None:
    """logits float32 [R, V] (the step's rows), in place.
    NOTE: the guide's mask comes before min-p, so min-p is relative to the best token the grammar
    allows (a masked token has probability 0), and never leaves a guided row empty by itself."""
    _apply_penalties(kernels, logits, rows)
    _apply_bans(kernels, logits, rows)
    _apply_guides(kernels, states, drafts, logits, rows)
    _apply_min_p(kernels, logits, rows)


def _apply_penalties(kernels, logits: torch.Tensor, rows: StepRows) -> None:
    picked = [r for r, s in enumerate(rows.state_of_row) if s.params.needs_penalties]
    if not picked:
        return
    device = logits.device
    sequences = [rows.sequence(r) for r in picked]
    max_len = max(len(seq) for seq in sequences)
    token_ids = torch.tensor([seq + [0] * (max_len - len(seq)) for seq in sequences], dtype=torch.int64)
    params = [rows.state_of_row[r].params for r in picked]
    bias = None
    if any(p.embedding_bias is not None for p in params):
        bias = torch.zeros(len(picked), logits.shape[1])
        for j, p in enumerate(params):
            if p.embedding_bias is not None:
                bias[j] = p.embedding_bias
        bias = bias.to(device)

    def column(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    kernels.apply_penalties(
        logits, column(picked, torch.int64), token_ids.to(device),
        column([len(seq) for seq in sequences], torch.int64), bias,
        column([p.temperature or 1.0 for p in params], torch.float32),
        column([p.repetition_penalty for p in params], torch.float32),
        column([p.presence_penalty for p in params], torch.float32),
        column([p.frequency_penalty for p in params], torch.float32),
        column([p.min_length for p in params], torch.int64),
        column([rows.num_generated(r) for r in picked], torch.int64),
        column([-1 if p.end_id is None else p.end_id for p in params], torch.int64))


def _apply_bans(kernels, logits: torch.Tensor, rows: StepRows) -> None:
    ban_rows, ban_tokens = [], []
    for r, s in enumerate(rows.state_of_row):
        p = s.params
        if not p.bad_words and not p.no_repeat_ngram_size:
            continue
        sequence = rows.sequence(r)
        banned = set()
        for word in p.bad_words:
            n = len(word)
            if n == 1 or (len(sequence) >= n - 1 and tuple(sequence[len(sequence) - n + 1:]) == word[:-1]):
                banned.add(word[-1])
        if p.no_repeat_ngram_size:
            banned.update(kernels.repeat_ngram_bans(torch.tensor(sequence), p.no_repeat_ngram_size).tolist())
        ban_rows += [r] * len(banned)
        ban_tokens += sorted(banned)
    if ban_rows:
        kernels.ban_tokens(logits, torch.tensor(ban_rows, device=logits.device),
                           torch.tensor(ban_tokens, device=logits.device))


def _apply_guides(kernels, states: list, drafts: list[tuple[int, ...]], logits: torch.Tensor,
                  rows: StepRows) -> None:
    """Guided requests: -inf for every token their grammar does not allow next (per live beam,
    and per draft position as if the drafts before it were accepted); the end tokens (stop
    tokens, the request's end id) are allowed exactly where the grammar is complete."""
    guided = [i for i, s in enumerate(states) if s.guide is not None]
    if not guided:
        return
    picked = [r for i in guided
              for r in range(rows.first_row[i], rows.first_row[i] + states[i].num_rows + len(drafts[i]))]
    bitmask = torch.full((len(picked), bitmask_words(logits.shape[1])), -1, dtype=torch.int32)
    start = 0
    for i in guided:
        s = states[i]
        if drafts[i]:
            s.guide.fill_bitmask(bitmask, start, 0, tuple(drafts[i]), s.params.end_id)
        else:
            for beam in range(s.num_rows):
                s.guide.fill_bitmask(bitmask, start + beam, beam, end_id=s.params.end_id)
        start += s.num_rows + len(drafts[i])
    kernels.apply_token_bitmask(logits, torch.tensor(picked, device=logits.device), bitmask.to(logits.device))


def _apply_min_p(kernels, logits: torch.Tensor, rows: StepRows) -> None:
    """min-p on the rows of sampled requests (it cannot change a greedy pick)."""
    picked = [r for r, s in enumerate(rows.state_of_row) if s.params.min_p > 0 and not s.params.is_greedy]
    if picked:
        device = logits.device
        kernels.apply_min_p(logits, torch.tensor(picked, device=device),
                            torch.tensor([rows.state_of_row[r].params.min_p for r in picked],
                                         dtype=torch.float32, device=device))
