"""Prompt tuning (TensorRT-LLM's convention): a prompt token id vocab_size + j takes row j of its
request's prompt embedding table instead of an embedding row. The checks the front-ends share
(`check_prompt_table`) and the runner's per-step resolution of virtual tokens (`virtual_tokens`)."""
from __future__ import annotations

import hashlib

import torch

TABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TABLE_INPUTS = ("prompt_embedding_table", "prompt_table_offsets", "prompt_vocab_sizes")


def check_prompt_table(table, hidden_size: int, name: str = "prompt_embedding_table") -> torch.Tensor:
    """[1, T, hidden] or [T, hidden] float -> a float32 CPU copy [T, hidden]; ValueError naming
    `name` and the value otherwise."""
    if not isinstance(table, torch.Tensor):
        raise ValueError(f"{name}: expected a float tensor [T, {hidden_size}], got {type(table).__name__}")
    _check_values(table, name)
    t = table[0] if table.dim() == 3 and table.shape[0] == 1 else table
    if t.dim() != 2 or t.shape[0] == 0 or t.shape[1] != hidden_size:
        raise ValueError(f"{name}: expected shape [T, {hidden_size}] or [1, T, {hidden_size}] with T >= 1, "
                         f"got {list(table.shape)}")
    t = t.detach().to("cpu", torch.float32).clone()
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name}: must be finite (NaN or inf found)")
    return t


def _check_values(table: torch.Tensor, name: str) -> None:
    """A real float tensor with values (not on the meta device)."""
    if table.dtype not in TABLE_DTYPES:
        raise ValueError(f"{name}: expected float32, float16 or bfloat16, got {table.dtype}")
    if table.device.type == "meta":
        raise ValueError(f"{name}: a tensor on the meta device (no values), shape {list(table.shape)}")


def table_digest(table: torch.Tensor) -> bytes:
    """128-bit digest of a table's values (float32 CPU): the identity block reuse keys it by."""
    return hashlib.blake2b(table.numpy().tobytes(), digest_size=16).digest()


def virtual_tokens(inputs: dict[str, torch.Tensor], input_ids: torch.Tensor, lengths: torch.Tensor,
                   vocab_size: int, hidden_size: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """input_ids int64 [T] (CPU) -> (input_ids with virtual tokens set to 0, (token index int64 [P],
    table rows float [P, hidden]) or None). ValueError for a virtual id outside its sequence's table
    (or in a sequence with none); ids of sequences without a table are left to the caller's check."""
    if "prompt_embedding_table" not in inputs:
        return input_ids, None
    missing = [n for n in TABLE_INPUTS if n not in inputs]
    if missing:
        raise ValueError(f"forward inputs: {missing} missing; {list(TABLE_INPUTS)} come together")
    table = inputs["prompt_embedding_table"]
    _check_values(table, "prompt_embedding_table")
    if table.dim() != 2 or table.shape[1] != hidden_size:
        raise ValueError(f"prompt_embedding_table: expected [P, {hidden_size}], got {list(table.shape)}")
    is_virtual = input_ids >= vocab_size
    if not bool(is_virtual.any()):
        return input_ids, None
    num_seqs = lengths.numel()
    offsets = inputs["prompt_table_offsets"].to("cpu", torch.int64)
    sizes = inputs["prompt_vocab_sizes"].to("cpu", torch.int64)
    if offsets.shape != (num_seqs,) or sizes.shape != (num_seqs,):
        raise ValueError(f"prompt_table_offsets / prompt_vocab_sizes: expected [{num_seqs}] each, got "
                         f"{list(offsets.shape)} and {list(sizes.shape)}")
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), lengths)
    index = torch.nonzero(is_virtual).flatten()
    seqs = seq_of_token[index]
    row = input_ids[index] - vocab_size
    bad = (offsets[seqs] < 0) | (row >= sizes[seqs]) | (offsets[seqs] + sizes[seqs] > table.shape[0])
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        seq = int(seqs[i])
        raise ValueError(f"input_ids: token id {int(input_ids[index[i]])} of sequence {seq} is outside "
                         f"[0, {vocab_size} + its prompt table's {int(sizes[seq])} rows)")
    rows = table[(offsets[seqs] + row).to(table.device)]
    return input_ids.masked_fill(is_virtual, 0), (index, rows)


def per_sequence_tables(table, batch_size: int, hidden_size: int) -> list[torch.Tensor | None]:
    """GptSession's GenerationInput.prompt_embedding_table: None, [T, hidden] for every sequence or
    [batch, T, hidden] one each -> a float32 table (or None) per sequence."""
    name = "GenerationInput.prompt_embedding_table"
    if table is None:
        return [None] * batch_size
    if isinstance(table, torch.Tensor) and table.dim() == 3 and table.shape[0] == batch_size and batch_size > 1:
        return [check_prompt_table(t, hidden_size, name) for t in table]
    return [check_prompt_table(table, hidden_size, name)] * batch_size
