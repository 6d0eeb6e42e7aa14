"""User-facing options: batching type, scheduler policy, KV-cache config, optional parameters.

Mutable attribute bags, as in the legacy binding (users set attributes after construction).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable


class TrtGptModelType(enum.IntEnum):
    V1 = 0                     # static batching: a batch runs in lockstep until all its members finish
    InflightBatching = 1       # context and generation requests in separate forwards per iteration
    InflightFusedBatching = 2  # one packed forward mixes them


class SchedulerPolicy(enum.IntEnum):
    MAX_UTILIZATION = 0
    GUARANTEED_NO_EVICT = 1
    STATIC_BATCH = 2


CapacitySchedulerPolicy = SchedulerPolicy


@dataclass
class SchedulerConfig:
    capacity_scheduler_policy: SchedulerPolicy = SchedulerPolicy.GUARANTEED_NO_EVICT


@dataclass
class KvCacheConfig:
    """KV pool and KV-cache features.

    max_tokens / free_gpu_memory_fraction: the pool's size; with both, the smaller (kv_sizing).
    max_attention_window w, sink_token_length s: a query at position q sees keys k <= q with
    k > q - w or k < s; positions stay the original ones (no shift into the window). A model with
    its own sliding window uses the smaller window. Blocks no later query can see are released,
    so a sequence holds at most ceil(s / tpb) + ceil((w + n - 1) / tpb) + 1 blocks (n: the most
    tokens one of its steps computes).
    enable_block_reuse: full blocks of computed KV stay cached (keyed by their whole prefix) and
    later requests sharing the prefix skip computing it; free cached blocks are evicted least
    recently used, only when the pool needs them."""
    max_tokens: int | None = None
    max_attention_window: int | None = None
    sink_token_length: int | None = None
    free_gpu_memory_fraction: float | None = None  # None = 0.9
    enable_block_reuse: bool = False


@dataclass(frozen=True)
class KvEventsConfig:
    """KV-cache events on the wire (batch_manager.kv_transport.kv_events_publisher), in vLLM's format for
    routers in other processes. Needs KvCacheConfig.enable_block_reuse; only rank 0 publishes.
    endpoint: where the ZMQ PUB socket binds ("tcp://HOST:PORT" or "ipc://PATH"); subscribers
    connect. replay_endpoint: a ROUTER socket that resends the newest `buffer_steps` messages
    from a given sequence number (None: no replay). topic: the first frame of every message.
    block_hash_form: how a block hash goes on the wire: "bytes16", the 16-byte block key (the
    default), or "int64", its first 8 bytes as a signed big-endian integer (what vLLM sends and
    NVIDIA Dynamo 1.6.1's listener decodes; two different prefixes share one with probability
    about n**2 / 2**65 among n cached blocks)."""
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10000
    block_hash_form: str = "bytes16"


KVEventsConfig = KvEventsConfig   # vLLM's spelling


@dataclass
class DecodingConfig:
    """The built-in drafter: prompt lookup proposes up to `prompt_lookup_num_tokens` draft tokens
    per generation step of every greedy request (beam width 1), continuing the most recent earlier
    match of its last n tokens (n = max_matching_ngram_size down to 1); 0 turns it off.
    It drafts only while at most `prompt_lookup_max_batch_size` requests are generating (0: no
    limit): a small step is bound by streaming the weights, so the D extra positions ride almost
    free, while a large one is bound by compute. Measured on the default model on a 2-core CPU:
    1.36-1.42x tokens/s with one request, 0.78-0.82x at 8 and 0.73x at 64 (samples.microbench.prompt_lookup)."""
    prompt_lookup_num_tokens: int = 0
    max_matching_ngram_size: int = 3
    prompt_lookup_max_batch_size: int = 4
    # Multi-step decoding: up to `max_decode_steps` generation steps per iteration, in one call
    # (runtime.ModelRunner.decode_greedy), while every active request is plain greedy (no penalty,
    # ban, guide, post-processor, adapter, drafts, top log probs or gathered logits; one sequence),
    # holds the blocks for them, and no request waits to be admitted; else one step. The worker's
    # Python (schedule, pack, decode, respond: ~1-2 ms per iteration on a 2-core CPU, mostly cache
    # misses after a step's weight stream) then runs once per n tokens. The cost: a stream's
    # tokens arrive n at a time, and a stop signal or a new request waits up to n steps. 1: off
    # (every iteration one step, as TensorRT-LLM); ignored with enable_trt_overlap, pipeline or tensor
    # parallelism and TrtGptModelType.V1.
    max_decode_steps: int = 1


@dataclass
class TrtGptModelOptionalParams:
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    max_num_sequences: int | None = None   # None = max_batch_size
    enable_trt_overlap: bool = False       # two alternating micro-batches; the forward on its own thread
    device_ids: list[int] | None = None
    normalize_log_probs: bool = True
    enable_chunked_context: bool = False   # contexts over the max_num_tokens budget run in chunks
    max_batch_size: int | None = None      # None = the engine's
    max_num_tokens: int | None = None      # None = the engine's
    max_beam_width: int | None = None
    scheduler_config: SchedulerConfig | None = None
    kernel_backend: str | None = None      # "torch" | "cuda" | "emu"; None = BATCH_MANAGER_KERNELS or default
    device: str | None = None              # torch device of the runtime; None = "cuda" if device_ids else "cpu"
    # fn(request_ids, logits [list of [beams, V] tensors, modifiable in place], token_ids [per request,
    # per beam: list of ints], stream, client_ids), once per step for the requests that set
    # InferenceRequest.use_batched_logits_post_processor; applied before sampling.
    logits_post_processor_batched: Callable | None = None
    # batch_manager.adapters.lora.PeftCacheManagerConfig: bounds of the LoRA adapter cache (None: defaults)
    peft_cache_manager_config: Any = None
    max_draft_tokens: int = 0              # longest draft_input_ids a request may bring (0: drafts refused)
    decoding_config: DecodingConfig | None = None
    guided_decoding_config: Any = None     # batch_manager.guided_decoding.GuidedDecodingConfig
    # runtime.WorldConfig: tensor parallelism over torch.distributed (None: the launcher's world size,
    # 1 without one). Every rank builds the manager with the same arguments; rank 0's callbacks run.
    world_config: Any = None
    # runtime.BuildConfig: limits and precision (dtype, weight_only, kv_cache_dtype, ...) for a checkpoint
    # or GGUF file given directly (fields left at their defaults keep the checkpoint's); None with an
    # engine directory, which records its own.
    build_config: Any = None
    kv_events_config: KvEventsConfig | None = None   # publish KV-cache events (needs block reuse)
