"""`ExecutorEngine`: the engine as a Dynamo 1.6.1 unified backend (`dynamo.common.backend.LLMEngine`).
Token ids in, token ids out: each `generate` maps the request (request_map), enqueues it into the
Executor (executor_stream) and yields one chunk per streamed result (chunks); a stopped context
or `abort` cancels it (its blocks freed). It registers the context length and the KV block size,
publishes the KV events (vLLM's format, 64-bit hashes) for Dynamo's KV router, the load
snapshot, and its metrics. The command line is worker_args."""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any

from dynamo.common.backend import EngineConfig, LLMEngine, LlmRegistration
from dynamo.common.backend.publisher import ComponentSnapshot, ZmqSource
from dynamo.common.utils.token_ids import normalize_request_token_ids
from dynamo.llm.exceptions import EngineShutdown, InvalidArgument, Unknown

from batch_manager.executor import ExecutorConfig, KvCacheConfig, KvEventsConfig, QueueFullError
from samples.dynamo.chunks import result_chunk, truncate, usage
from samples.dynamo.disagg import as_context_only, as_generation_only, handoff
from samples.dynamo.executor_stream import SHUT_DOWN, ExecutorStream
from samples.dynamo.metrics import RequestClock, WorkerMetrics
from samples.dynamo.model_card import end_ids_of, write_model_card
from samples.dynamo.request_map import EngineLimits, name_dynamo_field, to_executor_request
from samples.dynamo.worker_args import WorkerOptions, parse_worker_args

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolePlan:
    first_tokens: list[int]        # a decode worker: the prefill's first token(s), emitted first
    max_tokens: int | None         # a decode worker: the user's limit, which it enforces (None: the request's)
    finish_reason: str | None      # a decode worker: the prefill's first token already ended the request


class ExecutorEngine(LLMEngine):
    def __init__(self, options: WorkerOptions):
        self.options = options
        self.stream: ExecutorStream | None = None
        self.limits: EngineLimits | None = None
        self.metrics = WorkerMetrics(options.served_model_name)
        self._context_to_request: dict[str, int] = {}
        self._snapshot_publisher = None
        self._token_text = str
        self._num_reused_blocks = 0
        self._num_allocated_blocks = 0

    @classmethod
    async def from_args(cls, argv: list[str] | None = None):
        options, worker_config = parse_worker_args(argv)
        return cls(options), worker_config

    def executor_config(self) -> ExecutorConfig:
        o = self.options
        kv_events = None
        if o.kv_events_port is not None:
            kv_events = KvEventsConfig(f"tcp://127.0.0.1:{o.kv_events_port}", block_hash_form="int64")
        return ExecutorConfig(kv_cache_config=KvCacheConfig(enable_block_reuse=True, max_tokens=o.max_kv_tokens),
                              max_batch_size=o.max_batch_size, kv_events_config=kv_events)

    async def start(self, worker_id: int) -> EngineConfig:
        del worker_id
        o = self.options
        write_model_card(o.engine_dir, o.tokenizer_dir, o.card_dir)
        self._token_text = _token_text_of(o.card_dir)
        # NOTE: built off the event loop: loading the weights takes seconds.
        self.stream = await asyncio.get_running_loop().run_in_executor(
            None, lambda: ExecutorStream(o.engine_dir, self.executor_config(), self._on_iteration))
        limits = self.stream.limits
        self.limits = EngineLimits(limits.max_seq_len, end_ids_of(o.card_dir))
        used, total = self.stream.kv_block_counts()
        return EngineConfig(model=o.card_dir, served_model_name=o.served_model_name,
                            llm=LlmRegistration(context_length=limits.max_seq_len,
                                                kv_cache_block_size=limits.tokens_per_block, total_kv_blocks=total,
                                                max_num_seqs=limits.max_batch_size))

    async def kv_event_sources(self) -> list:
        if self.options.kv_events_port is None:
            return []
        return [ZmqSource(endpoint=f"tcp://127.0.0.1:{self.options.kv_events_port}", topic="", dp_rank=0)]

    def component_metrics_dp_ranks(self) -> list[int]:
        return [0]

    def attach_snapshot_publisher(self, publisher) -> None:
        self._snapshot_publisher = publisher
        self._publish_snapshot()

    async def register_prometheus(self, metrics) -> None:
        self.metrics.register(metrics)

    # -- requests -------------------------------------------------------------------------------

    async def generate(self, request: dict, context) -> Any:
        if self.stream is None:
            raise EngineShutdown(SHUT_DOWN)
        normalize_request_token_ids(request)
        try:
            mapped = to_executor_request(request, self.limits)
            plan = self._plan_role(mapped, request)
            if plan.finish_reason is not None:   # a decode worker: the prefill's first token ended it
                yield {"token_ids": plan.first_tokens, "index": 0, "finish_reason": plan.finish_reason,
                       "completion_usage": usage(len(mapped.request.input_token_ids), len(plan.first_tokens))}
                return
            request_id, results = self.stream.submit(mapped.request, asyncio.get_running_loop())
        except ValueError as e:
            raise InvalidArgument(name_dynamo_field(str(e))) from None
        except QueueFullError as e:
            raise Unknown(f"the engine is full: {e}") from None
        except RuntimeError as e:
            raise EngineShutdown(str(e)) from None
        self._context_to_request[context.id()] = request_id
        watcher = asyncio.ensure_future(self._cancel_when_stopped(context, request_id))
        try:
            async for chunk in self._chunks(results, mapped, plan):
                yield chunk
        finally:
            watcher.cancel()
            self._context_to_request.pop(context.id(), None)
            self.stream.forget(request_id)   # a no-op after the final result; else a cancel
            self._publish_snapshot()

    def _plan_role(self, mapped, dynamo_request: dict) -> "RolePlan":
        """The prefill / decode roles' request types (disagg): what the stream leads with, where it ends."""
        max_seq_len = self.limits.max_seq_len
        if self.options.role == "prefill":
            as_context_only(mapped.request, max_seq_len)
        elif self.options.role == "decode":
            first_tokens, max_tokens, finish_reason = as_generation_only(mapped.request, dynamo_request, max_seq_len)
            if finish_reason is None and max_tokens <= len(first_tokens):   # nothing left to generate
                return RolePlan(first_tokens[:max_tokens], None, "length")
            return RolePlan(first_tokens, max_tokens, finish_reason)
        return RolePlan([], None, None)

    async def _chunks(self, results, mapped, plan: "RolePlan"):
        num_prompt_tokens, num_generated = len(mapped.request.input_token_ids), len(plan.first_tokens)
        clock = RequestClock(self.metrics)
        if plan.first_tokens:   # a decode worker: the prefill's first token leads the stream
            clock.on_tokens(num_generated)
            yield {"token_ids": plan.first_tokens, "index": 0}
        while True:
            item = await results.get()
            if isinstance(item, str):
                raise (EngineShutdown if item == SHUT_DOWN else Unknown)(item)
            chunk = result_chunk(item, mapped.num_top_log_probs, self._token_text)
            is_last = item.is_final
            if plan.max_tokens is not None and num_generated + len(chunk["token_ids"]) >= plan.max_tokens:
                truncate(chunk, plan.max_tokens - num_generated)   # the user's limit (the request asked for more)
                chunk["finish_reason"], is_last = "length", True
            num_generated += len(chunk["token_ids"])
            clock.on_tokens(len(chunk["token_ids"]))
            if is_last:
                chunk["completion_usage"] = usage(num_prompt_tokens, num_generated)
                if self.options.role == "prefill":
                    chunk["disaggregated_params"] = handoff(item, chunk.get("finish_reason"))
                clock.finish(chunk.get("finish_reason", "length"))
                yield chunk
                return
            yield chunk

    async def _cancel_when_stopped(self, context, request_id: int) -> None:
        await context.async_killed_or_stopped()
        self.stream.cancel(request_id)

    async def abort(self, context) -> None:
        request_id = self._context_to_request.get(context.id())
        if request_id is not None and self.stream is not None:
            self.stream.cancel(request_id)

    async def is_quiescent(self) -> bool | None:
        """A prefill worker may stop once no request runs and no decode worker still has blocks to fetch."""
        stream = self.stream
        if stream is None:
            return True
        counts = stream.executor.get_bookkeeping_counts()
        return stream.num_live() == 0 and counts["kv_exports"] == 0

    async def cleanup(self) -> None:
        stream, self.stream = self.stream, None
        if stream is not None:
            await asyncio.get_running_loop().run_in_executor(None, stream.close)

    # -- load and statistics --------------------------------------------------------------------

    def _on_iteration(self, stats) -> None:
        """The consumer thread, per iteration: the KV gauges and the router's load snapshot."""
        reused, allocated = stats.reused_blocks, stats.allocated_total_blocks   # cumulative
        if allocated:
            self._num_reused_blocks, self._num_allocated_blocks = reused, allocated
        # The iteration's own block counts: the pool read now may already have the blocks of a
        # request that finished since back (the consumer can see several iterations at once).
        self._publish_snapshot((stats.used_blocks, stats.max_blocks))

    def _publish_snapshot(self, block_counts: tuple[int, int] | None = None) -> None:
        """block_counts: (used, total) blocks; None reads the pool as it is now."""
        stream = self.stream
        if stream is None:
            return
        used, total = block_counts if block_counts is not None else stream.kv_block_counts()
        hit_rate = self._num_reused_blocks / self._num_allocated_blocks if self._num_allocated_blocks else None
        self.metrics.kv_utilization.set(used / total)
        if hit_rate is not None:
            self.metrics.kv_hit_rate.set(hit_rate)
        if self._snapshot_publisher is not None:
            self._snapshot_publisher.publish(0, ComponentSnapshot(kv_used_blocks=used, kv_total_blocks=total,
                                                                  gpu_cache_usage=used / total, dp_rank=0,
                                                                  kv_cache_hit_rate=hit_rate))


def _token_text_of(card_dir: str):
    """token id -> its text (top log probs name their tokens), from the card's tokenizer.json."""
    import tokenizers
    tokenizer = tokenizers.Tokenizer.from_file(os.path.join(card_dir, "tokenizer.json"))
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)
