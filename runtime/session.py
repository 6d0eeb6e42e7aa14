"""GptSession: static-batch generation over the tensor-dict runtime (the seeds' C++ runtime API).

A batch runs in lockstep: one packed context step for all prompts (split by the engine's
max_num_tokens), then one generation step per token for the sequences still running. Blocks come
from a KvCacheManager per generate() (holder: the sequence index; beams share blocks copy-on-write).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .cache.beam_blocks import beam_holder, fork_beams, free_beams, prepare_beam_writes
from .config import ModelConfig
from .decoding import Decoder, DecodeState
from .decoding import DecodingParams, parse_word_list
from .decoding.fields import SAMPLING_FIELDS
from .engine import Engine
from .cache.kv_cache_manager import KvCacheManager
from .model_runner import ModelRunner
from .adapters.prompt_tuning import per_sequence_tables
from .step_inputs import SequenceStep, pack_step
from .parallel.tensor_parallel import WorldConfig, init_tensor_parallel, local_device
from .request import AdmissionLimits, Rendered, RequestOutput, check_prompt, make_spec, render

logger = logging.getLogger(__name__)


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


# DecodingParams field -> SamplingConfig field, for error messages.
_SAMPLING_CONFIG_NAMES = {f.param: f.session for f in SAMPLING_FIELDS if f.session is not None}
# What make_spec names, as GptSession's user knows it: the fields of GenerationInput and SamplingConfig.
_SPEC_NAMES = {"max_new_tokens": "GenerationInput.max_new_tokens", "pad_id": "GenerationInput.pad_id",
               "draft_input_ids": "GenerationInput.draft_input_ids", "draft_logits": "GenerationInput.draft_logits",
               "num_return_sequences": "SamplingConfig.num_return_sequences", "beam_width": "SamplingConfig.beam_width",
               "return_context_logits": "gather_context_logits", "return_generation_logits": "gather_generation_logits"}
_DECODING_NAMES = {**{param: f"SamplingConfig.{name}" for param, name in _SAMPLING_CONFIG_NAMES.items()},
                   "end_id": "GenerationInput.end_id", "embedding_bias": "GenerationInput.embedding_bias",
                   "bad_words": "GenerationInput.bad_words_list", "stop_words": "GenerationInput.stop_words_list"}


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
    early_stopping: Sequence[int] | int | None = None
    no_repeat_ngram_size: Sequence[int] | int | None = None
    min_p: Sequence[float] | float | None = None

    def decoding_params(self, batch_size: int, end_id: int, vocab_size: int,
                        normalize_log_probs: bool = True) -> list[DecodingParams]:
        """One validated DecodingParams per sequence (runtime/decoding/params.py has the semantics;
        an unset random_seed is 0, as in TensorRT-LLM)."""
        fields = {f.session: (f.param, f.default) for f in SAMPLING_FIELDS if f.session is not None}
        columns = {param: _per_sequence(name, getattr(self, name), batch_size, default)
                   for name, (param, default) in fields.items()}
        result = []
        for i in range(batch_size):
            values = {param: column[i] for param, column in columns.items()}
            params = DecodingParams(beam_width=self.beam_width, end_id=None if end_id == -1 else end_id,
                                    normalize_log_probs=normalize_log_probs, **values)
            try:
                params.validate(vocab_size, max_beam_width=self.beam_width, names=_SAMPLING_CONFIG_NAMES)
            except ValueError as e:
                raise ValueError(f"SamplingConfig.{e}") from None
            result.append(params)
        return result


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
    # prompt tuning: float [T, hidden] (all sequences) or [batch, T, hidden]; ids vocab_size + j take row j
    prompt_embedding_table: torch.Tensor | None = None

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
    log_probs: torch.Tensor | None = None        # float32 [batch, beam, max_new_tokens]
    cum_log_probs: torch.Tensor | None = None    # float32 [batch, beam]
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
        # Room for max_batch_size x max_beam_width full sequences: copy-on-write never runs out.
        num_blocks = (config.max_batch_size * config.max_beam_width
                      * -(-config.max_sequence_length // engine.build_config.tokens_per_block))
        # kv_cache_config: any object with max_attention_window / sink_token_length (e.g. the
        # manager's KvCacheConfig); results follow the window, memory is not released early.
        kv = config.kv_cache_config
        # Tensor parallelism (world_config, or a torchrun launch when its tensor_parallelism is None):
        # every rank calls generate() with the same inputs, as under the seeds' MPI. The logits are
        # gathered on every rank and each rank decodes; they agree token for token because the
        # gathered logits are the same bytes everywhere and the samplers draw from counter-based
        # generators keyed by (seed, step, beam), so no tokens need to be sent.
        device = torch.device(device) if device is not None else torch.device("cpu")
        device = local_device(device, world_config.device_ids if world_config is not None else None)
        self.tensor_parallel = init_tensor_parallel(world_config, device)
        self.runner = ModelRunner(engine, num_blocks, kernels=kernels, device=device,
                                  max_attention_window=getattr(kv, "max_attention_window", None),
                                  sink_token_length=getattr(kv, "sink_token_length", None),
                                  tensor_parallel=self.tensor_parallel)
        self.decoder = Decoder(self.runner.kernels)

    def generate(self, output: GenerationOutput, inputs: GenerationInput, sampling: SamplingConfig) -> None:
        prompts = inputs.prompts()
        batch = len(prompts)
        if not 0 < batch <= self.config.max_batch_size:
            raise ValueError(f"GenerationInput: batch size {batch} not in [1, {self.config.max_batch_size}]")
        if not 1 <= sampling.beam_width <= self.config.max_beam_width:
            raise ValueError(f"SamplingConfig.beam_width: must be in [1, {self.config.max_beam_width}], "
                             f"got {sampling.beam_width}")
        max_new_tokens = inputs.max_new_tokens
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"GenerationInput.max_new_tokens: must be a positive integer, got {max_new_tokens!r}")
        max_input_len = max(len(p) for p in prompts)
        max_seq_len = max_input_len + max_new_tokens
        if max_seq_len > self.config.max_sequence_length:
            raise ValueError(f"GenerationInput: max input length {max_input_len} + max_new_tokens {max_new_tokens} "
                             f"exceeds max_sequence_length {self.config.max_sequence_length}")
        limits = self._limits()
        vocab = self.engine.model_config.vocab_size
        tables = per_sequence_tables(inputs.prompt_embedding_table, batch, self.engine.model_config.hidden_size)
        for p, table in zip(prompts, tables):
            check_prompt(p, limits, "GenerationInput.ids", 0 if table is None else table.shape[0])
        if not -1 <= inputs.end_id < vocab:
            raise ValueError(f"GenerationInput.end_id: must be -1 or in [0, {vocab}), got {inputs.end_id}")
        params = self._with_inputs(sampling.decoding_params(batch, inputs.end_id, vocab), inputs, vocab)

        build = self.engine.build_config
        # Each sequence a request of the core: its spec (checked as every door's), its one record,
        # rendered at the end. The whole batch fits max_sequence_length (above): nothing is clamped.
        specs = [make_spec(p, max_new_tokens, limits, params[i], names=_SPEC_NAMES, decoding_names=_DECODING_NAMES,
                           request_id=i, pad_id=inputs.pad_id, return_log_probs=True,
                           return_generation_logits=build.gather_generation_logits) for i, p in enumerate(prompts)]
        records = [RequestOutput(i, p, params[i].num_sequences) for i, p in enumerate(prompts)]
        states = [DecodeState(params[i], records[i], max_new_tokens, build.gather_generation_logits)
                  for i in range(batch)]
        kv = KvCacheManager(self.runner.num_blocks, build.tokens_per_block)
        allocated = all([kv.allocate(i, len(p)) for i, p in enumerate(prompts)])
        assert allocated, "the pool holds max_batch_size x max_beam_width full sequences"
        context_logits = torch.zeros(batch, max_input_len, vocab) if build.gather_context_logits else None
        out_ids = torch.full((batch, sampling.beam_width, max_seq_len), inputs.pad_id, dtype=torch.int32)

        logits = self._context(prompts, kv, context_logits, tables)
        running, num_beams = list(range(batch)), [1] * batch   # num_beams[i]: block tables sequence i holds
        for step in range(max_new_tokens):
            outcomes = self.decoder.step([states[i] for i in running], logits)
            for i, outcome in zip(running, outcomes):
                records[i].apply(outcome)
                self._write_ids(out_ids[i], prompts[i], [s.tokens for s in records[i].sequences], inputs.pad_id)
                if states[i].is_finished:
                    free_beams(kv, i, num_beams[i])
                elif outcome.beams is not None:
                    fork_beams(kv, i, num_beams[i], list(outcome.beams.parents))
                    num_beams[i] = len(outcome.beams.parents)
            running = [i for i in running if not states[i].is_finished]
            if output.on_token_generated is not None:
                output.on_token_generated(out_ids, step, not running)
            if not running:
                break
            logits = self._generation_step(states, running, kv)
        self._write_outputs(output, out_ids, [render(spec, record, 0, False) for spec, record in zip(specs, records)],
                            prompts, max_new_tokens, vocab)
        output.context_logits = context_logits

    def _with_inputs(self, params: list[DecodingParams], inputs: GenerationInput, vocab: int) -> list[DecodingParams]:
        """Fold the per-sequence tensors of GenerationInput (bias, word lists) into the params."""
        batch = len(params)

        def per_sequence(name: str, value: torch.Tensor | None, rank: int) -> list:
            if value is None:
                return [None] * batch
            if value.dim() == rank:
                return [value] * batch
            if value.dim() == rank + 1 and value.shape[0] == batch:
                return list(value)
            raise ValueError(f"GenerationInput.{name}: expected {rank} dims or [batch={batch}, ...], "
                             f"got {list(value.shape)}")

        biases = per_sequence("embedding_bias", inputs.embedding_bias, 1)
        bad = per_sequence("bad_words_list", inputs.bad_words_list, 2)
        stop = per_sequence("stop_words_list", inputs.stop_words_list, 2)
        result = []
        for p, bias, bad_words, stop_words in zip(params, biases, bad, stop):
            result.append(dataclasses.replace(
                p, embedding_bias=None if bias is None else bias.float(),
                bad_words=parse_word_list(bad_words, "GenerationInput.bad_words_list", vocab),
                stop_words=parse_word_list(stop_words, "GenerationInput.stop_words_list", vocab)))
        return result   # validated with the rest of each spec (make_spec)

    def _limits(self) -> AdmissionLimits:
        """The engine's limits, as the manager admits against them, with this session's sequence length."""
        build, model = self.engine.build_config, self.engine.model_config
        return AdmissionLimits(vocab_size=model.vocab_size, max_input_len=build.max_input_len,
                               max_seq_len=self.config.max_sequence_length, max_beam_width=self.config.max_beam_width,
                               max_num_blocks=self.runner.num_blocks, tokens_per_block=build.tokens_per_block,
                               gather_context_logits=build.gather_context_logits,
                               gather_generation_logits=build.gather_generation_logits, model_config=model)

    def _generation_step(self, states: list[DecodeState], running: list[int], kv: KvCacheManager) -> torch.Tensor:
        """One forward over every live beam of the running sequences -> logits [rows, V]."""
        copies: list[tuple[int, int]] = []   # (src, dst) blocks, copied before the forward
        sequences = []
        for i in running:
            s = states[i]
            position = len(s.record.prompt) + s.num_generated - 1   # of the last token (beams are equally long)
            prepare_beam_writes(kv, i, s.num_rows, position, copies)
            sequences += [SequenceStep([tokens[-1]], position, kv.block_table(beam_holder(i, b)))
                          for b, tokens in enumerate(s.record.beams)]
        if copies:
            self.runner.copy_blocks([src for src, _ in copies], [dst for _, dst in copies])
        return self.runner.forward(pack_step(sequences))["logits"]

    @staticmethod
    def _write_ids(out_ids: torch.Tensor, prompt: list[int], beams: list[list[int]], pad_id: int) -> None:
        """out_ids [beam, max_seq_len] = prompt, each beam's generated tokens, pad_id (beams reorder)."""
        n = len(prompt)
        out_ids[:, :n] = torch.tensor(prompt, dtype=torch.int32)
        for beam, tokens in enumerate(beams):
            out_ids[beam, n:n + len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
            out_ids[beam, n + len(tokens):] = pad_id

    @staticmethod
    def _write_outputs(output: GenerationOutput, out_ids: torch.Tensor, rendered: list[Rendered],
                       prompts: list[list[int]], max_new_tokens: int, vocab: int) -> None:
        """rendered[i]: sequence i's output beams (best first), its generated tokens from 0."""
        batch, beam_width = out_ids.shape[:2]
        lengths = torch.zeros(batch, beam_width, dtype=torch.int32)
        log_probs = torch.zeros(batch, beam_width, max_new_tokens)
        cum_log_probs = torch.zeros(batch, beam_width)
        gather = any(rows for r in rendered for rows in r.generation_logits or ())
        generation_logits = torch.zeros(batch, beam_width, max_new_tokens, vocab) if gather else None
        for i, r in enumerate(rendered):
            lengths[i] = len(prompts[i])
            for beam, tokens in enumerate(r.token_ids):
                lengths[i, beam] = len(prompts[i]) + len(tokens)
                log_probs[i, beam, :len(r.log_probs[beam])] = torch.tensor(r.log_probs[beam])
                cum_log_probs[i, beam] = r.cum_log_probs[beam]
                if gather and r.generation_logits[beam]:
                    generation_logits[i, beam, :len(r.generation_logits[beam])] = torch.stack(r.generation_logits[beam])
        output.ids, output.lengths = out_ids, lengths
        output.log_probs, output.cum_log_probs = log_probs, cum_log_probs
        output.generation_logits = generation_logits

    def _context(self, prompts: list[list[int]], kv: KvCacheManager, context_logits: torch.Tensor | None,
                 tables: list[torch.Tensor | None]) -> torch.Tensor:
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
            wants_all_logits = context_logits is not None
            outputs = self.runner.forward(pack_step([SequenceStep(prompts[i], 0, kv.block_table(i), wants_all_logits,
                                                                  prompt_table=tables[i]) for i in group]))
            all_logits.append(outputs["logits"])
            if context_logits is not None:
                offset = 0
                for i in group:
                    n = len(prompts[i])
                    context_logits[i, :n] = outputs["context_logits"][offset:offset + n]
                    offset += n
        return torch.cat(all_logits)

