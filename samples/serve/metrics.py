"""Prometheus metrics of samples.serve: gauges fed from GptManager's per-iteration stats JSON, in the
metric families and label names of the legacy Triton TensorRT-LLM backend (`nv_trt_llm_*_metrics`,
labels `model`, `version` and one type label per family), updated on the worker thread, with
counters of what the stats count (reused KV blocks, context tokens computed, dropped KV events); and
request latency histograms and token counters (`LatencyMetrics`), observed by the HTTP handlers.
vLLM's names for the same (vllm_metrics, the fleet protocol) live in the same registry."""
from __future__ import annotations

import time

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from samples.serve.vllm_metrics import VllmMetrics

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

# stats JSON key -> (counter, help): what the per-iteration stats count, summed over the run. The
# cumulative keys are advanced by their growth; "Total Context Tokens" is one iteration's.
CUMULATIVE_COUNTERS = {
    "Reused KV cache blocks": ("nv_trt_llm_kv_cache_reused_blocks", "KV cache blocks taken over from the prefix "
                                                                    "cache instead of computed"),
    "KV Events Dropped": ("nv_trt_llm_kv_events_dropped", "KV-event messages a subscriber could not take")}
PER_ITERATION_COUNTERS = {
    "Total Context Tokens": ("nv_trt_llm_context_tokens_computed", "Prompt tokens whose KV was computed (not reused)")}

# What an idle manager (no active request, so no stats callback) is known to hold.
IDLE_VALUES = {"Active Request Count": 0, "Scheduled Requests": 0, "Context Requests": 0, "Generation Requests": 0,
               "Paused Requests": 0, "Total Context Tokens": 0, "Used KV cache blocks": 0}

# What a reader polls to know the manager is idle: set after every other gauge of an update (a
# scrape may come between two gauges' updates; one that sees these settle sees the rest).
SETTLE_KEYS = ("Used KV cache blocks", "Active Request Count")


def in_update_order(stats: dict) -> list[tuple[str, object]]:
    """stats' items with SETTLE_KEYS last."""
    return sorted(stats.items(), key=lambda item: item[0] in SETTLE_KEYS)


class TritonMetrics:
    """One gauge family per legacy family; `update(stats_json)` sets every gauge whose key is present."""

    def __init__(self, is_static_batching: bool, model: str = "tensorrt_llm", version: str = "1",
                 registry: CollectorRegistry | None = None, served_model_name: str | None = None):
        """served_model_name: the `model_name` label of vLLM's metrics (default: `model`)."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self.vllm = VllmMetrics(self.registry, served_model_name or model)
        self.labels = {"model": model, "version": version}
        families = (REQUEST, MEMORY, KV_CACHE, V1 if is_static_batching else INFLIGHT, GENERAL)
        self._key_to_gauges: dict[str, list] = {}
        for name, help_text, type_label, value_to_key in families:
            gauge = Gauge(name, help_text, ["model", "version", type_label], registry=self.registry)
            for label_value, key in value_to_key.items():
                child = gauge.labels(**self.labels, **{type_label: label_value})
                self._key_to_gauges.setdefault(key, []).append(child)
        self.last_stats: dict = {}
        self._key_to_counter = {key: Counter(name, help_text, ["model", "version"], registry=self.registry)
                                .labels(**self.labels)
                                for key, (name, help_text) in {**CUMULATIVE_COUNTERS, **PER_ITERATION_COUNTERS}.items()}
        self._cumulative: dict[str, float] = {}   # key -> the value last seen
        self.latency = LatencyMetrics(self.registry, self.labels, self.vllm)

    def update(self, stats_json: str | bytes) -> None:
        stats = orjson.loads(stats_json)
        self.last_stats = stats
        self.vllm.update(stats)
        for key, value in in_update_order(stats):
            if key == "Timestamp":
                value = time.mktime(time.strptime(value, TIMESTAMP_FORMAT))
            for child in self._key_to_gauges.get(key, ()):
                child.set(value)
            if key in CUMULATIVE_COUNTERS and value > self._cumulative.get(key, 0):
                self._key_to_counter[key].inc(value - self._cumulative.get(key, 0))
                self._cumulative[key] = value
            elif key in PER_ITERATION_COUNTERS and value > 0:
                self._key_to_counter[key].inc(value)

    def mark_idle(self) -> None:
        """The stats callback is silent while nothing is active: show what an idle manager holds."""
        if "Max KV cache blocks" in self.last_stats:
            for child in self._key_to_gauges["Free KV cache blocks"]:
                child.set(self.last_stats["Max KV cache blocks"])
        for key, value in in_update_order(IDLE_VALUES):
            for child in self._key_to_gauges.get(key, ()):
                child.set(value)
        self.vllm.update({**IDLE_VALUES, "Max KV cache blocks": self.last_stats.get("Max KV cache blocks", 0)})


# Buckets in seconds (vLLM's, for dashboards that compare the two).
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0)
ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5)
E2E_BUCKETS_S = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class LatencyMetrics:
    """Histograms of time to first token, inter-token latency and end-to-end latency, and counters
    of prompt and generated tokens, for every engine request the handlers stream (the OpenAI
    endpoints always do; /generate when "stream" is true). Times are taken on the handler's event
    loop as each response arrives there: what a client sees, less the network."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str], vllm: VllmMetrics | None = None):
        """vllm: vLLM's histograms and counters, observed alongside."""
        self.vllm = vllm
        names = list(labels)
        self.ttft_s = Histogram("nv_trt_llm_time_to_first_token_seconds", "Time to first token (s)", names,
                                buckets=TTFT_BUCKETS_S, registry=registry).labels(**labels)
        self.itl_s = Histogram("nv_trt_llm_inter_token_latency_seconds", "Time between generated tokens (s)",
                               names, buckets=ITL_BUCKETS_S, registry=registry).labels(**labels)
        self.e2e_s = Histogram("nv_trt_llm_e2e_request_latency_seconds", "Request latency, submit to last token (s)",
                               names, buckets=E2E_BUCKETS_S, registry=registry).labels(**labels)
        self.prompt_tokens = Counter("nv_trt_llm_prompt_tokens", "Prompt tokens of requests that produced a token",
                                     names, registry=registry).labels(**labels)
        self.generated_tokens = Counter("nv_trt_llm_generation_tokens", "Generated tokens delivered", names,
                                        registry=registry).labels(**labels)

    def start(self, num_prompt_tokens: int) -> "RequestTimer":
        return RequestTimer(self, num_prompt_tokens)


class RequestTimer:
    """One engine request's clock: `on_tokens` per response with tokens, `finish` once at its end
    (not called for a request the client abandoned: its latency is not a served request's)."""

    def __init__(self, metrics: LatencyMetrics, num_prompt_tokens: int):
        self.metrics, self.num_prompt_tokens = metrics, num_prompt_tokens
        self.start_s = time.perf_counter()
        self.last_token_s: float | None = None

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now_s = time.perf_counter()
        vllm = self.metrics.vllm
        if self.last_token_s is None:
            self.metrics.ttft_s.observe(now_s - self.start_s)
            self.metrics.prompt_tokens.inc(self.num_prompt_tokens)
            if vllm is not None:
                vllm.ttft_s.observe(now_s - self.start_s)
                vllm.prompt_tokens.inc(self.num_prompt_tokens)
        else:   # a response with several tokens (draft tokens accepted): the gap split evenly
            gap_s = (now_s - self.last_token_s) / num_tokens
            for _ in range(num_tokens):
                self.metrics.itl_s.observe(gap_s)
                if vllm is not None:
                    vllm.itl_s.observe(gap_s)
        self.metrics.generated_tokens.inc(num_tokens)
        if vllm is not None:
            vllm.generation_tokens.inc(num_tokens)
        self.last_token_s = now_s

    def finish(self) -> None:
        self.metrics.e2e_s.observe(time.perf_counter() - self.start_s)
        if self.metrics.vllm is not None:
            self.metrics.vllm.e2e_s.observe(time.perf_counter() - self.start_s)
