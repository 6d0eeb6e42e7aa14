"""Weight-only int8 / int4 against float32 on the default model (SmolLM2-135M):

    python -m samples.microbench.weight_only [--model DIR] [--threads N] [--reps 30] [--rows 1,8,64]

1. The single-stream generation step (ModelRunner.forward of one token after a 32-token prompt) in
   each mode, best and median of `--reps`, interleaved so that other load hits every mode alike.
2. Per linear of the model at each of `--rows` rows: float32 (runtime.kernels.torch_kernels.linear.Linear) against the
   quantized ones (runtime.models.weight_only.QuantizedLinear), every layer's weight per pass so that the
   weights stream from memory as in a step; best of `--reps` passes, ms per pass.
Prints the CPU's model name and its avx2 / avx512 / amx flags with the figures.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from runtime import Engine, ModelRunner
from runtime.kernels.torch_kernels.linear import Linear
from runtime.precision import cpu_flags, cpu_info
from runtime.kernels.torch_kernels.weight_only_linear import QuantizedLinear
from samples.default_model import default_model_dir
from tests.factories import step_inputs

MODES = {"fp32": {}, "int8": dict(weight_only="int8"), "int4_g32": dict(weight_only="int4", group_size=32),
         "int4_g64": dict(weight_only="int4", group_size=64)}
LINEARS = ("qkv", "out", "mlp_in", "mlp_out")


def cpu_description() -> str:
    """The CPU's model name and the vector features the kernels choose by."""
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx2", "avx512", "amx", "avx_vnni")))
    return f"{cpu_info('model name') or 'unknown CPU'}; {', '.join(flags)}"


def generation_step_ms(runners: dict[str, ModelRunner], reps: int) -> dict[str, list[float]]:
    prompt = list(range(100, 132))
    times = {name: [] for name in runners}
    for runner in runners.values():
        runner.forward(step_inputs([(prompt, 0, [0, 1])]))
    for rep in range(reps + 3):
        for name, runner in runners.items():
            step = step_inputs([([7], len(prompt), [0, 1])])
            start = time.perf_counter()
            runner.forward(step)
            if rep >= 3:
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


def per_linear_ms(engines: dict[str, Engine], rows: int, reps: int) -> dict[str, dict[str, float]]:
    """mode -> linear -> best ms of one pass over that linear's weights in every layer."""
    out = {}
    for mode, engine in engines.items():
        w, cfg = engine.weights, engine.model_config
        out[mode] = {}
        for linear in (*LINEARS, "lm_head"):
            names = ([f"layers.{i}.{linear}.weight" for i in range(cfg.num_layers)] if linear != "lm_head"
                     else ["lm_head" if "lm_head" in w else "embed_tokens"])
            ops = [QuantizedLinear(w[n], w[n + "_scale"], w.get(n + "_min"), None) if n + "_scale" in w
                   else Linear(w[n], None, torch.device("cpu")) for n in names]
            width = w[names[0]].shape[1] * (2 if w[names[0]].dtype == torch.uint8 else 1)
            x = torch.randn(rows, width)
            best = float("inf")
            for _ in range(reps + 1):
                start = time.perf_counter()
                for op in ops:
                    op(x)
                best = min(best, time.perf_counter() - start)
            out[mode][linear] = best * 1e3 / len(ops)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="an engine or checkpoint directory (default: the samples' model)")
    p.add_argument("--threads", type=int)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rows", default="1,8,64")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or default_model_dir()
    print(f"CPU: {cpu_description()}; {torch.get_num_threads()} threads; model {path}")
    engines = {name: Engine.from_dir(path, **mode) for name, mode in MODES.items()}
    with torch.inference_mode():
        runners = {name: ModelRunner(engine, num_blocks=8) for name, engine in engines.items()}
        times = generation_step_ms(runners, args.reps)
        base = statistics.median(times["fp32"])
        print(f"single-stream generation step, ms (best / median of {args.reps}; speed-up of the median):")
        for name, t in times.items():
            mb = engines[name].weight_bytes() / 1e6
            print(f"  {name:<10} {min(t):7.2f} / {statistics.median(t):7.2f}  x{base / statistics.median(t):4.2f}"
                  f"  ({mb:.0f} MB of weights)")
        for rows in [int(r) for r in args.rows.split(",")]:
            figures = per_linear_ms(engines, rows, max(3, args.reps // 3))
            print(f"per linear at {rows} row(s), ms per weight (best of passes over every layer):")
            for name, by_linear in figures.items():
                print(f"  {name:<10} " + "  ".join(f"{k} {v:6.3f}" for k, v in by_linear.items()))


if __name__ == "__main__":
    main()
