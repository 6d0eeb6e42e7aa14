"""Tensor parallelism on this machine: W64 through samples.benchmark with 2 ranks x 1 thread
(torchrun, gloo) against 1 process x 2 threads, in one run, and the all-reduce share of a step.

    python -m samples.microbench.tensor_parallel              # both parts
    python -m samples.microbench.tensor_parallel --part share # the step breakdown only

Both parts run the random 57M LLaMA (`--random-model`: SmolLM2's 9 heads do not split over 2
ranks). The share part runs itself under torchrun: each rank runs packed steps (a 512-token
context step, generation steps of 1, 8 and 64 sequences) and rank 0 reports the wall
time of a step, the time inside all-reduce (which includes waiting for the slower rank) and the
time of the same all-reduces alone (a loop of them on tensors of the step's shapes), through the
runtime's path (shared memory on one host) and through gloo.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

TOKENS = "token_throughput(token/sec)"


def _benchmark(cmd: list[str], output_json: str, env: dict) -> dict:
    subprocess.run(cmd + ["--backend", "ours", "--no-roofline", "--no-progress", "--output-json", output_json],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    with open(output_json) as f:
        return json.load(f)["ours"]


def run_w64(extra: list[str]) -> None:
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        one = _benchmark([sys.executable, "-m", "samples.benchmark", "--threads", "2", *extra],
                         os.path.join(tmp, "one.json"), env)
        two = _benchmark([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                          "samples.benchmark", "--threads", "1", *extra], os.path.join(tmp, "two.json"),
                         {**env, "OMP_NUM_THREADS": "1"})
    for name, r in (("1 process x 2 threads", one), ("2 ranks x 1 thread", two)):
        print(f"[TP] W64 {name}: {r[TOKENS]:.1f} token/s, total {r['total_latency(ms)'] / 1e3:.1f} s, "
              f"avg generation-only iteration {r['avg_generation_only_iteration(ms)']:.1f} ms "
              f"at batch {r['avg_generation_batch_size']:.1f}")
    print(f"[TP] W64 2 ranks / 1 process: {two[TOKENS] / one[TOKENS]:.3f}x token throughput")


def _steps(vocab: int, tpb: int) -> dict[str, dict]:
    from runtime.step_inputs import SequenceStep, pack_step
    g = torch.Generator().manual_seed(0)
    steps = {"context 512 tokens": pack_step([SequenceStep(torch.randint(0, vocab, (512,), generator=g).tolist(), 0,
                                                           list(range(512 // tpb)))])}
    for batch in (1, 8, 64):
        blocks_per_seq = -(-201 // tpb)
        steps[f"generation batch {batch}"] = pack_step([
            SequenceStep([int(torch.randint(0, vocab, (1,), generator=g))], 200,
                         list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))) for i in range(batch)])
    return steps


def measure_share(reps: int) -> None:
    """Under torchrun: per step kind, wall ms, all-reduce ms (in the step) and alone."""
    import torch.distributed as dist

    from runtime import Engine, ModelRunner, WorldConfig
    from runtime.parallel.tensor_parallel import init_tensor_parallel
    from samples.default_model import random_model_dir
    tp = init_tensor_parallel(WorldConfig(tensor_parallelism=None), torch.device("cpu"))
    engine = Engine.from_dir(random_model_dir())
    tpb = engine.build_config.tokens_per_block
    runner = ModelRunner(engine, 64 * -(-201 // tpb) + 8, tensor_parallel=tp, gather_logits_to_all=False)
    cfg = engine.model_config
    rows = []
    for name, inputs in _steps(cfg.vocab_size, tpb).items():
        runner.forward(inputs)   # warm-up
        walls, reduces = [], []
        for _ in range(reps):
            tp.time_all_reduce, tp.all_reduce_seconds = True, 0.0
            dist.barrier(group=tp.control_group)
            start = time.perf_counter()
            runner.forward(inputs)
            walls.append(time.perf_counter() - start)
            reduces.append(tp.all_reduce_seconds)
        num_tokens = inputs["input_ids"].numel()
        buffer = torch.randn(num_tokens, cfg.hidden_size)
        num_reduces = 2 * cfg.num_layers + 1     # two per layer (sequential residual) and the embedding
        alone = []
        for reduce in (tp.all_reduce, lambda t: dist.all_reduce(t, group=tp.group)):   # ours, gloo's
            dist.barrier(group=tp.control_group)
            start = time.perf_counter()
            for _ in range(reps):
                for _ in range(num_reduces):
                    reduce(buffer)
            alone.append((time.perf_counter() - start) / reps)
        walls.sort()
        reduces.sort()
        rows.append((name, walls[len(walls) // 2], reduces[len(reduces) // 2], *alone, num_reduces,
                     num_tokens * cfg.hidden_size * 4))
    if tp.rank == 0:
        mode = "shared memory" if tp.shared is not None else "gloo"
        print(f"[TP] all-reduce share, {tp.size} ranks x {torch.get_num_threads()} thread, random 57M LLaMA "
              f"({cfg.num_layers} layers, hidden {cfg.hidden_size}), all-reduce through {mode}; median of {reps}")
        for name, wall, reduce, alone, gloo, n, nbytes in rows:
            print(f"[TP] {name}: step {wall * 1e3:.2f} ms, in all-reduce {reduce * 1e3:.2f} ms "
                  f"({reduce / wall:.1%}, incl. waiting for the other rank); its {n} all-reduces of {nbytes} "
                  f"bytes alone: {alone * 1e3:.2f} ms ({alone / wall:.1%}), through gloo {gloo * 1e3:.2f} ms")


def measure_one_process(reps: int) -> None:
    """The same steps in this process with 2 threads (the yardstick of the share part)."""
    from runtime import Engine, ModelRunner
    from samples.default_model import random_model_dir
    from samples.microbench.runtime import time_step
    torch.set_num_threads(2)
    engine = Engine.from_dir(random_model_dir())
    tpb = engine.build_config.tokens_per_block
    runner = ModelRunner(engine, 64 * -(-201 // tpb) + 8)
    print("[TP] 1 process x 2 threads, the same steps; median of", reps)
    for name, inputs in _steps(engine.model_config.vocab_size, tpb).items():
        print(f"[TP] {name}: step {time_step(runner, inputs, 1, reps) * 1e3:.2f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["both", "w64", "share"], default="both")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--num-samples", type=int, default=64)
    args = p.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:   # the share part, re-launched under torchrun
        torch.set_num_threads(1)
        measure_share(args.reps)
        return
    if args.part in ("both", "w64"):
        run_w64(["--random-model", "--num-samples", str(args.num_samples)])
    if args.part in ("both", "share"):
        # NOTE: in a child process, so this one's OpenMP pool does not sit beside the ranks' threads.
        subprocess.run([sys.executable, "-c", "from samples.microbench.tensor_parallel import measure_one_process; "
                        f"measure_one_process({args.reps})"], check=True)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                        "samples.microbench.tensor_parallel", "--reps", str(args.reps)], check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    main()
