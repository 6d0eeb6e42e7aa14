"""The fleet protocol's metrics: vLLM's names and types next to samples.serve's own, for what
llm-d's gateway, the Gateway API inference extension and vLLM's production stack scrape. Each
carries the label `model_name` (the served name). Gauges and prefix-cache counters follow the
per-iteration stats (`update`, the worker thread); latency histograms and token counters are fed
by samples.serve.metrics.RequestTimer; `vllm:lora_requests_info` by the LoRA adapters in use."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
LORA_INFO_LABELS = ["max_lora", "running_lora_adapters", "waiting_lora_adapters"]


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, max_lora: int = 0):
        labels = {"model_name": model_name}
        names = list(labels)
        r = registry
        self.num_running = Gauge("vllm:num_requests_running", "Requests in the model's running batch", names,
                                 registry=r).labels(**labels)
        self.num_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be admitted", names,
                                 registry=r).labels(**labels)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage: used blocks / all blocks (1 = full)",
                              names, registry=r).labels(**labels)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                      "(full blocks of admitted prompts)", names, registry=r).labels(**labels)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (reused "
                                   "blocks)", names, registry=r).labels(**labels)
        self.ttft_s = Histogram("vllm:time_to_first_token_seconds", "Time to first token (s)", names,
                                buckets=TTFT_BUCKETS_S, registry=r).labels(**labels)
        self.itl_s = Histogram("vllm:inter_token_latency_seconds", "Time between generated tokens (s)", names,
                               buckets=ITL_BUCKETS_S, registry=r).labels(**labels)
        self.e2e_s = Histogram("vllm:e2e_request_latency_seconds", "Request latency, submit to last token (s)",
                               names, buckets=E2E_BUCKETS_S, registry=r).labels(**labels)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests that produced a token", names,
                                     registry=r).labels(**labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens delivered", names,
                                         registry=r).labels(**labels)
        self._lora_info = Gauge("vllm:lora_requests_info", "LoRA adapters of running and waiting requests (the "
                                "value: when this was last updated, epoch seconds)", names + LORA_INFO_LABELS,
                                registry=r)
        self._labels, self.max_lora = labels, max_lora
        self._lora_child = None
        self._seen: dict[str, float] = {}   # cumulative stats key -> the value last seen
        self.last_num_running = 0
        self.set_lora_adapters([], [])

    def update(self, stats: dict) -> None:
        """One iteration's stats (the stats JSON's keys)."""
        if "Scheduled Requests" in stats:
            self.last_num_running = stats["Scheduled Requests"]
            self.num_running.set(self.last_num_running)
        if "Active Request Count" in stats and "Scheduled Requests" in stats:
            self.num_waiting.set(max(0, stats["Active Request Count"] - stats["Scheduled Requests"]))
        if stats.get("Max KV cache blocks"):
            self.kv_usage.set(stats.get("Used KV cache blocks", 0) / stats["Max KV cache blocks"])
        tokens_per_block = stats.get("Tokens per KV cache block", 0)
        for key, counter in (("Allocated total KV cache blocks", self.prefix_queries),
                             ("Reused KV cache blocks", self.prefix_hits)):
            value = stats.get(key)
            if value is not None and value > self._seen.get(key, 0):
                counter.inc((value - self._seen.get(key, 0)) * tokens_per_block)
                self._seen[key] = value

    def set_waiting(self, num_waiting: int) -> None:
        """At scrape time: requests the server holds that the engine has not admitted yet, too."""
        self.num_waiting.set(num_waiting)

    def set_lora_adapters(self, running: list[str], waiting: list[str]) -> None:
        """The adapters (names) of running and waiting requests: one sample, its labels the lists."""
        if self._lora_child is not None:
            self._lora_info.clear()
        self._lora_child = self._lora_info.labels(**self._labels, max_lora=str(self.max_lora),
                                                  running_lora_adapters=",".join(sorted(set(running))),
                                                  waiting_lora_adapters=",".join(sorted(set(waiting))))
        self._lora_child.set(time.time())
