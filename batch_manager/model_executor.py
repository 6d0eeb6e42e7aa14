"""The only module of the manager that touches the runtime: builds each step's tensor dict from
the scheduled requests, runs the forward, decodes (greedy), and records tokens on the requests."""
from __future__ import annotations

import logging

import torch

from runtime import ModelRunner

from .kv_cache_manager import KvCacheManager
from .llm_request import FinishReason, LlmRequest, RequestState

logger = logging.getLogger(__name__)


class ModelExecutor:
    def __init__(self, runner: ModelRunner, kv_cache_manager: KvCacheManager):
        self.runner = runner
        self.kv = kv_cache_manager

    def memory_usage(self) -> tuple[int, int, int]:
        """Bytes of runtime memory (weights + KV pool) on the CPU, the GPU, and pinned."""
        tensors = [*self.runner.model.w.values(), self.runner.kv_pool]
        seen, cpu, gpu = set(), 0, 0
        for t in tensors:
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            if t.device.type == "cpu":
                cpu += t.numel() * t.element_size()
            else:
                gpu += t.numel() * t.element_size()
        return cpu, gpu, 0

    def step(self, requests: list[LlmRequest]) -> None:
        """One packed forward over `requests` (each computes all its uncomputed tokens), then one
        new token for each. Raises on a runtime failure; the requests are then left unchanged."""
        if not requests:
            return
        inputs, context_logits_rows = self._inputs(requests)
        outputs = self.runner.forward(inputs)
        logits = outputs["logits"]  # float32 [S, V]
        with torch.inference_mode():  # the runtime's outputs are inference tensors
            failures = self._post_process(requests, logits)
        next_tokens = logits.argmax(dim=-1).tolist()
        log_probs = None
        if any(r.return_log_probs for r in requests):
            log_probs = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(next_tokens)[:, None])[:, 0].tolist()
        context_logits = outputs.get("context_logits")
        for row, r in enumerate(requests):
            if r in failures:
                r.finish(FinishReason.ERROR, failures[r])
                continue
            if r in context_logits_rows:
                start = context_logits_rows[r]
                r.context_logits = context_logits[start:start + r.prompt_len].cpu()
            r.num_computed_tokens = r.num_tokens
            self._accept(r, next_tokens[row], None if log_probs is None else log_probs[row],
                         logits[row] if r.return_generation_logits else None)

    def _inputs(self, requests: list[LlmRequest]) -> tuple[dict[str, torch.Tensor], dict[LlmRequest, int]]:
        token_ids: list[int] = []
        lengths, past, tables, flags = [], [], [], []
        context_logits_rows: dict[LlmRequest, int] = {}
        num_flagged_tokens = 0
        for r in requests:
            new_tokens = r.token_slice(r.num_computed_tokens, r.num_tokens)
            token_ids.extend(new_tokens)
            lengths.append(len(new_tokens))
            past.append(r.num_computed_tokens)
            tables.append(self.kv.block_table(r.request_id))
            # Context logits are gathered the first time the whole prompt is computed in one step.
            wants = r.return_context_logits and r.context_logits is None and r.num_computed_tokens == 0
            flags.append(wants)
            if wants:
                context_logits_rows[r] = num_flagged_tokens
                num_flagged_tokens += len(new_tokens)
        width = max(len(t) for t in tables)
        block_tables = torch.zeros(len(requests), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            block_tables[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        inputs = {"input_ids": torch.tensor(token_ids, dtype=torch.int32),
                  "input_lengths": torch.tensor(lengths, dtype=torch.int32),
                  "past_lengths": torch.tensor(past, dtype=torch.int32),
                  "block_tables": block_tables}
        if context_logits_rows:
            inputs["return_context_logits"] = torch.tensor(flags, dtype=torch.bool)
        return inputs, context_logits_rows

    @staticmethod
    def _post_process(requests: list[LlmRequest], logits: torch.Tensor) -> dict[LlmRequest, str]:
        """Per-request logits post-processors, called as fn(request_id, logits [1, V], token_ids
        [[...]], stream, client_id) and allowed to modify logits in place (or return new ones).
        Returns the requests whose post-processor raised -> error message."""
        failures: dict[LlmRequest, str] = {}
        for row, r in enumerate(requests):
            if r.logits_post_processor is None:
                continue
            view = logits[row:row + 1]
            try:
                result = r.logits_post_processor(r.request_id, view, [r.prompt + r.generated], None, None)
                if isinstance(result, torch.Tensor) and result is not view:
                    view.copy_(result.reshape(view.shape))
            except Exception as e:  # noqa: BLE001 - user code fails only its own request
                logger.exception("logits post-processor of request %s raised", r.request_id)
                failures[r] = f"logits post-processor raised: {e!r}"
        return failures

    @staticmethod
    def _accept(r: LlmRequest, token: int, log_prob: float | None, logits_row: torch.Tensor | None) -> None:
        if r.end_id is not None and token == r.end_id:
            r.finish(FinishReason.END_ID)
            return
        r.generated.append(token)
        if log_prob is not None:
            r.log_probs.append(log_prob)
        if logits_row is not None:
            r.generation_logits.append(logits_row.cpu())
        if len(r.generated) >= r.max_new_tokens:
            r.finish(FinishReason.LENGTH)
        elif r.state == RequestState.CONTEXT:
            r.set_state(RequestState.GENERATION)
