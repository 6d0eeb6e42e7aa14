"""The one packer from a step's sequences to ModelRunner.forward's tensor dict; used by the
manager's executor, GptSession, the tests and the benchmarks."""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass(frozen=True)
class SequenceStep:
    """One sequence (one beam) of a step."""
    # the new tokens of this step (a context chunk, or 1 generation token, or 1 + D draft tokens)
    token_ids: Sequence[int]
    past_length: int                # tokens of the sequence already in the KV cache
    block_table: Sequence[int]      # KV block ids in token order (RELEASED = -1 entries allowed: never read)
    return_context_logits: bool = False   # logits of every new token wanted (as context_logits)
    num_logits: int = 1             # logits of the last n new tokens (a token + D drafts: D + 1)
    lora_task_id: int | None = None  # the LoRA adapter (resident in the runner's store) it runs with
    # float [T, hidden]: token ids vocab_size + j of this step take row j (prompt tuning); the
    # same tensor object for several sequences is packed once
    prompt_table: Any = None


def pack_step(sequences: Sequence[SequenceStep]) -> dict[str, torch.Tensor]:
    """-> ModelRunner.forward inputs: input_ids int32 [T], input_lengths int32 [S], past_lengths int32 [S],
    block_tables int32 [S, max blocks] (rows padded with 0); return_context_logits bool [S] and
    num_logits int32 [S] only when some sequence asks; lora_task_ids int64 [S] (-1: none) when some
    sequence has an adapter; prompt_embedding_table [P, hidden] (the distinct tables, stacked),
    prompt_table_offsets int32 [S] (first row of each sequence's table, -1: none) and
    prompt_vocab_sizes int32 [S] (its rows) when some sequence has a prompt table."""
    if not sequences:
        raise ValueError("pack_step: sequences must not be empty")
    # NOTE: plain lists, then one C-level conversion through array('i') per field: several times
    # faster than torch.tensor on (nested) Python lists. The tensors share the arrays' memory.
    token_ids: list[int] = []
    lengths, past, flags, num_logits = [], [], [], []
    width = max(len(s.block_table) for s in sequences)
    tables: list[int] = []
    for s in sequences:
        if not s.token_ids:
            raise ValueError(f"SequenceStep.token_ids: must not be empty (sequence {len(lengths)})")
        token_ids += s.token_ids
        lengths.append(len(s.token_ids))
        past.append(s.past_length)
        flags.append(s.return_context_logits)
        num_logits.append(s.num_logits)
        tables += s.block_table
        if len(s.block_table) < width:
            tables += [0] * (width - len(s.block_table))
    inputs = {"input_ids": _int32("token_ids", token_ids), "input_lengths": _int32("token_ids", lengths),
              "past_lengths": _int32("past_length", past),
              "block_tables": _int32("block_table", tables).view(len(sequences), width)}
    if any(flags):
        inputs["return_context_logits"] = torch.tensor(flags, dtype=torch.bool)
    if any(n != 1 for n in num_logits):
        inputs["num_logits"] = _int32("num_logits", num_logits)
    if any(s.lora_task_id is not None for s in sequences):
        inputs["lora_task_ids"] = torch.tensor([-1 if s.lora_task_id is None else s.lora_task_id
                                                for s in sequences], dtype=torch.int64)
    if any(s.prompt_table is not None for s in sequences):
        inputs.update(_prompt_tables(sequences))
    return inputs


def _prompt_tables(sequences: Sequence[SequenceStep]) -> dict[str, torch.Tensor]:
    tables, first_row, offsets, sizes = [], {}, [], []
    num_rows = 0
    for s in sequences:
        table = s.prompt_table
        if table is None:
            offsets.append(-1)
            sizes.append(0)
            continue
        if id(table) not in first_row:
            first_row[id(table)] = num_rows
            tables.append(table)
            num_rows += table.shape[0]
        offsets.append(first_row[id(table)])
        sizes.append(table.shape[0])
    return {"prompt_embedding_table": tables[0] if len(tables) == 1 else torch.cat(tables),
            "prompt_table_offsets": _int32("prompt_table", offsets), "prompt_vocab_sizes": _int32("prompt_table", sizes)}


def _int32(field: str, values: list[int]) -> torch.Tensor:
    """int32 [len(values)], sharing the memory of one array('i')."""
    if not values:
        return torch.zeros(0, dtype=torch.int32)
    try:
        return torch.frombuffer(array("i", values), dtype=torch.int32)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"SequenceStep.{field}: expected int32 values ({e})") from None
