"""The Executor API (names of `tensorrt_llm.bindings.executor`) over the engine core."""
from ..options import KvEventsConfig, KVEventsConfig, SchedulerConfig
from .config import (BatchingType, CapacitySchedulerPolicy, DecodingConfig, ExecutorConfig, KvCacheConfig, LogitsPostProcessorConfig,
                     ModelType, ParallelConfig, PeftCacheConfig)
from ..guided_decoding import GuidedDecodingConfig, GuidedDecodingParams, GuideType
from .executor import Executor
from .kv_events import KvCacheEvent, KvCacheEventType
from .queues import QueueFullError
from .request import (ContextPhaseParams, ExternalDraftTokensConfig, FinishReason, LoraConfig, OutputConfig,
                      PromptTuningConfig, Request, RequestType, Response, Result, SamplingConfig)
from .stats import IterationStats, RequestStage, RequestStats, RequestStatsPerIteration

__all__ = ["GuidedDecodingConfig", "GuidedDecodingParams", "GuideType", "SchedulerConfig", "BatchingType", "CapacitySchedulerPolicy", "DecodingConfig", "ExecutorConfig", "KvCacheConfig",
           "LogitsPostProcessorConfig", "ModelType", "ParallelConfig", "PeftCacheConfig", "Executor", "KvCacheEvent",
           "KvCacheEventType", "KvEventsConfig", "KVEventsConfig", "QueueFullError", "ExternalDraftTokensConfig", "FinishReason", "LoraConfig",
           "OutputConfig", "PromptTuningConfig", "Request", "Response", "Result", "SamplingConfig", "IterationStats",
           "RequestStage", "RequestStats", "RequestStatsPerIteration", "ContextPhaseParams", "RequestType"]
