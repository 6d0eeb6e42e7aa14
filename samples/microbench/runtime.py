"""Benchmark the runtime's ModelRunner: context and generation steps against the bounds of this
machine, measured in the same run: the matmul roofline of the run's dtype and the read bandwidth.

    python -m samples.bench_runtime [--model DIR] [--dtype float32|bfloat16] [--batch-sizes 1,8,64]
                                    [--threads N] [--json OUT]

--dtype converts the weights at load (the KV cache follows); several (float32,bfloat16) run one
after the other in the same process. The float32 and bf16 matmul rates are both measured, and each
row's bounds use its dtype (its GEMM rate, its bytes per weight).

Context: one packed step of `batch` fresh prompts of --prompt-len tokens. Generation: one step of
`batch` sequences, one new token each, with --past-len tokens already in the KV cache. FLOPs
count every matmul (2 per weight per token; the lm_head only for the tokens whose logits are
computed: each sequence's last token) plus attention (4 * keys * num_heads * head_dim per token
per layer: QK^T and PV).

Bounds of a step: streaming (the bytes a step must read from memory: every matmul weight, the
layers' and the lm_head's, plus the cached keys and values it attends to; the embedding is a
gather of a few rows and is not counted) divided by the best read bandwidth of a plain sum over
a 256 MiB tensor; and the matmul roofline (the step's FLOPs at the best torch.mm rate in the
run's dtype). `share`
is the larger bound over the measured step: 100 % is the machine's limit.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from runtime import Engine, ModelConfig, ModelRunner
from runtime.step_inputs import SequenceStep, pack_step
from samples.default_model import add_model_arguments, model_from_arguments

# (m, k, n): the model's MLP-input matmul at several token counts, and a big square one.
MATMUL_SHAPES = [(m, 512, 1536) for m in (64, 128, 256, 512, 1024)] + [(2048, 2048, 2048)]
READ_BYTES = 256 << 20  # far above the last-level cache: a read of it streams from memory


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def matmul_gflops(m: int, k: int, n: int, reps: int, dtype: torch.dtype = torch.float32) -> float:
    """Best torch.mm throughput of [m x k] @ [k x n] in `dtype` (bf16: oneDNN's bf16 GEMM)."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    torch.mm(a, b)
    best_s = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        best_s = min(best_s, time.perf_counter() - start)
    return 2 * m * k * n / best_s / 1e9


def layer_matmul_params(cfg: ModelConfig) -> int:
    """Weights every token multiplies by in the decoder layers (embeddings and lm_head excluded)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    mlp_in = 2 * i if cfg.mlp_type == "gated" else i
    return cfg.num_layers * (h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + mlp_in * h + i * h)


def step_flops(cfg: ModelConfig, batch: int, new_tokens: int, past: int) -> float:
    """FLOPs of one step of `batch` sequences, each with `new_tokens` new tokens after `past` cached."""
    tokens = batch * new_tokens
    keys = batch * sum(past + j + 1 for j in range(new_tokens))  # keys seen, summed over queries
    attention = 4 * keys * cfg.q_size * cfg.num_layers
    return 2.0 * layer_matmul_params(cfg) * tokens + attention + 2.0 * cfg.vocab_size * cfg.hidden_size * batch


def read_bandwidth_gbs(reps: int) -> float:
    """Best GB/s of a plain sum over READ_BYTES of float32 (the torch threads in use)."""
    data = torch.ones(READ_BYTES // 4)
    data.sum()
    best_s = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        data.sum()
        best_s = min(best_s, time.perf_counter() - start)
    return READ_BYTES / best_s / 1e9


def step_bytes(cfg: ModelConfig, batch: int, new_tokens: int, past: int, itemsize: int) -> dict[str, int]:
    """Bytes one step must read from memory: the matmul weights (layers and lm_head, each once per
    step whatever the batch) and the cached keys and values its queries attend to."""
    weights = (layer_matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size) * itemsize
    kv = batch * (past + new_tokens) * cfg.num_layers * 2 * cfg.kv_size * itemsize
    return {"weight_bytes": weights, "kv_bytes": kv}


def step_inputs(tokens: torch.Tensor, past: int, block_tables: torch.Tensor) -> dict[str, torch.Tensor]:
    """tokens int32 [batch, new], block_tables int32 [batch, blocks] -> ModelRunner.forward inputs."""
    return pack_step([SequenceStep(row, past, table) for row, table in zip(tokens.tolist(), block_tables.tolist())])


def time_step(runner: ModelRunner, inputs: dict, warmup: int, iters: int) -> float:
    """Median seconds of one forward."""
    for _ in range(warmup):
        runner.forward(inputs)
    times_s = []
    for _ in range(iters):
        start = time.perf_counter()
        runner.forward(inputs)
        times_s.append(time.perf_counter() - start)
    return statistics.median(times_s)


def measure_matmul(reps: int, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    return {f"{m}x{k}x{n}": matmul_gflops(m, k, n, reps, dtype) for m, k, n in MATMUL_SHAPES}


def measure_matmuls(reps: int) -> dict[str, dict[str, float]]:
    """dtype name -> shape -> GFLOP/s, one dtype after the other."""
    return {name: measure_matmul(reps, dtype) for name, dtype in DTYPES.items()}


def bench_batch(runner: ModelRunner, batch: int, args) -> list[dict]:
    cfg, tpb = runner.model_config, runner.tokens_per_block
    blocks_per_seq = -(-(max(args.prompt_len, args.past_len) + 1) // tpb)
    block_tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
    gen = torch.Generator().manual_seed(batch)
    rows = []
    prompts = torch.randint(3, cfg.vocab_size, (batch, args.prompt_len), generator=gen, dtype=torch.int32)
    # The context step also fills the cache that the generation step then attends to.
    context = (time_step(runner, step_inputs(prompts, 0, block_tables), args.warmup, args.iters),
               step_flops(cfg, batch, args.prompt_len, 0), batch * args.prompt_len)
    if args.past_len != args.prompt_len:
        past_tokens = torch.randint(3, cfg.vocab_size, (batch, args.past_len), generator=gen, dtype=torch.int32)
        runner.forward(step_inputs(past_tokens, 0, block_tables))
    new_tokens = torch.randint(3, cfg.vocab_size, (batch, 1), generator=gen, dtype=torch.int32)
    generation = (time_step(runner, step_inputs(new_tokens, args.past_len, block_tables), args.warmup,
                            args.iters * 4), step_flops(cfg, batch, 1, args.past_len), batch)
    itemsize = runner.dtype.itemsize
    streamed = (step_bytes(cfg, batch, args.prompt_len, 0, itemsize), step_bytes(cfg, batch, 1, args.past_len, itemsize))
    for phase, (seconds, flops, tokens), nbytes in zip(("context", "generation"), (context, generation), streamed):
        gflops = flops / seconds / 1e9
        rows.append(dict(batch=batch, phase=phase, step_ms=seconds * 1e3, tokens_per_s=tokens / seconds,
                         gflops=gflops, flops=flops, **nbytes))
    return rows


def with_bounds(row: dict, roofline_gflops: float, read_gbs: float) -> dict:
    """row + the step's streaming and matmul bounds (ms) and the share of the larger one."""
    stream_ms = (row["weight_bytes"] + row["kv_bytes"]) / (read_gbs * 1e9) * 1e3
    matmul_ms = row["flops"] / (roofline_gflops * 1e9) * 1e3
    return dict(row, roofline_fraction=row["gflops"] / roofline_gflops, stream_bound_ms=stream_ms,
                matmul_bound_ms=matmul_ms, share_of_bound=max(stream_ms, matmul_ms) / row["step_ms"])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--cache-dir", help="where the default model is written (default ~/.cache/batch_manager)")
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--prompt-len", type=int, default=128, help="context tokens per sequence")
    p.add_argument("--past-len", type=int, default=128, help="cached tokens per sequence in generation")
    p.add_argument("--tokens-per-block", type=int, default=64)
    p.add_argument("--dtype", help="compute dtype(s), comma-separated: float32, bfloat16 (default: the "
                   "engine's own); several: each in turn in one run, with the step time ratios")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before each measurement")
    p.add_argument("--iters", type=int, default=3, help="timed context steps (generation: 4x as many); median")
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    return p.parse_args()


def print_rows(rows: list[dict]) -> None:
    print(f"{'dtype':<8}  {'batch':>5}  {'phase':<10}  {'step ms':>9}  {'tokens/s':>10}  {'GFLOP/s':>8}  "
          f"{'of roofline':>11}  {'MB read':>8}  {'stream ms':>9}  {'matmul ms':>9}  {'share':>6}")
    for r in rows:
        print(f"{r['dtype']:<8}  {r['batch']:>5}  {r['phase']:<10}  {r['step_ms']:>9.1f}  {r['tokens_per_s']:>10.1f}  "
              f"{r['gflops']:>8.1f}  {r['roofline_fraction']:>10.1%}  "
              f"{(r['weight_bytes'] + r['kv_bytes']) / 1e6:>8.1f}  {r['stream_bound_ms']:>9.2f}  "
              f"{r['matmul_bound_ms']:>9.2f}  {r['share_of_bound']:>6.1%}")


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    model_dir = model_from_arguments(args.model, args.random_model, args.cache_dir)
    dtypes = [d for d in (args.dtype or "").split(",") if d] or [None]
    if any(d not in DTYPES for d in dtypes if d is not None):
        raise SystemExit(f"--dtype: expected names among {sorted(DTYPES)}, got {args.dtype!r}")
    engines = [Engine.from_dir(model_dir, tokens_per_block=args.tokens_per_block, **({"dtype": d} if d else {}))
               for d in dtypes]
    cfg = engines[0].model_config
    print(f"model: {model_dir}")
    print(f"  {cfg.architecture}, {cfg.num_params() / 1e6:.1f}M parameters ({cfg.num_layers} layers, hidden "
          f"{cfg.hidden_size}, {cfg.num_heads} heads / {cfg.num_kv_heads} kv, intermediate "
          f"{cfg.intermediate_size}, vocab {cfg.vocab_size}), run in "
          f"{', '.join(e.model_config.dtype for e in engines)}")
    print(f"  torch {torch.__version__}, {torch.get_num_threads()} threads")

    with torch.inference_mode():
        matmul = measure_matmuls(reps=max(5, args.iters))
        read_gbs = read_bandwidth_gbs(reps=max(5, args.iters))
        blocks_per_seq = -(-(max(args.prompt_len, args.past_len) + 1) // args.tokens_per_block)
        results = []
        for engine in engines:   # NOTE: one runner at a time, so that no two pools compete for the cache
            runner = ModelRunner(engine, num_blocks=max(batch_sizes) * blocks_per_seq)
            results += [dict(r, dtype=engine.model_config.dtype) for batch in batch_sizes
                        for r in bench_batch(runner, batch, args)]
            del runner
        # NOTE: measured before and after the model, best kept: a busy machine only lowers the peak.
        again = measure_matmuls(reps=max(5, args.iters))
        read_gbs = max(read_gbs, read_bandwidth_gbs(reps=max(5, args.iters)))
    matmul = {dt: {name: max(g, again[dt][name]) for name, g in rates.items()} for dt, rates in matmul.items()}
    rooflines = {dt: max(rates.values()) for dt, rates in matmul.items()}
    for dt, rates in matmul.items():
        print(f"{dt} matmul GFLOP/s (m x k x n): " + ", ".join(f"{name} {g:.1f}" for name, g in rates.items())
              + f"; roofline (best) {rooflines[dt]:.1f}")
    print(f"bf16 / float32 matmul roofline: {rooflines['bfloat16'] / rooflines['float32']:.2f}x")
    print(f"read bandwidth (sum over {READ_BYTES >> 20} MiB, best): {read_gbs:.1f} GB/s")
    rows = [with_bounds(r, rooflines.get(r["dtype"], rooflines["float32"]), read_gbs) for r in results]
    print("\nbounds per row in its dtype (its matmul roofline, its bytes per weight and cached value)")
    print_rows(rows)
    if len(engines) > 1:
        first = engines[0].model_config.dtype
        print(f"\nstep time ratios against {first} (same run):")
        for r in rows:
            base = next(b for b in rows if b["dtype"] == first and (b["batch"], b["phase"]) == (r["batch"], r["phase"]))
            if r["dtype"] != first:
                print(f"  {r['dtype']} batch {r['batch']} {r['phase']}: {base['step_ms'] / r['step_ms']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model_dir": model_dir, "model": cfg.to_dict(), "num_params": cfg.num_params(),
                       "threads": torch.get_num_threads(), "prompt_len": args.prompt_len,
                       "past_len": args.past_len, "matmul_gflops": matmul, "rooflines_gflops": rooflines,
                       "read_bandwidth_gbs": read_gbs, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
