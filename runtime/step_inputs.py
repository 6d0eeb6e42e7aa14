"""The one packer: a step's sequences -> `ModelRunner.forward`'s input tensor dict."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class SequenceStep:
    token_ids: Sequence[int]        # the new tokens of this step
    past_length: int                # tokens of the sequence already in the KV cache
    block_table: Sequence[int]      # KV block ids in token order (RELEASED = -1 entries: never read)
    return_context_logits: bool = False   # logits of every new token wanted (else the last one's only)


def pack_step(sequences: Sequence[SequenceStep]) -> dict[str, torch.Tensor]:
    """-> input_ids int32 [T], input_lengths int32 [S], past_lengths int32 [S], block_tables int32
    [S, max blocks] (rows padded with 0), and return_context_logits bool [S] only when any is set."""
    width = max(len(s.block_table) for s in sequences)
    inputs = {
        "input_ids": torch.tensor([t for s in sequences for t in s.token_ids], dtype=torch.int32),
        "input_lengths": torch.tensor([len(s.token_ids) for s in sequences], dtype=torch.int32),
        "past_lengths": torch.tensor([s.past_length for s in sequences], dtype=torch.int32),
        "block_tables": torch.tensor([list(s.block_table) + [0] * (width - len(s.block_table)) for s in sequences],
                                     dtype=torch.int32)}
    if any(s.return_context_logits for s in sequences):
        inputs["return_context_logits"] = torch.tensor([s.return_context_logits for s in sequences], dtype=torch.bool)
    return inputs
