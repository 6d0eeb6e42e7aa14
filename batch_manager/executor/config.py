"""The Executor's configuration types (names of `tensorrt_llm.bindings.executor`) and their
mapping onto the engine core's parameters (`TrtGptModelOptionalParams`). Mutable attribute bags,
as in the bindings."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable

from runtime.parallel.world_config import WorldConfig

from ..options import KvCacheConfig as _CoreKvCacheConfig
from ..adapters.lora import PeftCacheManagerConfig
from ..options import DecodingConfig, SchedulerConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType

CapacitySchedulerPolicy = SchedulerPolicy
__all__ = ["BatchingType", "CapacitySchedulerPolicy", "DecodingConfig", "ExecutorConfig", "KvCacheConfig", "LogitsPostProcessorConfig",
           "ModelType", "ParallelConfig", "PeftCacheConfig", "SchedulerConfig", "core_params"]


class ModelType(enum.IntEnum):
    DECODER_ONLY = 0


class BatchingType(enum.IntEnum):
    STATIC = 0      # lockstep batches (TrtGptModelType.V1)
    INFLIGHT = 1    # in-flight fused batching


@dataclass
class KvCacheConfig(_CoreKvCacheConfig):
    """The core's KV-cache config, plus `event_buffer_max_size`: when > 0, the KV manager's
    STORED / REMOVED events are kept (the newest N) for `Executor.get_latest_kv_cache_events`."""
    event_buffer_max_size: int = 0


@dataclass
class ParallelConfig:
    """tensor_parallelism None: the torch.distributed launcher's world size divided by the
    pipeline stages (1 without a launcher). pipeline_split: the layers of each stage (default:
    an even split)."""
    tensor_parallelism: int | None = None
    device_ids: list[int] | None = None
    pipeline_parallelism: int = 1
    pipeline_split: tuple[int, ...] | None = None


@dataclass
class PeftCacheConfig(PeftCacheManagerConfig):
    """The LoRA adapter cache's bounds: batch_manager.adapters.lora.PeftCacheManagerConfig's fields."""


@dataclass
class LogitsPostProcessorConfig:
    """processor_map: name -> fn(request_id, logits [beams, V], token_ids [per beam], stream,
    client_id), chosen per request by `Request.logits_post_processor_name`; processor_batched:
    fn(request_ids, logits list, token_ids list, stream, client_ids) for the requests named
    `Request.BATCHED_POST_PROCESSOR_NAME`. Both may change the logits in place or return new ones."""
    processor_map: dict[str, Callable] | None = None
    processor_batched: Callable | None = None
    replicate: bool = True


@dataclass
class ExecutorConfig:
    max_beam_width: int = 1
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    enable_chunked_context: bool = False
    normalize_log_probs: bool = True
    iter_stats_max_iterations: int = 1000
    request_stats_max_iterations: int = 0
    batching_type: BatchingType = BatchingType.INFLIGHT
    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    max_queue_size: int | None = None      # None: unbounded
    max_num_queued_tokens: int | None = None   # prompt tokens waiting in the queue; None: unbounded
    parallel_config: ParallelConfig | None = None
    peft_cache_config: PeftCacheConfig | None = None
    logits_post_processor_config: LogitsPostProcessorConfig | None = None
    kernel_backend: str | None = None      # as TrtGptModelOptionalParams.kernel_backend
    device: str | None = None              # as TrtGptModelOptionalParams.device
    max_draft_tokens: int = 0              # longest ExternalDraftTokensConfig.tokens (0: drafts refused)
    decoding_config: DecodingConfig | None = None   # the prompt-lookup drafter
    guided_decoding_config: Any = None     # batch_manager.guided_decoding.GuidedDecodingConfig
    build_config: Any = None               # runtime.BuildConfig for a checkpoint or GGUF given directly
    # Disaggregated context and generation: a context-only request's blocks wait this long for
    # their generation-only request (ms); its server listens on this address (a free port).
    kv_transfer_timeout_ms: int = 60000
    kv_transfer_address: str = "127.0.0.1"
    kv_events_config: Any = None           # batch_manager.options.KvEventsConfig: KV events on the wire


def _non_negative_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"ExecutorConfig.{name}: must be an integer >= 0{' or None' if allow_none else ''}, "
                         f"got {value!r}")


def core_params(config: ExecutorConfig) -> tuple[TrtGptModelType, SchedulerPolicy, TrtGptModelOptionalParams]:
    """The engine core's model type, policy and parameters for `config`; ValueError naming the
    field for a bad one."""
    if not isinstance(config, ExecutorConfig):
        raise ValueError(f"executor_config: expected an ExecutorConfig, got {type(config).__name__}")
    if not isinstance(config.max_beam_width, int) or isinstance(config.max_beam_width, bool) \
            or config.max_beam_width < 1:
        raise ValueError(f"ExecutorConfig.max_beam_width: must be an integer >= 1, got {config.max_beam_width!r}")
    for name in ("iter_stats_max_iterations", "request_stats_max_iterations"):
        _non_negative_int(name, getattr(config, name))
    _non_negative_int("max_queue_size", config.max_queue_size, allow_none=True)
    if config.max_queue_size == 0:
        raise ValueError("ExecutorConfig.max_queue_size: must be positive or None, got 0")
    _non_negative_int("max_num_queued_tokens", config.max_num_queued_tokens, allow_none=True)
    if config.max_num_queued_tokens == 0:
        raise ValueError("ExecutorConfig.max_num_queued_tokens: must be positive or None, got 0")
    _non_negative_int("kv_cache_config.event_buffer_max_size",
                      getattr(config.kv_cache_config, "event_buffer_max_size", 0))
    _non_negative_int("kv_transfer_timeout_ms", config.kv_transfer_timeout_ms)
    if config.kv_transfer_timeout_ms == 0:
        raise ValueError("ExecutorConfig.kv_transfer_timeout_ms: must be positive, got 0")
    if not isinstance(config.kv_transfer_address, str) or not config.kv_transfer_address:
        raise ValueError(f"ExecutorConfig.kv_transfer_address: expected a host name or address, got "
                         f"{config.kv_transfer_address!r}")
    parallel = config.parallel_config
    try:
        world = WorldConfig(tensor_parallelism=None) if parallel is None else WorldConfig(
            tensor_parallelism=parallel.tensor_parallelism, pipeline_parallelism=parallel.pipeline_parallelism,
            pipeline_split=parallel.pipeline_split)
    except ValueError as e:
        raise ValueError(f"ParallelConfig.{str(e).removeprefix('WorldConfig.')}") from None
    model_type = TrtGptModelType.V1 if BatchingType(config.batching_type) == BatchingType.STATIC \
        else TrtGptModelType.InflightFusedBatching
    post = config.logits_post_processor_config
    params = TrtGptModelOptionalParams(
        kv_cache_config=config.kv_cache_config, enable_chunked_context=bool(config.enable_chunked_context),
        normalize_log_probs=bool(config.normalize_log_probs), max_batch_size=config.max_batch_size,
        max_num_tokens=config.max_num_tokens, max_beam_width=config.max_beam_width,
        scheduler_config=config.scheduler_config, kernel_backend=config.kernel_backend, device=config.device,
        device_ids=parallel.device_ids if parallel is not None else None, world_config=world,
        logits_post_processor_batched=post.processor_batched if post is not None else None,
        max_draft_tokens=config.max_draft_tokens, decoding_config=config.decoding_config,
        guided_decoding_config=config.guided_decoding_config, peft_cache_manager_config=config.peft_cache_config,
        build_config=config.build_config, kv_events_config=config.kv_events_config)
    policy = SchedulerPolicy(config.scheduler_config.capacity_scheduler_policy)
    return model_type, policy, params
