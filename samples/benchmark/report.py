"""Benchmark results: per-request timings, the legacy gptManagerBenchmark metrics (same names),
text and JSON reports, and the stderr progress bar (tqdm). Used by samples.benchmark and samples.benchmark.hf."""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

from tqdm import tqdm

PERCENTILES = (50, 90, 99)


@dataclass
class RequestTiming:
    """One request, times in seconds since the benchmark start."""
    enqueue_s: float
    num_output_tokens: int = 0
    first_token_s: float | None = None
    end_s: float | None = None
    error: str = ""


@dataclass
class RunResult:
    """What one backend did with one dataset."""
    backend: str
    timings: list[RequestTiming]
    total_s: float
    token_events: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, new tokens)
    iteration_stats: list[dict] = field(default_factory=list)  # the stats callback's JSON, per iteration
    is_streaming: bool = False
    extra: dict = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list)   # generated tokens per sample, where kept


def percentile(sorted_values: list[float], p: float) -> float:
    """The legacy benchmark's percentile: element ceil(p/100 * n) - 1 of the sorted list."""
    return sorted_values[max(0, math.ceil(p / 100 * len(sorted_values)) - 1)]


def summary(name: str, values_ms: list[float]) -> dict[str, float]:
    """avg/max/min/p99/p90/p50 of `values_ms`, keyed as the legacy benchmark printed them."""
    if not values_ms:
        return {}
    s = sorted(values_ms)
    out = {f"avg_{name}(ms)": sum(s) / len(s), f"max_{name}(ms)": s[-1], f"min_{name}(ms)": s[0]}
    for p in sorted(PERCENTILES, reverse=True):
        out[f"p{p}_{name}(ms)"] = percentile(s, p)
    return out


def metrics(result: RunResult) -> dict[str, float | int]:
    """The legacy metric names. token_throughput counts the generated tokens actually returned;
    inter-token latency per request = (end - first token) / (output tokens - 1)."""
    ok = [t for t in result.timings if not t.error and t.end_s is not None]
    num_tokens = sum(t.num_output_tokens for t in ok)
    total_ms = result.total_s * 1e3
    out: dict[str, float | int] = {
        "num_samples": len(result.timings), "num_error_samples": len(result.timings) - len(ok),
        "total_latency(ms)": total_ms, "seq_throughput(seq/sec)": len(ok) / result.total_s if ok else 0.0,
        "token_throughput(token/sec)": num_tokens / result.total_s if ok else 0.0,
        "num_output_tokens": num_tokens}
    out.update(summary("sequence_latency", [(t.end_s - t.enqueue_s) * 1e3 for t in ok]))
    if result.is_streaming:
        out.update(summary("time_to_first_token", [(t.first_token_s - t.enqueue_s) * 1e3 for t in ok
                                                   if t.first_token_s is not None]))
        out.update(summary("inter_token_latency", [(t.end_s - t.first_token_s) * 1e3 / (t.num_output_tokens - 1)
                                                   for t in ok if t.first_token_s is not None
                                                   and t.num_output_tokens > 1]))
    return out


def iteration_breakdown(result: RunResult) -> dict[str, float]:
    """Where the wall time went, from the stats callback's per-iteration records (each stamped
    with `time_s` on arrival): iterations that ran context requests vs generation-only ones."""
    stats = result.iteration_stats
    if not stats:
        return {}
    context_s = generation_s = 0.0
    generation_batch_sizes = []
    previous_s = 0.0
    for s in stats:
        duration_s, previous_s = s["time_s"] - previous_s, s["time_s"]
        if s.get("Context Requests", 0):
            context_s += duration_s
        else:
            generation_s += duration_s
            generation_batch_sizes.append(s.get("Generation Requests", s.get("Scheduled Requests", 0)))
    out = {"num_iterations": len(stats), "context_iterations_s": context_s,
           "generation_only_iterations_s": generation_s}
    if generation_batch_sizes:
        out["avg_generation_only_iteration(ms)"] = generation_s * 1e3 / len(generation_batch_sizes)
        out["avg_generation_batch_size"] = sum(generation_batch_sizes) / len(generation_batch_sizes)
    return out


def throughput_over_time(token_events: list[tuple[float, int]], total_s: float,
                         num_bins: int = 40) -> tuple[list[float], list[float]]:
    """(bin centres in s, tokens/s in each bin) from the (time, new tokens) events."""
    width_s = max(total_s, 1e-9) / num_bins
    counts = [0] * num_bins
    for t, n in token_events:
        counts[min(num_bins - 1, max(0, int(t / width_s)))] += n
    return [(i + 0.5) * width_s for i in range(num_bins)], [c / width_s for c in counts]


def format_text(name: str, values: dict) -> str:
    lines = [f"[BENCHMARK] {name}"]
    for key, value in values.items():
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"[BENCHMARK] {key} {shown}")
    return "\n".join(lines)


def progress_bar(total: int, label: str, enabled: bool = True) -> tqdm:
    """tqdm on stderr counting finished requests; callers `update(1)` per final response and
    `close()` at the end. Off when not enabled or nothing to count."""
    return tqdm(total=total, desc=label, unit="req", file=sys.stderr, disable=not enabled or total <= 0,
                dynamic_ncols=True)
