"""The generation step, fused (one native call) against eager (op by op), per precision mode.

For each mode: one runner with the fused step and one without, on the same engine (the real default
model unless --model), a context step of --prompt tokens for each of R sequences, then the time of
one generation step of R rows, median of --steps, for:
  eager        every op from Python (BATCH_MANAGER_FUSED_DECODE=0's path)
  fused        the whole step as one native call
  matmuls      the same call running its weight GEMVs alone (same inputs, split and barriers)
and "outside" = the median over step pairs of fused - matmuls: the time of everything but the
weight matmuls (norms, rotary, KV write, attention, SiLU, the attention-out and down projections'
inputs quantized by their producers, the barriers). Fused and matmuls-only
steps alternate on one runner (the matmuls-only ones write no KV; their positions are still
taken), so a shared machine's drift falls on both alike.

    python -m samples.microbench.decode_step [--rows 1 4 8] [--modes fp32 bf16 int8 int4 int8+a8 int4+a8 blocks]
        [--kv-cache-dtype auto|int8]

(+a8: int8 activations, BuildConfig.act_quant; blocks: a GGUF file's own blocks, the default model's Q4_1.)
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

# A GGUF source's blocks are kept by default (BuildConfig.weight_format "auto"): "fp32" and "bf16"
# de-quantize them, "blocks" keeps them (GGUF sources only).
MODES = {"fp32": {"weight_format": "dequantize"}, "bf16": {"dtype": "bfloat16", "weight_format": "dequantize"},
         "int8": {"weight_only": "int8"}, "int4": {"weight_only": "int4", "group_size": 32},
         "int8+a8": {"weight_only": "int8", "act_quant": "int8"},
         "int4+a8": {"weight_only": "int4", "group_size": 32, "act_quant": "int8"},
         "blocks": {"weight_format": "keep"}}


def modes_for(source: str, modes: list[str]) -> list[str]:
    """`modes` less "blocks" when `source` is not a GGUF file (a checkpoint has no blocks to keep)."""
    return [m for m in modes if m != "blocks" or str(source).endswith(".gguf")]


def _build(source: str, directory: str, overrides: dict) -> None:
    from runtime import build_engine
    build_engine(source, directory, **overrides)


def time_steps(runner, rows: int, prompt: int, steps: int, setups=(None,)) -> list[list[float]]:
    """Seconds of each generation step of `rows` sequences after a `prompt`-token context, per
    setup: setup(runner) runs before each of its steps, the setups taking turns step by step."""
    from runtime.step_inputs import SequenceStep, pack_step
    tpb = runner.tokens_per_block
    total = steps * len(setups)
    blocks_per_seq = -(-(prompt + total + 8) // tpb)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(rows)]
    tokens = [[(7 * i + j) % 1000 + 10 for j in range(prompt)] for i in range(rows)]
    runner.forward(pack_step([SequenceStep(t, 0, b) for t, b in zip(tokens, tables)]))
    times = [[] for _ in setups]
    for step in range(total):
        which = step % len(setups)
        if setups[which] is not None:
            setups[which](runner)
        inputs = pack_step([SequenceStep([42 + i], prompt + step, b) for i, b in enumerate(tables)])
        start = time.perf_counter()
        runner.forward(inputs)
        times[which].append(time.perf_counter() - start)
    return [t[2:] for t in times]


def matmuls_only(value: int):
    def setup(runner):
        runner.decode_step.matmuls_only = value
    return setup


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint or GGUF file (default: the real default model's GGUF)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8])
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="BuildConfig.kv_cache_dtype of every mode's engine (the fused step reads float32, bf16 "
                        "and int8 caches)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from runtime import Engine, ModelRunner
    from samples.default_model import real_model_gguf
    from samples.microbench.llama_cpp_compare import in_fresh_process
    from samples.microbench.weight_only import cpu_description
    source = args.model or real_model_gguf()
    print(f"{cpu_description()}, {torch.get_num_threads()} threads; ms per generation step "
          f"(median of {args.steps}), {args.prompt}-token context, KV cache {args.kv_cache_dtype}")
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for mode in modes_for(source, args.modes):
            directory = os.path.join(work, mode)
            overrides = {**MODES[mode], "kv_cache_dtype": args.kv_cache_dtype}
            in_fresh_process(_build, source, directory, overrides)   # NOTE: no build thread pool left here
            engine = Engine.from_dir(directory)
            blocks = -(-(args.prompt + 2 * args.steps + 8) // engine.build_config.tokens_per_block) * max(args.rows)
            fused, eager = ModelRunner(engine, blocks), ModelRunner(engine, blocks, fused_decode=False)
            if fused.decode_step is None:
                print(f"  {mode}: the fused step does not cover this model")
                continue
            for rows in args.rows:
                whole, alone = time_steps(fused, rows, args.prompt, args.steps, (matmuls_only(0), matmuls_only(1)))
                fused.decode_step.matmuls_only = 0
                row = {"eager": statistics.median(time_steps(eager, rows, args.prompt, args.steps)[0]),
                       "fused": statistics.median(whole), "matmuls": statistics.median(alone),
                       "outside": statistics.median(a - b for a, b in zip(whole, alone)),
                       "kv_dtype": str(engine.kv_storage_dtype).removeprefix("torch.")}
                results[(mode, rows)] = row
                print(f"  {mode:7s} rows {rows}: KV {row['kv_dtype']}  eager {row['eager'] * 1e3:6.2f}  fused {row['fused'] * 1e3:6.2f} "
                      f"({row['eager'] / row['fused']:.2f}x)  matmuls {row['matmuls'] * 1e3:6.2f}  "
                      f"outside {row['outside'] * 1e3:5.2f}")
            del fused, eager, engine
    return results


if __name__ == "__main__":
    main()
