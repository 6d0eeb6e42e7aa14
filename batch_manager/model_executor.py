"""The only module of the manager that touches the runtime: builds each step's tensor dict from
the scheduled requests (`prepare`), runs the forward (`forward`, safe on another thread), then
advances the requests, registers their full blocks for reuse and decodes (`update`)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from runtime import ModelRunner
from runtime.beam_blocks import beam_holder, fork_beams
from runtime.kv_cache_manager import KvCacheManager

from .llm_request import LlmRequest
from .request_decoder import RequestDecoder

logger = logging.getLogger(__name__)


@dataclass
class PreparedStep:
    requests: list[LlmRequest]
    num_step_tokens: list[int]                  # tokens each request (each of its live beams) computes
    num_rows: list[int]                         # sequences (logits rows) of each request: its live beams
    block_copies: list[tuple[int, int]]         # (src, dst) KV blocks to copy before the forward
    inputs: dict[str, torch.Tensor]             # ModelRunner.forward inputs
    context_logits_rows: dict[LlmRequest, int]  # request -> first row of its prompt in context_logits


class ModelExecutor:
    def __init__(self, runner: ModelRunner, kv_cache_manager: KvCacheManager, normalize_log_probs: bool = True,
                 batched_post_processor: Callable | None = None):
        self.runner = runner
        self.kv = kv_cache_manager
        self.decoder = RequestDecoder(runner.kernels, normalize_log_probs, batched_post_processor)

    def memory_usage(self) -> tuple[int, int, int]:
        """Bytes of runtime memory (weights + KV pool) on the CPU, the GPU, and pinned."""
        cpu, gpu = 0, 0
        for t in [*self.runner.model.weight_tensors(), self.runner.kv_pool]:
            if t.device.type == "cpu":
                cpu += t.numel() * t.element_size()
            else:
                gpu += t.numel() * t.element_size()
        return cpu, gpu, 0

    def step(self, requests: list[LlmRequest]) -> None:
        """One packed forward over `requests`, then one new token for each that computed all its
        tokens. Raises on a runtime failure; the requests are then left unchanged."""
        if requests:
            prepared = self.prepare(requests)
            self.update(prepared, self.forward(prepared))

    # -- input building ---------------------------------------------------------------------------

    def prepare(self, requests: list[LlmRequest]) -> PreparedStep:
        """The step's tensor dict. Each request computes its next chunk (context_chunk_size) or
        all its uncomputed tokens. Reads the requests; changes nothing."""
        token_ids: list[int] = []
        lengths, past, tables, flags = [], [], [], []
        context_logits_rows: dict[LlmRequest, int] = {}
        num_flagged_tokens = 0
        num_step_tokens, num_rows, block_copies = [], [], []
        for r in requests:
            n = r.context_chunk_size or r.num_tokens_to_compute
            num_step_tokens.append(n)
            num_rows.append(r.num_live_beams)
            block_copies += r.pending_block_copies
            if r.num_live_beams == 1:
                token_ids.extend(r.token_slice(r.num_computed_tokens, r.num_computed_tokens + n))
                lengths.append(n)
                past.append(r.num_computed_tokens)
                tables.append(self.kv.block_table(r.request_id))
            else:  # one sequence per live beam, each over its own (partly shared) block table
                for b, beam in enumerate(self.decoder.state(r).beams):
                    sequence = r.prompt + beam.tokens
                    token_ids.extend(sequence[r.num_computed_tokens:r.num_computed_tokens + n])
                    lengths.append(n)
                    past.append(r.num_computed_tokens)
                    tables.append(self.kv.block_table(beam_holder(r.request_id, b)))
            # Context logits are gathered when the whole prompt is computed in one step (such a
            # request is never chunked and reuses no prefix).
            wants = r.return_context_logits and r.context_logits is None and r.num_computed_tokens == 0
            flags += [wants] * r.num_live_beams
            if wants:
                context_logits_rows[r] = num_flagged_tokens
                num_flagged_tokens += n
        width = max(len(t) for t in tables)
        # Released blocks (window) stay negative: the runtime never reads them.
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        inputs = {"input_ids": torch.tensor(token_ids, dtype=torch.int32),
                  "input_lengths": torch.tensor(lengths, dtype=torch.int32),
                  "past_lengths": torch.tensor(past, dtype=torch.int32),
                  "block_tables": block_tables}
        if context_logits_rows:
            inputs["return_context_logits"] = torch.tensor(flags, dtype=torch.bool)
        return PreparedStep(list(requests), num_step_tokens, num_rows, block_copies, inputs, context_logits_rows)

    def forward(self, prepared: PreparedStep) -> dict[str, torch.Tensor]:
        """The runtime forward alone: touches no manager state (overlap runs it on another thread)."""
        if prepared.block_copies:
            self.runner.copy_blocks([src for src, _ in prepared.block_copies],
                                    [dst for _, dst in prepared.block_copies])
        return self.runner.forward(prepared.inputs)

    def update(self, prepared: PreparedStep, outputs: dict[str, torch.Tensor]) -> None:
        """Advance each request by the tokens it computed, register newly full blocks for reuse,
        and decode a token for the requests that computed everything they have. Requests that
        finished meanwhile (stopped while their forward ran) are skipped."""
        rows, decoded, first_row = [], [], 0
        for r, n, num_rows in zip(prepared.requests, prepared.num_step_tokens, prepared.num_rows):
            span = range(first_row, first_row + num_rows)
            first_row += num_rows
            r.pending_block_copies.clear()
            if r.is_finished:
                continue
            r.num_computed_tokens += n
            r.context_chunk_size = None
            if self.kv.enable_block_reuse:
                self.kv.store_computed_blocks(
                    r.request_id, r.token_slice(self.kv.num_stored_tokens(r.request_id), r.num_computed_tokens),
                    r.num_computed_tokens)
            if r.num_computed_tokens == r.num_tokens:
                rows += span
                decoded.append(r)
        if not rows:
            return
        logits = outputs["logits"]  # float32 [S, V]
        if len(rows) < logits.shape[0]:
            logits = logits[rows]
        self._decode(decoded, logits, outputs.get("context_logits"), prepared.context_logits_rows)
        for r in decoded:
            if r.beam_width > 1 and not r.is_finished:
                state = self.decoder.state(r)
                fork_beams(self.kv, r.request_id, r.num_live_beams, state.parents)
                r.num_live_beams = state.num_rows

    # -- decoding -----------------------------------------------------------------------------------

    def _decode(self, requests: list[LlmRequest], logits: torch.Tensor, context_logits: torch.Tensor | None,
                context_logits_rows: dict[LlmRequest, int]) -> None:
        """logits float32 [rows, V] (each request's live beams): one decoder step for each request."""
        for r in requests:
            if r in context_logits_rows:
                start = context_logits_rows[r]
                r.context_logits = context_logits[start:start + r.prompt_len].cpu()
        self.decoder.decode(requests, logits)
