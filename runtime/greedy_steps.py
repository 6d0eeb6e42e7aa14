"""Several greedy generation steps in one call (multi-step decoding: the batch manager's
DecodingConfig.max_decode_steps): `decode_greedy(runner, inputs, n)` runs a ModelRunner's
generation step n times, each step feeding every sequence the argmax of its previous logits, with
nothing but that token feed between the steps where the runner has the fused native step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .kernels.interface import NO_TOKEN

if TYPE_CHECKING:
    from .model_runner import ModelRunner


@dataclass(frozen=True)
class GreedySteps:
    """What `decode_greedy` picked: tokens int64 [S, n] and their log probs float32 [S, n] over the
    whole vocabulary (as kernels.greedy gives them), n <= the steps asked for."""
    tokens: torch.Tensor
    log_probs: torch.Tensor


@torch.inference_mode()
def decode_greedy(runner: "ModelRunner", inputs: dict[str, torch.Tensor], num_steps: int,
                  end_ids: list[int | None] | None = None) -> GreedySteps:
    """Up to `num_steps` generation steps in one call for plain-greedy sequences
    (DecodingParams.is_plain_greedy): `inputs` as `ModelRunner.forward`'s for a generation step (one
    new token per sequence); each later step feeds every sequence the argmax of its previous logits
    (kernels.greedy, as Decoder.step picks it) and writes its K/V one position on, so each
    sequence's block table must hold past + num_steps tokens. It ends early once every sequence
    has picked its end id (end_ids[i]; None: never) or no token at all.
    The fused step runs when the runner has one, with nothing but the token feed between the
    steps (the Python of a whole iteration, ~1.5-2 ms on a 2-core CPU, runs once per call); else
    `forward`, step by step.
    NOTE: what a sequence picks after its end (an end id, a stop word) is computed and dropped by
    the caller: at most num_steps - 1 wasted rows."""
    lengths = inputs["input_lengths"]
    num_rows = lengths.numel()
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps: must be an integer >= 1, got {num_steps!r}")
    if lengths.tolist() != [1] * num_rows or "num_logits" in inputs or "return_context_logits" in inputs:
        raise ValueError("decode_greedy: every sequence must have one new token and one logits row")
    stops = [NO_TOKEN if e is None else e for e in end_ids or [None] * num_rows]
    fused = None
    if runner.decode_step is not None:
        fused = runner.planner.fused_generation(inputs, runner.decode_step.max_rows)
    if fused is not None:
        # Every step's positions, slots and lengths, int64 [num_steps, rows] (row k: step k's),
        # computed once: between the steps only the picked tokens change hands.
        ids, positions, _, tables, seq_lens = fused
        tpb = runner.tokens_per_block
        offsets = torch.arange(num_steps)[:, None]
        past = seq_lens[None, :] - 1 + offsets
        written = None   # the blocks the steps write, where the table has them
        if int(past[-1].max()) // tpb < tables.shape[1]:
            written = tables.t().gather(0, past // tpb).to(torch.int64)
        if written is None or int(written.min()) < 0 or int(written.max()) >= runner.num_blocks:
            raise ValueError(f"block_tables: must hold every sequence's past + {num_steps} tokens")
        all_slots = (written * tpb + past % tpb).contiguous()
        all_positions = (positions[None, :] + offsets).contiguous()
        all_seq_lens = (past + 1).contiguous()
    picked_tokens, picked_log_probs = [], []
    ended = [False] * num_rows
    for step in range(num_steps):
        if fused is not None:
            logits = runner.decode_step(ids, all_positions[step], all_slots[step], tables, all_seq_lens[step])
        else:
            logits = runner.forward(inputs)["logits"]
        tokens, log_probs = runner.kernels.greedy(logits)
        tokens, log_probs = tokens.to("cpu", torch.int64), log_probs.to("cpu", torch.float32)
        picked_tokens.append(tokens)
        picked_log_probs.append(log_probs)
        values = tokens.tolist()
        ended = [e or t == stop or t == NO_TOKEN for e, t, stop in zip(ended, values, stops)]
        if step + 1 == num_steps or all(ended):
            break
        if NO_TOKEN in values:   # a row with no token: feed anything valid; its picks are dropped
            tokens = tokens.masked_fill(tokens == NO_TOKEN, 0)
        if fused is not None:
            ids = tokens
        else:
            inputs = dict(inputs, input_ids=tokens.to(torch.int32), past_lengths=inputs["past_lengths"] + 1,
                          **({"position_ids": inputs["position_ids"] + 1} if "position_ids" in inputs else {}))
    return GreedySteps(torch.stack(picked_tokens, 1), torch.stack(picked_log_probs, 1))

