"""The model executor: `execute(ScheduledStep) -> StepResult`, the only module of the manager that
touches the runtime. Pure in the scheduler's sense: it reads the frozen step and writes nothing
but its own stores (the decoder states and prompt tables, keyed by request id; the runner's LoRA
weights, keyed by task id), so it may run on another thread (overlap) while the scheduler works on
the other micro-batch.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable

from runtime import GreedySteps, KvBlocks, ModelRunner
from runtime.step_inputs import SequenceStep, pack_step
from runtime.parallel.tensor_parallel import DistributedError

from .distributed import StepBroadcaster
from .request_decoder import RequestDecoder
from .scheduling.step import RequestResult, ScheduledRequest, ScheduledStep, StepResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchedStep:
    """A step `ModelExecutor.launch` started: per forward group, its launched forward
    (runtime.model_runner.LaunchedForward), or the group's error results when its launch failed."""
    groups: tuple[tuple[tuple[ScheduledRequest, ...], object], ...]


class ModelExecutor:
    def __init__(self, runner: ModelRunner, batched_post_processor: Callable | None = None):
        self.runner = runner
        # Rank 0 of a tensor-parallel world: the other ranks run each forward it broadcasts.
        self.broadcaster = StepBroadcaster(runner.tensor_parallel) if runner.tensor_parallel is not None else None
        self.decoder = RequestDecoder(runner.kernels, batched_post_processor)
        # Fault-injection test hook (tests, samples.chaos_soak): fault_injector(group) is called
        # with each forward group (a tuple of ScheduledRequests) before its forward; what it raises
        # fails exactly that group's requests, as a failing model step would.
        self.fault_injector: Callable[[tuple[ScheduledRequest, ...]], None] | None = None
        self._prompt_tables: dict[int, object] = {}   # request id -> float32 [T, hidden] (prompt tuning)
        self._vocab_size = runner.model_config.vocab_size

    def memory_usage(self) -> tuple[int, int, int]:
        """Bytes of runtime memory (weights + KV pool) on the CPU, the GPU, and pinned."""
        return (*self.runner.memory_bytes(), 0)

    @property
    def pipeline_depth(self) -> int:
        """How many micro-batches the worker keeps in flight: the pipeline's stages (1 without)."""
        stage = self.runner.stage
        return stage.layers.num_stages if stage is not None else 1

    def execute(self, step: ScheduledStep) -> StepResult:
        """Every forward group of the step, then a decoder step for the requests that computed
        all their tokens. A group that fails (forward, block copy, fault) fails only its requests."""
        return self.complete(self.launch(step))

    def launch(self, step: ScheduledStep) -> "LaunchedStep":
        """The step's stores updated and its forwards started (under pipeline parallelism this
        rank's stage of them; the later stages' logits arrive in `complete`)."""
        self.decoder.release(step.released_request_ids)
        for request_id in step.released_request_ids:
            self._prompt_tables.pop(request_id, None)
        for task_id in step.adapter_evictions:
            self.runner.lora_store.evict(task_id)
        for task_id, adapter in step.adapter_loads:
            self.runner.lora_store.load(task_id, adapter)
        if self.broadcaster is not None and (step.adapter_evictions or step.adapter_loads):
            self.broadcaster.adapters_changed(step.adapter_evictions, step.adapter_loads)
        for r in step.requests:
            if r.new is not None:
                self.decoder.open(r.request_id, r.new)
                if r.new.spec.prompt_table is not None:
                    self._prompt_tables[r.request_id] = r.new.spec.prompt_table
        groups = []
        for group in step.forward_groups:
            try:
                if self.fault_injector is not None:
                    self.fault_injector(group)
                groups.append((group, self._launch_group(group)))
            except DistributedError:   # the ranks are out of step: the run cannot go on
                raise
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, never the worker
                groups.append((group, self._group_error(group, e)))
        return LaunchedStep(tuple(groups))

    def complete(self, launched: "LaunchedStep") -> StepResult:
        """The launched step's results: its logits (waiting for the last stage's), decoded."""
        results: list[RequestResult] = []
        for group, forward in launched.groups:
            if isinstance(forward, list):   # its launch failed: the errors
                results += forward
                continue
            try:
                if isinstance(forward, GreedySteps):   # several plain-greedy steps, picked already
                    results += self.decoder.accept_steps(list(group), forward)
                    continue
                results += self._decode_group(group, self.runner.finish(forward))
            except DistributedError:
                raise
            except Exception as e:  # noqa: BLE001
                results += self._group_error(group, e)
        return StepResult(tuple(results))

    @staticmethod
    def _group_error(group: tuple[ScheduledRequest, ...], e: Exception) -> list[RequestResult]:
        logger.error("model step failed for requests %s", [r.request_id for r in group], exc_info=e)
        return [RequestResult(r.request_id, error=f"Encountered an error in the model step: {e!r}") for r in group]

    def _launch_group(self, group: tuple[ScheduledRequest, ...]):
        copies = [pair for r in group for pair in r.block_copies]
        inputs = pack_step([
            SequenceStep(tokens, r.past_length, table, r.return_context_logits, 1 + r.num_draft_tokens,
                         lora_task_id=r.lora_task_id, prompt_table=self._prompt_table(r, tokens))
            for r in group for tokens, table in zip(r.token_ids, r.block_tables)])
        if self.broadcaster is not None:
            assert group[0].num_decode_steps == 1, "several steps per call run on one rank only"
            self.broadcaster.forward(copies, inputs)
        if copies:
            self.runner.copy_blocks([src for src, _ in copies], [dst for _, dst in copies])
        for r in group:
            if r.kv_writes is not None:   # a generation-only request's prompt KV, fetched from its context instance
                fetched = r.kv_writes.fetched   # kv_transfer.FetchedBlocks
                self.runner.write_blocks(r.kv_writes.block_ids, KvBlocks(
                    (fetched.values,), None if fetched.scales is None else (fetched.scales,)), r.kv_writes.slots)
        if group[0].num_decode_steps > 1:   # the scheduler gives every request of the step the same n
            return self.runner.decode_greedy(inputs, group[0].num_decode_steps, self.decoder.end_ids(list(group)))
        return self.runner.launch(inputs)

    def _decode_group(self, group: tuple[ScheduledRequest, ...], outputs: dict) -> list[RequestResult]:
        rows, decoded, first_row = [], [], 0
        context_logits, first_token = {}, 0
        for r in group:
            num_rows = r.num_beams * (1 + r.num_draft_tokens)   # logits after the last token and each draft
            if r.is_last_chunk:
                rows += range(first_row, first_row + num_rows)
                decoded.append(r)
            first_row += num_rows
            if r.return_context_logits:   # flagged sequences' logits, packed in order (the prompt's only)
                num_prompt = r.num_step_tokens - r.num_draft_tokens
                context_logits[r.request_id] = outputs["context_logits"][first_token:first_token + num_prompt]
                first_token += r.num_step_tokens * r.num_beams
        by_id = {}
        if decoded:
            logits = outputs["logits"]  # float32 [S, V]
            if len(rows) < logits.shape[0]:
                logits = logits[rows]
            by_id = self.decoder.decode(decoded, logits)
        results = []
        for r in group:
            result = by_id.get(r.request_id, RequestResult(r.request_id))
            if r.request_id in context_logits:
                result = replace(result, context_logits=context_logits[r.request_id].cpu())
            results.append(result)
        return results

    def heartbeat(self) -> None:
        """While the worker idles: keep the other ranks of a tensor-parallel world waiting."""
        if self.broadcaster is not None:
            self.broadcaster.heartbeat()

    def close(self, error: str | None = None) -> None:
        """The worker's loop ended (error: it failed): the other ranks end too."""
        if self.broadcaster is not None:
            self.broadcaster.close(error)

    def _prompt_table(self, r: ScheduledRequest, tokens) -> object:
        """The request's prompt table when this step's tokens include virtual ids (a context step)."""
        table = self._prompt_tables.get(r.request_id)
        return table if table is not None and max(tokens) >= self._vocab_size else None
