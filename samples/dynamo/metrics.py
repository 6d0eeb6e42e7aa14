"""The worker's own Prometheus metrics under the names Dynamo's TensorRT-LLM backend bridges into
its `/metrics` (prefix `trtllm_`, label `model_name`): request latencies (time to first token,
per output token, end to end), finished and aborted requests, KV-cache utilization and prefix hit
rate. A private registry; `register` hands it to the runtime through Dynamo's helper."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "trtllm_"
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
TPOT_BUCKETS_S = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 1.0)
E2E_BUCKETS_S = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)


class WorkerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        names = list(labels)
        r = self.registry
        self.ttft_s = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token (s)", names,
                                buckets=TTFT_BUCKETS_S, registry=r).labels(**labels)
        self.tpot_s = Histogram(PREFIX + "time_per_output_token_seconds", "Time per output token after the first (s)",
                                names, buckets=TPOT_BUCKETS_S, registry=r).labels(**labels)
        self.e2e_s = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, enqueue to final token (s)",
                               names, buckets=E2E_BUCKETS_S, registry=r).labels(**labels)
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason",
                                names + ["finished_reason"], registry=r)
        self._labels = labels
        self.aborted = Counter(PREFIX + "num_aborted_requests", "Requests aborted (client gone, stop)", names,
                               registry=r).labels(**labels)
        self.kv_utilization = Gauge(PREFIX + "kv_cache_utilization", "Used KV blocks / all KV blocks", names,
                                    registry=r).labels(**labels)
        self.kv_hit_rate = Gauge(PREFIX + "kv_cache_hit_rate", "Prefix blocks reused / blocks allocated, since start",
                                 names, registry=r).labels(**labels)

    def finished(self, reason: str) -> None:
        self._success.labels(**self._labels, finished_reason=reason).inc()

    def register(self, engine_metrics) -> None:
        """Bridge the registry into the runtime's `/metrics` (dynamo.common.backend.metrics)."""
        from dynamo.common.backend.metrics import register_engine_registry
        register_engine_registry(engine_metrics, self.registry, prefix_filters=[PREFIX])


class RequestClock:
    """One request's times, on the worker's event loop as its results arrive."""

    def __init__(self, metrics: WorkerMetrics):
        self.metrics = metrics
        self.start_s = time.perf_counter()
        self.first_token_s: float | None = None
        self.num_tokens = 0

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter()
            self.metrics.ttft_s.observe(self.first_token_s - self.start_s)
        self.num_tokens += num_tokens

    def finish(self, reason: str) -> None:
        now_s = time.perf_counter()
        self.metrics.e2e_s.observe(now_s - self.start_s)
        if self.first_token_s is not None and self.num_tokens > 1:
            self.metrics.tpot_s.observe((now_s - self.first_token_s) / (self.num_tokens - 1))
        if reason == "cancelled":
            self.metrics.aborted.inc()
        else:
            self.metrics.finished(reason)
