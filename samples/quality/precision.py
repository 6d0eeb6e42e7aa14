"""Precision modes side by side (samples.quality --precision): each mode's engine is built from the
model directory into a temporary one (runtime.build_engine with the mode's BuildConfig fields);
its perplexity on the same windows and its greedy answers to the same chat prompts are compared
with the float32 engine's. A mode the runtime cannot run here is reported with the reason."""
from __future__ import annotations

import math
import tempfile

from runtime import ConfigError, build_engine

# --precision names -> BuildConfig fields ("+" combines: "bf16+int8").
MODE_FIELDS = {
    "fp32": {}, "bf16": {"dtype": "bfloat16"}, "fp16": {"dtype": "float16"}, "auto": {"dtype": "auto"},
    "int8": {"weight_only": "int8"}, "int4": {"weight_only": "int4", "group_size": 32},
    "int4-g64": {"weight_only": "int4", "group_size": 64}, "int4-g128": {"weight_only": "int4", "group_size": 128},
    "kv-int8": {"kv_cache_dtype": "int8"}, "kv-fp8": {"kv_cache_dtype": "fp8"},
    "a8": {"act_quant": "int8"},   # int8 activations, with int8 or int4: "int8+a8", "int4+a8"
}


def mode_fields(name: str) -> dict:
    fields: dict = {}
    for part in name.split("+"):
        if part not in MODE_FIELDS:
            raise ValueError(f"--precision: unknown mode {part!r}; known: {', '.join(MODE_FIELDS)} (join with '+')")
        fields.update(MODE_FIELDS[part])
    return fields


def compare_modes(model_dir: str, modes: list[str], windows: list[list[int]], prompts: list[list[int]],
                  max_tokens: int, end_id: int) -> dict:
    """Per mode: perplexity over `windows` (runtime path), its ratio to float32's, and how many
    greedy answers to `prompts` equal float32's (with the first differing position of the others)."""
    from samples.quality.agreement import first_difference, serve
    from samples.quality.perplexity import runtime_nll
    results: dict = {}
    baseline = None
    for mode in ["fp32"] + [m for m in modes if m != "fp32"]:
        with tempfile.TemporaryDirectory() as engine_dir:
            try:
                engine = build_engine(model_dir, engine_dir, **mode_fields(mode))
            except ConfigError as e:
                results[mode] = {"refused": str(e)}
                continue
            nll = runtime_nll(engine_dir, windows)
            answers = [tokens for tokens, _ in serve(engine_dir, prompts, max_tokens, end_id)]
            row = {"dtype": engine.model_config.dtype, "weight_bytes": engine.weight_bytes(),
                   "kv_bytes_per_token": engine.kv_bytes_per_token(),
                   "perplexity": math.exp(sum(nll) / len(nll)), "answers": answers}
        if baseline is None:
            baseline = row
        row["perplexity_vs_fp32"] = row["perplexity"] / baseline["perplexity"] - 1.0
        differences = [first_difference(a, b) for a, b in zip(row["answers"], baseline["answers"])]
        row["greedy_equal_to_fp32"] = sum(d is None for d in differences)
        row["first_differences"] = {i: d for i, d in enumerate(differences) if d is not None}
        results[mode] = row
    return results


def print_modes(results: dict, num_prompts: int) -> None:
    print(f"precision modes against float32 (perplexity on the same windows; greedy answers to {num_prompts} "
          "chat prompts):")
    for mode, row in results.items():
        if "refused" in row:
            print(f"  {mode:12s} refused: {row['refused']}")
            continue
        print(f"  {mode:12s} {row['dtype']:8s} weights {row['weight_bytes'] / 2**20:7.1f} MiB, KV {row['kv_bytes_per_token']:6d} "
              f"B/token, perplexity {row['perplexity']:.4f} ({row['perplexity_vs_fp32']:+.2%}), greedy answers equal "
              f"to fp32: {row['greedy_equal_to_fp32']}/{num_prompts}")
