"""From ModelRunner.forward's tensor dict to the step's layout: the input names and their checks
(`check_inputs`), and `StepPlanner`, which turns checked inputs into a StepLayout (positions, cache
slots, the generation / context split, logits rows, adapters and prompt tables) or, for a step the
fused generation call takes, its arguments. Pure bookkeeping over small host tensors; the runner
owns the model and the pool."""
from __future__ import annotations

import torch

from .adapters.lora_step import LoraWeightStore
from .adapters.prompt_tuning import TABLE_INPUTS, virtual_tokens
from .models.transformer import StepLayout

REQUIRED_INPUTS = ("input_ids", "input_lengths", "past_lengths", "block_tables")
OPTIONAL_INPUTS = ("position_ids", "return_context_logits", "num_logits", "lora_task_ids", *TABLE_INPUTS)
# Inputs a fused generation step may carry (anything else changes the forward: LoRA, prompt tables,
# context logits).
FUSED_INPUTS = frozenset(REQUIRED_INPUTS) | {"position_ids", "num_logits"}


class StepPlanner:
    """The runner's constants a layout needs: vocab_size and hidden_size (the model's), the paged
    pool's tokens_per_block and num_blocks, the attention window and sink tokens (ModelRunner's
    docstring), the device and compute dtype of the step tensors, and the resident adapters."""

    def __init__(self, vocab_size: int, hidden_size: int, tokens_per_block: int, num_blocks: int,
                 attention_window: int | None, sink_token_length: int, device: torch.device, dtype: torch.dtype,
                 lora_store: LoraWeightStore):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.tokens_per_block, self.num_blocks = tokens_per_block, num_blocks
        self.attention_window, self.sink_token_length = attention_window, sink_token_length
        self.device, self.dtype, self.lora_store = device, dtype, lora_store

    def layout(self, inputs: dict[str, torch.Tensor]) -> StepLayout:
        """The step's layout (StepLayout) from ModelRunner.forward's inputs, checked: ValueError naming
        the input otherwise."""
        check_inputs(inputs)
        tpb = self.tokens_per_block
        lengths = inputs["input_lengths"].to("cpu", torch.int64)
        past = inputs["past_lengths"].to("cpu", torch.int64)
        input_ids = inputs["input_ids"].to("cpu", torch.int64)
        block_tables = inputs["block_tables"].to("cpu", torch.int32)
        num_seqs, num_tokens = lengths.numel(), input_ids.numel()
        if past.numel() != num_seqs or block_tables.shape[0] != num_seqs:
            raise ValueError(f"past_lengths / block_tables: expected {num_seqs} rows like input_lengths, got "
                             f"{past.numel()} and {block_tables.shape[0]}")
        if num_seqs == 0 or int(lengths.sum()) != num_tokens or bool((lengths <= 0).any()) or bool((past < 0).any()):
            raise ValueError(f"input_lengths: must be positive and sum to len(input_ids)={num_tokens}, "
                             f"got {lengths.tolist()} (past_lengths {past.tolist()})")
        vocab = self.vocab_size
        input_ids, prompt_embeddings = virtual_tokens(inputs, input_ids, lengths, vocab, self.hidden_size)
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
            raise ValueError(f"input_ids: token ids must be in [0, {vocab}), got min {int(input_ids.min())} "
                             f"max {int(input_ids.max())}")
        blocks_needed = (past + lengths + tpb - 1) // tpb
        if int(blocks_needed.max()) > block_tables.shape[1]:
            raise ValueError(f"block_tables: {block_tables.shape[1]} columns, but a sequence needs "
                             f"{int(blocks_needed.max())} blocks of {tpb} tokens")
        used = block_tables[self.read_blocks(past, lengths, blocks_needed, block_tables.shape[1])]
        if int(used.min()) < 0 or int(used.max()) >= self.num_blocks:
            raise ValueError(f"block_tables: block ids must be in [0, {self.num_blocks}), got "
                             f"min {int(used.min())} max {int(used.max())}")

        starts = torch.cumsum(lengths, 0) - lengths
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), lengths)
        cache_pos = past[seq_of_token] + torch.arange(num_tokens) - starts[seq_of_token]
        slots = block_tables[seq_of_token, cache_pos // tpb].long() * tpb + cache_pos % tpb
        position_ids = inputs.get("position_ids")
        position_ids = cache_pos if position_ids is None else position_ids.to("cpu", torch.int64)
        if position_ids.shape != (num_tokens,):
            raise ValueError(f"position_ids: expected shape [{num_tokens}], got {list(position_ids.shape)}")

        is_generation = lengths == 1
        generation_seq_ids = torch.nonzero(is_generation).flatten()
        context_seq_ids = torch.nonzero(~is_generation).flatten().tolist()
        starts_list, lengths_list, past_list = starts.tolist(), lengths.tolist(), past.tolist()
        context_spans = [(s, starts_list[s], lengths_list[s], past_list[s]) for s in context_seq_ids]

        context_logits_index = None
        flags = inputs.get("return_context_logits")
        if flags is not None and bool(flags.any()):
            flagged = torch.nonzero(flags.to("cpu").bool().flatten()).flatten().tolist()
            context_logits_index = torch.cat([torch.arange(starts_list[s], starts_list[s] + lengths_list[s])
                                              for s in flagged])

        logits_token_index = starts + lengths - 1
        num_logits = inputs.get("num_logits")
        if num_logits is not None:
            num_logits = num_logits.to("cpu", torch.int64)
            if num_logits.shape != (num_seqs,) or bool((num_logits < 1).any()) or bool((num_logits > lengths).any()):
                raise ValueError(f"num_logits: expected {num_seqs} values in [1, input_lengths], got "
                                 f"{num_logits.tolist()} (input_lengths {lengths_list})")
            first = starts + lengths - num_logits           # each sequence's first token with logits
            offset = torch.arange(int(num_logits.sum())) - torch.repeat_interleave(
                torch.cumsum(num_logits, 0) - num_logits, num_logits)
            logits_token_index = torch.repeat_interleave(first, num_logits) + offset
        lora = None
        task_ids = inputs.get("lora_task_ids")
        if task_ids is not None:
            if task_ids.shape != (num_seqs,):
                raise ValueError(f"lora_task_ids: expected [{num_seqs}], got {list(task_ids.shape)}")
            lora = self.lora_store.plan(task_ids.tolist(), starts_list, lengths_list)
        dev = self.device
        if prompt_embeddings is not None:
            prompt_embeddings = (prompt_embeddings[0].to(dev), prompt_embeddings[1].to(dev, self.dtype))
        return StepLayout(
            input_ids=input_ids.to(dev), position_ids=position_ids.to(dev), slot_mapping=slots.to(dev),
            logits_token_index=logits_token_index.to(dev),
            generation_seq_ids=generation_seq_ids.to(dev),
            generation_token_index=starts[generation_seq_ids].to(dev),
            generation_block_tables=block_tables[generation_seq_ids].to(dev),
            generation_seq_lens=(past[generation_seq_ids] + 1).to(dev),
            context_spans=context_spans, block_tables=block_tables.to(dev),
            context_logits_index=None if context_logits_index is None else context_logits_index.to(dev),
            lora=lora, prompt_embeddings=prompt_embeddings)


    def fused_generation(self, inputs: dict[str, torch.Tensor], max_rows: int) -> tuple | None:
        """The fused step's arguments (input_ids, positions, slots, block_tables, seq_lens) when
        every sequence of the step has exactly one new token, there are at most max_rows of them,
        nothing else changes the forward, and the inputs pass the checks of _layout; else None (the step takes the general path, which reports bad inputs)."""
        if not set(inputs) <= FUSED_INPUTS:
            return None
        lengths = inputs.get("input_lengths")
        if lengths is None or lengths.dim() != 1 or not 1 <= lengths.numel() <= max_rows:
            return None
        try:
            check_inputs(inputs)
        except ValueError:
            return None
        # At most max_rows sequences: the checks run on Python lists (a generation step's fixed
        # cost; ~25 tensor ops took ~0.2 ms), the same ones as _layout's and read_blocks'.
        num_seqs, tpb, window = lengths.numel(), self.tokens_per_block, self.attention_window
        num_logits = inputs.get("num_logits")
        if lengths.tolist() != [1] * num_seqs or (num_logits is not None and num_logits.tolist() != [1] * num_seqs):
            return None
        ids, past = inputs["input_ids"].tolist(), inputs["past_lengths"].tolist()
        position_ids = inputs.get("position_ids")
        positions = past if position_ids is None else position_ids.tolist()
        block_tables = inputs["block_tables"].to("cpu", torch.int32).contiguous()
        if (len(ids) != num_seqs or len(past) != num_seqs or len(positions) != num_seqs
                or block_tables.shape[0] != num_seqs or min(past) < 0 or min(positions) < 0 or min(ids) < 0
                or max(ids) >= self.vocab_size):
            return None
        slots = []
        for length, row in zip(past, block_tables.tolist()):
            written = length // tpb   # the block the new key goes to; the step reads blocks [0, written]
            if written >= len(row):
                return None
            if window is None:
                used = row[:written + 1]
            else:   # keys visible to the query at `length`: [length - window + 1, ...) and the sinks
                first_visible = max(length - window + 1, 0) // tpb
                num_sink_blocks = -(-min(length + 1, self.sink_token_length) // tpb)
                used = [b for c, b in enumerate(row[:written + 1]) if c >= first_visible or c < num_sink_blocks]
            if min(used) < 0 or max(used) >= self.num_blocks:
                return None
            slots.append(row[written] * tpb + length % tpb)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)   # noqa: E731
        return (as_tensor(ids), as_tensor(positions), as_tensor(slots), block_tables,
                as_tensor([length + 1 for length in past]))

    def read_blocks(self, past: torch.Tensor, lengths: torch.Tensor, blocks_needed: torch.Tensor,
                     width: int) -> torch.Tensor:
        """bool [S, width]: table entries this step reads or writes (they must be block ids)."""
        column = torch.arange(width)[None, :]
        read = column < blocks_needed[:, None]
        if self.attention_window is not None:
            tpb = self.tokens_per_block
            # Keys visible to queries at positions >= past: [past - w + 1, ...) and the sinks.
            first_visible = (past - self.attention_window + 1).clamp(min=0) // tpb
            num_sink_blocks = -(-torch.clamp(past + lengths, max=self.sink_token_length) // tpb)
            read &= (column >= first_visible[:, None]) | (column < num_sink_blocks[:, None])
        return read


def check_inputs(inputs: dict[str, torch.Tensor]) -> None:
    missing = [name for name in REQUIRED_INPUTS if name not in inputs]
    if missing:
        raise ValueError(f"forward inputs: missing {missing}; required {list(REQUIRED_INPUTS)}")
    unknown = set(inputs) - set(REQUIRED_INPUTS) - set(OPTIONAL_INPUTS)
    if unknown:
        raise ValueError(f"forward inputs: unknown names {sorted(unknown)}")
    for name in ("input_ids", "input_lengths", "past_lengths", "position_ids", "num_logits", "lora_task_ids"):
        t = inputs.get(name)
        if t is not None and (t.dim() != 1 or t.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"{name}: expected a 1-D int32 tensor, got {t.dtype} {list(t.shape)}")
    bt = inputs["block_tables"]
    if bt.dim() != 2 or bt.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables: expected a 2-D int32 tensor, got {bt.dtype} {list(bt.shape)}")
