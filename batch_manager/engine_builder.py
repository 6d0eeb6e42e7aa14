"""The one engine builder of both front-ends (GptManager, Executor): engine, runner, KV manager,
scheduler stages and model executor from an engine directory and the manager's parameters, and
the worker thread that builds them and then runs the loop."""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from runtime import BuildConfig, Engine, ModelRunner, WorldConfig
from runtime.engine import ENGINE_CONFIG_FILE
from runtime.cache.kv_cache_manager import KvCacheManager
from runtime.parallel.tensor_parallel import init_tensor_parallel, local_device

from .adapters.adapter_weights import AdapterWeights
from .scheduling.capacity_scheduler import make_capacity_scheduler
from .distributed import Follower
from .guided_decoding import GuidedDecodingConfig
from .kv_transport.kv_events_publisher import KvEventPublisher, check_kv_events_config, make_publisher
from .scheduling.kv_sizing import host_budget_bytes, num_kv_blocks
from .adapters.lora import PeftCacheManagerConfig, make_peft_cache
from .scheduling.micro_batch_scheduler import MicroBatchScheduler
from .model_executor import ModelExecutor
from .options import DecodingConfig, KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType
from .scheduling.scheduler import Scheduler
from runtime.request import AdmissionLimits
from .worker import Worker, WorkerConfig

logger = logging.getLogger(__name__)

_live_workers: "weakref.WeakSet[Worker]" = weakref.WeakSet()


def _shutdown_live_workers() -> None:
    for worker in list(_live_workers):
        worker.shutdown()


# Runs before the interpreter joins non-daemon threads, so a forgotten front-end cannot hang exit.
if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_shutdown_live_workers)


@dataclass(frozen=True)
class EngineCore:
    """What a front-end wraps into a Worker."""
    scheduler: Scheduler
    executor: ModelExecutor
    limits: AdmissionLimits
    worker_config: WorkerConfig
    kv_events: KvEventPublisher | None = None   # with kv_events_config: the worker publishes and closes it


def start_worker(build: Callable[[], Worker], thread_name: str) -> Worker:
    """Run `build` on a new thread, which then runs the worker's loop; returns the worker once
    built, or raises what the build raised.

    NOTE: the model is built on the thread that then runs it, so the caller's thread runs no
    parallel torch work for us. On CPU a second thread that has run torch's OpenMP regions keeps
    its thread pool alive; libgomp then counts more threads than cores and stops spinning between
    parallel regions: generation steps measured 1.7x slower (2 cores, default model, batch 34)
    when the caller had built the model."""
    ready: Future = Future()
    abandoned, built = threading.Event(), []

    def build_and_run() -> None:
        try:
            worker = build()
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            ready.set_exception(e)
            return
        built.append(worker)
        ready.set_result(worker)
        if not abandoned.is_set():
            worker.run()

    threading.Thread(target=build_and_run, name=thread_name).start()
    try:
        worker = ready.result()
    except BaseException:
        # The build failed, or the caller was interrupted (Ctrl-C) while it ran: a worker built
        # after all must not keep the process alive.
        abandoned.set()
        for worker in built:
            worker.shutdown()
        raise
    _live_workers.add(worker)
    return worker


def build_overrides(engine_dir, build_config) -> dict:
    """The fields of `build_config` (a runtime.BuildConfig) that differ from BuildConfig's defaults,
    as Engine.from_dir overrides; refused with an engine directory (its engine.json records them)."""
    if build_config is None:
        return {}
    if not isinstance(build_config, BuildConfig):
        raise ValueError(f"build_config: expected a runtime.BuildConfig, got {type(build_config).__name__}")
    if os.path.exists(os.path.join(os.fspath(engine_dir), ENGINE_CONFIG_FILE)):
        raise ValueError(f"build_config: must be None with an engine directory ({os.fspath(engine_dir)!r} records "
                         f"its own in {ENGINE_CONFIG_FILE})")
    defaults = BuildConfig()
    return {f.name: getattr(build_config, f.name) for f in dataclasses.fields(BuildConfig)
            if getattr(build_config, f.name) != getattr(defaults, f.name)}


def build_engine_core(engine_dir, model_type: TrtGptModelType, max_beam_width: int, policy: SchedulerPolicy,
                      params: TrtGptModelOptionalParams) -> EngineCore | Follower:
    """Everything that touches the engine; call it on the worker thread (see `start_worker`).
    Under tensor parallelism, ranks other than 0 get a Follower: their slice of the model only."""
    kv_config = params.kv_cache_config
    _check_kv_cache_config(kv_config)
    check_kv_events_config(params.kv_events_config, kv_config)
    max_draft_tokens = _non_negative("TrtGptModelOptionalParams.max_draft_tokens", params.max_draft_tokens)
    decoding = params.decoding_config or DecodingConfig()
    _non_negative("DecodingConfig.prompt_lookup_num_tokens", decoding.prompt_lookup_num_tokens)
    _non_negative("DecodingConfig.prompt_lookup_max_batch_size", decoding.prompt_lookup_max_batch_size)
    if not isinstance(decoding.max_decode_steps, int) or isinstance(decoding.max_decode_steps, bool) \
            or decoding.max_decode_steps < 1:
        raise ValueError(f"DecodingConfig.max_decode_steps: must be an integer >= 1, got {decoding.max_decode_steps!r}")
    if _non_negative("DecodingConfig.max_matching_ngram_size", decoding.max_matching_ngram_size) < 1 \
            and decoding.prompt_lookup_num_tokens:
        raise ValueError(f"DecodingConfig.max_matching_ngram_size: must be >= 1 with prompt lookup, "
                         f"got {decoding.max_matching_ngram_size}")
    world = params.world_config if params.world_config is not None else WorldConfig(tensor_parallelism=None)
    if not isinstance(world, WorldConfig):
        raise ValueError(f"world_config: expected a runtime.WorldConfig, got {type(world).__name__}")
    device_ids = params.device_ids or world.device_ids
    device = local_device(torch.device(params.device or ("cuda" if device_ids else "cpu")), device_ids)
    tensor_parallel = init_tensor_parallel(world, device)
    # Each rank reads only its tensor-parallel slices of its pipeline stage's layers.
    shard = (tensor_parallel.rank, tensor_parallel.size) if tensor_parallel is not None and tensor_parallel.size > 1 \
        else None
    engine = Engine.from_dir(engine_dir, shard, tensor_parallel.stage_plan if tensor_parallel is not None else None,
                             **build_overrides(engine_dir, params.build_config))
    build = engine.build_config
    max_batch_size = _positive("max_batch_size", params.max_batch_size, build.max_batch_size)
    max_num_tokens = _positive("max_num_tokens", params.max_num_tokens, build.max_num_tokens)
    max_num_sequences = _positive("max_num_sequences", params.max_num_sequences, max_batch_size)
    num_blocks = num_kv_blocks(engine, kv_config, max_num_sequences, device,
                               tensor_parallel.size if tensor_parallel is not None else 1)
    if tensor_parallel is not None:   # every rank's pool has the same blocks: the smallest fits all
        num_blocks = tensor_parallel.min_int(num_blocks)
    memory_budget = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else host_budget_bytes()
    peft_cache = make_peft_cache(params.peft_cache_manager_config, engine.model_config, engine.dtype.itemsize,
                                 memory_budget)
    peft_cache.weights = AdapterWeights(engine.dtype)
    runner = ModelRunner(engine, num_blocks, kernels=params.kernel_backend, device=device,
                         max_attention_window=kv_config.max_attention_window,
                         sink_token_length=kv_config.sink_token_length, tensor_parallel=tensor_parallel,
                         gather_logits_to_all=False)
    if tensor_parallel is not None and tensor_parallel.global_rank != 0:
        return Follower(runner, tensor_parallel)
    # The block manager releases what the runner's window (the model's own included) hides.
    kv = KvCacheManager(num_blocks, build.tokens_per_block, enable_block_reuse=bool(kv_config.enable_block_reuse),
                        attention_window=runner.attention_window, sink_token_length=runner.sink_token_length)
    enable_chunked_context, enable_trt_overlap = bool(params.enable_chunked_context), bool(params.enable_trt_overlap)
    if model_type == TrtGptModelType.V1 and (enable_chunked_context or enable_trt_overlap):
        logger.warning("enable_chunked_context and enable_trt_overlap have no effect with TrtGptModelType.V1 "
                       "(static lockstep batches)")
        enable_chunked_context = enable_trt_overlap = False
    if model_type == TrtGptModelType.V1:  # static lockstep batches, whatever the policy
        capacity = make_capacity_scheduler(SchedulerPolicy.STATIC_BATCH, kv, max_batch_size, max_num_tokens,
                                           peft_cache)
    else:
        capacity = make_capacity_scheduler(policy, kv, max_num_sequences, peft_cache=peft_cache)
    limits = AdmissionLimits(
        vocab_size=engine.model_config.vocab_size, max_input_len=build.max_input_len,
        max_seq_len=build.max_seq_len, max_beam_width=max_beam_width, max_num_blocks=num_blocks,
        tokens_per_block=build.tokens_per_block, gather_context_logits=build.gather_context_logits,
        gather_generation_logits=build.gather_generation_logits, max_draft_tokens=max_draft_tokens,
        max_batch_size=max_batch_size,
        guides=_grammar_compiler(params.guided_decoding_config, engine.model_config.vocab_size),
        model_config=engine.model_config, adapter_weights=peft_cache.weights,
        peft_cache_config=params.peft_cache_manager_config or PeftCacheManagerConfig())
    config = WorkerConfig(model_type=model_type, max_num_sequences=max_num_sequences,
                          enable_trt_overlap=enable_trt_overlap,
                          uses_drafts=bool(max_draft_tokens or decoding.prompt_lookup_num_tokens),
                          max_decode_steps=1 if tensor_parallel is not None or model_type == TrtGptModelType.V1
                          else decoding.max_decode_steps)
    scheduler = Scheduler(kv, capacity, MicroBatchScheduler(max_batch_size, max_num_tokens, enable_chunked_context),
                          separate_context_forward=model_type != TrtGptModelType.InflightFusedBatching,
                          prompt_lookup_num_tokens=decoding.prompt_lookup_num_tokens,
                          max_matching_ngram_size=decoding.max_matching_ngram_size,
                          prompt_lookup_max_batch_size=decoding.prompt_lookup_max_batch_size)
    kv_events = None
    if params.kv_events_config is not None:   # after the checks: a refused config leaves no socket bound
        kv_events = make_publisher(params.kv_events_config, build.tokens_per_block, device.type == "cuda",
                                   scheduler.get)
        kv.event_sink = kv_events.collector
    return EngineCore(scheduler, ModelExecutor(runner, params.logits_post_processor_batched), limits, config,
                      kv_events)


def _check_kv_cache_config(kv: KvCacheConfig) -> None:
    for name, low in (("max_attention_window", 1), ("sink_token_length", 0)):
        value = getattr(kv, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            raise ValueError(f"KvCacheConfig.{name}: must be an integer >= {low} or None, got {value!r}")


def _grammar_compiler(config, vocab_size: int):
    if config is None:
        return None
    if not isinstance(config, GuidedDecodingConfig):
        raise ValueError(f"guided_decoding_config: expected a GuidedDecodingConfig, got {type(config).__name__}")
    return config.build_compiler(vocab_size)


def _non_negative(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}: must be an integer >= 0, got {value!r}")
    return value


def _positive(name: str, value, default: int) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"TrtGptModelOptionalParams.{name}: must be a positive integer, got {value!r}")
    return value
