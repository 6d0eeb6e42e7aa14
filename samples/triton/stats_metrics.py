"""The GptManager's per-iteration stats JSON as Triton custom metrics (`pb_utils.MetricFamily`
gauges, served on Triton's metrics port), in the TensorRT-LLM backend's families and labels
(`nv_trt_llm_*_metrics`, labels `model`, `version` and one type label per family). Updated by the
stats callback on the GptManager's worker thread."""
from __future__ import annotations

import time

import orjson

from samples.serve.metrics import (GENERAL, IDLE_VALUES, INFLIGHT, KV_CACHE, MEMORY, REQUEST, TIMESTAMP_FORMAT, V1,
                                   in_update_order)


class StatsMetrics:
    def __init__(self, pb_utils, model: str, version: str, is_static_batching: bool):
        labels = {"model": model, "version": version}
        self._key_to_metrics: dict[str, list] = {}
        self._families = []   # kept alive: a family that is collected leaves the metrics endpoint
        for name, help_text, type_label, value_to_key in (REQUEST, MEMORY, KV_CACHE,
                                                          V1 if is_static_batching else INFLIGHT, GENERAL):
            family = pb_utils.MetricFamily(name=name, description=help_text, kind=pb_utils.MetricFamily.GAUGE)
            self._families.append(family)
            for label_value, key in value_to_key.items():
                metric = family.Metric(labels={**labels, type_label: label_value})
                self._key_to_metrics.setdefault(key, []).append(metric)
        self.max_kv_blocks: int | None = None

    def update(self, stats_json: str | bytes) -> None:
        stats = orjson.loads(stats_json)
        self.max_kv_blocks = stats.get("Max KV cache blocks", self.max_kv_blocks)
        for key, value in in_update_order(stats):   # what a reader polls for idleness last
            if key == "Timestamp":
                value = time.mktime(time.strptime(value, TIMESTAMP_FORMAT))
            for metric in self._key_to_metrics.get(key, ()):
                metric.set(float(value))

    def mark_idle(self) -> None:
        """No stats arrive while nothing is active: show what an idle manager holds."""
        if self.max_kv_blocks is not None:
            for metric in self._key_to_metrics["Free KV cache blocks"]:
                metric.set(float(self.max_kv_blocks))
        for key, value in in_update_order(IDLE_VALUES):   # what a reader polls for idleness last
            for metric in self._key_to_metrics.get(key, ()):
                metric.set(float(value))
