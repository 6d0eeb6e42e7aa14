"""The benchmark's PNG: latency distributions, generated tokens/s over time, and the batch
composition per iteration (from the stats callback's JSON). Needs matplotlib (the `samples` extra)."""
from __future__ import annotations

import math

from samples.benchmark.report import RunResult, throughput_over_time


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _latencies_ms(result: RunResult) -> dict[str, list[float]]:
    ok = [t for t in result.timings if not t.error and t.end_s is not None]
    out = {"sequence latency": [(t.end_s - t.enqueue_s) * 1e3 for t in ok]}
    if result.is_streaming:
        out["time to first token"] = [(t.first_token_s - t.enqueue_s) * 1e3 for t in ok if t.first_token_s]
        out["inter-token latency"] = [(t.end_s - t.first_token_s) * 1e3 / (t.num_output_tokens - 1)
                                      for t in ok if t.first_token_s and t.num_output_tokens > 1]
    return out


def write_plot(path: str, ours: RunResult, hf: RunResult | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    ax = axes[0][0]
    latencies = {name: values for name, values in _latencies_ms(ours).items() if values}
    every = [v for values in latencies.values() for v in values if v > 0]
    if every:  # log-spaced bins: TTFT, ITL and whole-sequence latency differ by orders of magnitude
        low, high = math.log10(min(every)), math.log10(max(every)) + 1e-9
        bins = [10 ** (low + (high - low) * i / 40) for i in range(41)]
        for name, values in latencies.items():
            ax.hist(values, bins=bins, alpha=0.6, label=name)
    ax.set(title="latency distribution (ours)", xlabel="ms (log scale)", ylabel="requests", xscale="log")
    ax.legend()

    ax = axes[0][1]
    for result in (ours, hf):
        if result is not None:
            centres_s, tokens_per_s = throughput_over_time(result.token_events, result.total_s)
            ax.plot(centres_s, tokens_per_s, label=f"{result.backend}",
                    drawstyle="steps-mid" if result.backend != "hf" else "default")
    ax.set(title="generated tokens/s over time", xlabel="s since start", ylabel="tokens/s")
    ax.legend()

    stats = ours.iteration_stats
    iterations = list(range(len(stats)))
    ax = axes[1][0]
    num_context = [s.get("Context Requests", 0) for s in stats]
    num_generation = [s.get("Generation Requests", s.get("Total Generation Tokens", 0)) for s in stats]
    ax.bar(iterations, num_generation, width=1.0, label="generation requests")
    ax.bar(iterations, num_context, width=1.0, bottom=num_generation, label="context requests")
    ax.plot(iterations, [s.get("Active Request Count", 0) for s in stats], color="black", lw=1,
            label="active requests")
    ax.set(title="batch composition per iteration", xlabel="iteration", ylabel="requests")
    ax.legend()

    ax = axes[1][1]
    ax.plot(iterations, [s.get("Total Context Tokens", 0) for s in stats], label="Total Context Tokens (stats JSON)")
    ax.plot(iterations, [s.get("Used KV cache blocks", 0) for s in stats], label="used KV blocks")
    ax.set(title="context tokens and KV blocks per iteration", xlabel="iteration")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
