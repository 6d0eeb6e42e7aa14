"""GptSession: static-batch generation over the tensor-dict runtime (the seeds' C++ runtime API).

A batch runs in lockstep: one packed context step for all prompts (split by the engine's
max_num_tokens), then one generation step per token for the sequences still running. Each
sequence owns a fixed slice of the session's KV pool.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .config import ModelConfig
from .engine import Engine
from .model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorldConfig:
    """Single-device world (tensor and pipeline parallelism of 1)."""
    tensor_parallelism: int = 1
    pipeline_parallelism: int = 1
    rank: int = 0
    gpus_per_node: int = 8
    device_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.tensor_parallelism != 1 or self.pipeline_parallelism != 1 or self.rank != 0:
            raise ValueError(f"WorldConfig: only tensor_parallelism=1, pipeline_parallelism=1, rank=0 are "
                             f"supported, got {self.tensor_parallelism}, {self.pipeline_parallelism}, {self.rank}")

    @property
    def size(self) -> int:
        return self.tensor_parallelism * self.pipeline_parallelism


def _per_sequence(name: str, value, batch_size: int, default):
    """A SamplingConfig field (None, a scalar or one value per sequence) -> list of batch_size."""
    if value is None:
        return [default] * batch_size
    if isinstance(value, torch.Tensor):
        value = value.flatten().tolist()
    if not isinstance(value, (list, tuple)):
        return [value] * batch_size
    if len(value) == 1:
        return list(value) * batch_size
    if len(value) != batch_size:
        raise ValueError(f"SamplingConfig.{name}: expected 1 or {batch_size} values, got {len(value)}")
    return list(value)


@dataclass
class SamplingConfig:
    """Per-sequence decoding settings: each field None (default), one value, or one per sequence."""
    beam_width: int = 1
    temperature: Sequence[float] | float | None = None
    min_length: Sequence[int] | int | None = None
    repetition_penalty: Sequence[float] | float | None = None
    presence_penalty: Sequence[float] | float | None = None
    frequency_penalty: Sequence[float] | float | None = None
    random_seed: Sequence[int] | int | None = None
    top_k: Sequence[int] | int | None = None
    top_p: Sequence[float] | float | None = None
    top_p_decay: Sequence[float] | float | None = None
    top_p_min: Sequence[float] | float | None = None
    top_p_reset_ids: Sequence[int] | int | None = None
    beam_search_diversity_rate: Sequence[float] | float | None = None
    length_penalty: Sequence[float] | float | None = None

    def check_greedy(self, batch_size: int) -> None:
        """This runtime decodes greedily; refuse settings that would change greedy tokens."""
        if self.beam_width != 1:
            raise ValueError(f"SamplingConfig.beam_width: only 1 is supported, got {self.beam_width}")
        checks = (("top_k", 0, lambda v: v in (0, 1)), ("top_p", 0.0, lambda v: v == 0.0),
                  ("min_length", 0, lambda v: v <= 1), ("repetition_penalty", 1.0, lambda v: v in (0.0, 1.0)),
                  ("presence_penalty", 0.0, lambda v: v == 0.0), ("frequency_penalty", 0.0, lambda v: v == 0.0))
        for name, default, is_greedy in checks:
            for value in _per_sequence(name, getattr(self, name), batch_size, default):
                if not is_greedy(value):
                    raise ValueError(f"SamplingConfig.{name}: {value!r} is not supported; this runtime "
                                     "decodes greedily (top_k 0/1, top_p 0, no penalties)")


@dataclass
class GenerationInput:
    end_id: int
    pad_id: int
    ids: torch.Tensor           # int32 [batch, max_input_len] right-padded, or [num_tokens] when packed
    lengths: torch.Tensor       # int32 [batch]
    packed: bool = False
    max_new_tokens: int | None = None
    embedding_bias: torch.Tensor | None = None
    bad_words_list: torch.Tensor | None = None
    stop_words_list: torch.Tensor | None = None

    def prompts(self) -> list[list[int]]:
        lengths = self.lengths.flatten().tolist()
        if self.packed:
            flat = self.ids.flatten().tolist()
            if sum(lengths) != len(flat):
                raise ValueError(f"GenerationInput.lengths: sum {sum(lengths)} != packed ids length {len(flat)}")
            starts = [0, *itertools.accumulate(lengths)][:-1]
            return [flat[s:s + n] for s, n in zip(starts, lengths)]
        if self.ids.dim() != 2 or self.ids.shape[0] != len(lengths):
            raise ValueError(f"GenerationInput.ids: expected [batch={len(lengths)}, max_input_len], "
                             f"got {list(self.ids.shape)}")
        rows = self.ids.tolist()
        if any(n <= 0 or n > len(row) for n, row in zip(lengths, rows)):
            raise ValueError(f"GenerationInput.lengths: must be in [1, {self.ids.shape[1]}], got {lengths}")
        return [row[:n] for row, n in zip(rows, lengths)]


@dataclass
class GenerationOutput:
    ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int32))
    lengths: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int32))
    log_probs: torch.Tensor | None = None
    context_logits: torch.Tensor | None = None
    generation_logits: torch.Tensor | None = None
    # (ids [batch, beam, max_seq_len], step, all_finished) -> None, after every generation step
    on_token_generated: Callable[[torch.Tensor, int, bool], None] | None = None


class GptSession:
    @dataclass
    class Config:
        max_batch_size: int
        max_beam_width: int
        max_sequence_length: int
        decoder_per_request: bool = False
        cuda_graph_mode: bool = False
        kv_cache_config: object | None = None
        ctx_micro_batch_size: int | None = None
        gen_micro_batch_size: int | None = None

    def __init__(self, config: "GptSession.Config", model_config: ModelConfig, world_config: WorldConfig,
                 engine: Engine, kernels=None, device: str | torch.device | None = None):
        if model_config != engine.model_config:
            raise ValueError("model_config: does not match the engine's model config")
        for name in ("max_batch_size", "max_beam_width", "max_sequence_length"):
            value = getattr(config, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GptSession.Config.{name}: must be a positive integer, got {value!r}")
        if config.max_sequence_length > engine.build_config.max_seq_len:
            raise ValueError(f"GptSession.Config.max_sequence_length: {config.max_sequence_length} exceeds the "
                             f"engine's max_seq_len {engine.build_config.max_seq_len}")
        self.config, self.world_config, self.engine = config, world_config, engine
        tpb = engine.build_config.tokens_per_block
        self.blocks_per_sequence = -(-config.max_sequence_length // tpb)
        num_blocks = config.max_batch_size * config.max_beam_width * self.blocks_per_sequence
        self.runner = ModelRunner(engine, num_blocks, kernels=kernels, device=device)

    def generate(self, output: GenerationOutput, inputs: GenerationInput, sampling: SamplingConfig) -> None:
        prompts = inputs.prompts()
        batch = len(prompts)
        if not 0 < batch <= self.config.max_batch_size:
            raise ValueError(f"GenerationInput: batch size {batch} not in [1, {self.config.max_batch_size}]")
        sampling.check_greedy(batch)
        for name in ("embedding_bias", "bad_words_list", "stop_words_list"):
            if getattr(inputs, name) is not None:
                raise ValueError(f"GenerationInput.{name}: not supported by this runtime's greedy decoder")
        max_input_len = max(len(p) for p in prompts)
        max_new_tokens = inputs.max_new_tokens
        if max_new_tokens is None or max_new_tokens <= 0:
            raise ValueError(f"GenerationInput.max_new_tokens: must be a positive integer, got {max_new_tokens!r}")
        max_seq_len = max_input_len + max_new_tokens
        if max_seq_len > self.config.max_sequence_length:
            raise ValueError(f"GenerationInput: max input length {max_input_len} + max_new_tokens {max_new_tokens} "
                             f"exceeds max_sequence_length {self.config.max_sequence_length}")
        if max_input_len > self.engine.build_config.max_input_len:
            raise ValueError(f"GenerationInput.lengths: {max_input_len} exceeds the engine's max_input_len "
                             f"{self.engine.build_config.max_input_len}")
        vocab = self.engine.model_config.vocab_size
        for p in prompts:
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"GenerationInput.ids: token ids must be in [0, {vocab}), got {min(p)}..{max(p)}")

        build = self.engine.build_config
        block_tables = torch.arange(batch * self.blocks_per_sequence, dtype=torch.int32).view(batch, -1)
        out_ids = torch.full((batch, 1, max_seq_len), inputs.pad_id, dtype=torch.int32)
        for i, p in enumerate(prompts):
            out_ids[i, 0, :len(p)] = torch.tensor(p, dtype=torch.int32)
        lengths = [len(p) for p in prompts]
        context_logits = torch.zeros(batch, max_input_len, vocab) if build.gather_context_logits else None
        generation_logits = (torch.zeros(batch, 1, max_new_tokens, vocab)
                             if build.gather_generation_logits else None)

        logits = self._context(prompts, block_tables, context_logits)
        finished = [False] * batch
        for step in range(max_new_tokens):
            active = [i for i in range(batch) if not finished[i]]
            tokens = logits.argmax(dim=-1).tolist()
            for row, i in enumerate(active):
                if generation_logits is not None:
                    generation_logits[i, 0, step] = logits[row]
                if tokens[row] == inputs.end_id:
                    finished[i] = True
                    continue
                out_ids[i, 0, lengths[i]] = tokens[row]
                lengths[i] += 1
                if step + 1 == max_new_tokens:
                    finished[i] = True
            all_finished = all(finished)
            if output.on_token_generated is not None:
                output.on_token_generated(out_ids, step, all_finished)
            if all_finished:
                break
            running = [i for i in range(batch) if not finished[i]]
            logits = self.runner.forward({
                "input_ids": torch.tensor([int(out_ids[i, 0, lengths[i] - 1]) for i in running],
                                          dtype=torch.int32),
                "input_lengths": torch.ones(len(running), dtype=torch.int32),
                "past_lengths": torch.tensor([lengths[i] - 1 for i in running], dtype=torch.int32),
                "block_tables": block_tables[running]})["logits"]

        output.ids = out_ids
        output.lengths = torch.tensor(lengths, dtype=torch.int32).view(batch, 1)
        output.context_logits = context_logits
        output.generation_logits = generation_logits

    def _context(self, prompts: list[list[int]], block_tables: torch.Tensor,
                 context_logits: torch.Tensor | None) -> torch.Tensor:
        """Run every prompt through the model in packed steps of at most max_num_tokens tokens
        (ctx_micro_batch_size sequences); returns each prompt's last-token logits [batch, V]."""
        budget = self.engine.build_config.max_num_tokens
        max_seqs = self.config.ctx_micro_batch_size or len(prompts)
        groups, current, current_tokens = [], [], 0
        for i, p in enumerate(prompts):
            if current and (current_tokens + len(p) > budget or len(current) == max_seqs):
                groups.append(current)
                current, current_tokens = [], 0
            current.append(i)
            current_tokens += len(p)
        groups.append(current)
        all_logits = []
        for group in groups:
            inputs = {
                "input_ids": torch.tensor([t for i in group for t in prompts[i]], dtype=torch.int32),
                "input_lengths": torch.tensor([len(prompts[i]) for i in group], dtype=torch.int32),
                "past_lengths": torch.zeros(len(group), dtype=torch.int32),
                "block_tables": block_tables[group]}
            if context_logits is not None:
                inputs["return_context_logits"] = torch.ones(len(group), dtype=torch.bool)
            outputs = self.runner.forward(inputs)
            all_logits.append(outputs["logits"])
            if context_logits is not None:
                offset = 0
                for i in group:
                    n = len(prompts[i])
                    context_logits[i, :n] = outputs["context_logits"][offset:offset + n]
                    offset += n
        return torch.cat(all_logits)
