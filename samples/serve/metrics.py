"""Prometheus gauges fed from GptManager's per-iteration stats JSON, in the metric families and
label names of the legacy Triton TensorRT-LLM backend (`nv_trt_llm_*_metrics`, labels `model`,
`version` and one type label per family). Owned by samples.serve; updated on the worker thread."""
from __future__ import annotations

import time

import orjson
from prometheus_client import CollectorRegistry, Gauge

# family -> (help, type label, {label value: stats JSON key})
REQUEST = ("nv_trt_llm_request_metrics", "TRT LLM request metrics", "request_type",
           {"active": "Active Request Count", "max": "Max Request Count", "scheduled": "Scheduled Requests",
            "context": "Context Requests"})
MEMORY = ("nv_trt_llm_runtime_memory_metrics", "TRT LLM runtime memory metrics", "memory_type",
          {"cpu": "Runtime CPU Memory Usage", "gpu": "Runtime GPU Memory Usage", "pinned": "Runtime Pinned Memory Usage"})
KV_CACHE = ("nv_trt_llm_kv_cache_block_metrics", "TRT LLM KV cache block metrics", "kv_cache_block_type",
            {"max": "Max KV cache blocks", "free": "Free KV cache blocks", "used": "Used KV cache blocks",
             "tokens_per": "Tokens per KV cache block"})
INFLIGHT = ("nv_trt_llm_inflight_batcher_metrics", "TRT LLM inflight_batcher-specific metrics",
            "inflight_batcher_specific_metric",
            {"total_context_tokens": "Total Context Tokens", "generation_requests": "Generation Requests",
             "micro_batch_id": "MicroBatch ID", "paused_requests": "Paused Requests"})
V1 = ("nv_trt_llm_v1_metrics", "TRT LLM v1-specific metrics", "v1_specific_metric",
      {"total_context_tokens": "Total Context Tokens", "total_generation_tokens": "Total Generation Tokens",
       "empty_generation_slots": "Empty Generation Slots"})
GENERAL = ("nv_trt_llm_general_metrics", "General TRT LLM metrics", "general_type",
           {"iteration_counter": "Iteration Counter", "timestamp": "Timestamp"})
TIMESTAMP_FORMAT = "%m-%d-%Y %H:%M:%S"

# What an idle manager (no active request, so no stats callback) is known to hold.
IDLE_VALUES = {"Active Request Count": 0, "Scheduled Requests": 0, "Context Requests": 0, "Generation Requests": 0,
               "Paused Requests": 0, "Total Context Tokens": 0, "Used KV cache blocks": 0}


class TritonMetrics:
    """One gauge family per legacy family; `update(stats_json)` sets every gauge whose key is present."""

    def __init__(self, is_static_batching: bool, model: str = "tensorrt_llm", version: str = "1",
                 registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.labels = {"model": model, "version": version}
        families = (REQUEST, MEMORY, KV_CACHE, V1 if is_static_batching else INFLIGHT, GENERAL)
        self._key_to_gauges: dict[str, list] = {}
        for name, help_text, type_label, value_to_key in families:
            gauge = Gauge(name, help_text, ["model", "version", type_label], registry=self.registry)
            for label_value, key in value_to_key.items():
                child = gauge.labels(**self.labels, **{type_label: label_value})
                self._key_to_gauges.setdefault(key, []).append(child)
        self.last_stats: dict = {}

    def update(self, stats_json: str | bytes) -> None:
        stats = orjson.loads(stats_json)
        self.last_stats = stats
        for key, value in stats.items():
            if key == "Timestamp":
                value = time.mktime(time.strptime(value, TIMESTAMP_FORMAT))
            for child in self._key_to_gauges.get(key, ()):
                child.set(value)

    def mark_idle(self) -> None:
        """The stats callback is silent while nothing is active: show what an idle manager holds."""
        for key, value in IDLE_VALUES.items():
            for child in self._key_to_gauges.get(key, ()):
                child.set(value)
        if "Max KV cache blocks" in self.last_stats:
            for child in self._key_to_gauges["Free KV cache blocks"]:
                child.set(self.last_stats["Max KV cache blocks"])
