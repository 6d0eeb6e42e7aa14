"""In-flight batching manager in the shape of TensorRT-LLM's legacy GptManager."""
from .legacy import tensor_names
from .legacy.gpt_manager import GptManager
from .legacy.inference_request import InferenceRequest, NamedTensor
from .scheduling.llm_request import LlmRequest, RequestState
from .adapters.lora import PeftCacheManagerConfig, load_peft_adapter
from .options import (CapacitySchedulerPolicy, DecodingConfig, KvCacheConfig, KvEventsConfig, KVEventsConfig,
                      SchedulerConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType)
from .guided_decoding import GuidedDecodingConfig, GuidedDecodingParams, GuideType
from .scheduling.capacity_scheduler import (CapacityScheduler, GuaranteedNoEvictScheduler, MaxUtilizationScheduler,
                                 StaticBatchScheduler)
from .scheduling.micro_batch_scheduler import MicroBatchScheduler
from .scheduling.scheduler import Scheduler

__all__ = ["GuidedDecodingConfig", "GuidedDecodingParams", "GuideType", "tensor_names", "GptManager", "InferenceRequest", "NamedTensor", "LlmRequest", "RequestState",
           "PeftCacheManagerConfig", "load_peft_adapter",
           "CapacitySchedulerPolicy", "DecodingConfig", "KvCacheConfig", "KvEventsConfig", "KVEventsConfig",
           "SchedulerConfig", "SchedulerPolicy",
           "TrtGptModelOptionalParams", "TrtGptModelType", "CapacityScheduler", "GuaranteedNoEvictScheduler",
           "MaxUtilizationScheduler", "MicroBatchScheduler", "StaticBatchScheduler", "Scheduler"]
