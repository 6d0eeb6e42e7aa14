"""Pipeline against tensor parallelism on this machine, in one run: W64 through samples.benchmark
with 1 process x 2 threads, TP=2 and PP=2 (torchrun, 2 ranks x 1 thread, gloo on loopback), and,
where network namespaces can be made (root), TP=2 and PP=2 across two namespaces joined by a
veth pair (samples.two_hosts: TCP between them, no shared memory); then what a step sends and
where its time goes.

    python -m samples.microbench.pipeline_parallel               # every part
    python -m samples.microbench.pipeline_parallel --part steps  # the step breakdown only

Every part runs the random 57M LLaMA (`--random-model`: SmolLM2's 9 heads do not split over 2
tensor-parallel ranks). The step part runs itself under torchrun with PP=2: each rank runs packed
steps of it (a 512-token context, generation batches of 1, 8 and 64) one at a time through the
runtime, and reports per step its wall time, the time it waited in receives (rank 1: for the
hidden states; rank 0: for the logits, i.e. while rank 1 computes), and the bytes each stage
sends: hidden states [tokens, hidden] forward, float32 logits [rows, vocab] back to rank 0, and
the manager's pickled step message (what rank 0 sends every other rank before each forward).
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time

import torch

from samples.microbench.tensor_parallel import TOKENS, _benchmark, _steps


def _torchrun(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *args]


def _across_hosts(mode: str, extra: list[str], output_json: str) -> dict | None:
    """W64 with TP=2 or PP=2 across two network namespaces; None where they cannot be made."""
    from samples.two_hosts import NamespacesUnavailable, TwoHosts
    args = ["--backend", "ours", "--no-roofline", "--no-progress", "--threads", "1", *extra,
            "--pipeline-parallelism", "2" if mode == "pp" else "1"]
    try:
        with TwoHosts() as hosts:
            ranks = [hosts.launch(host, host, {}, [*args, *(["--output-json", output_json] if host == 0 else [])],
                                  module=("samples.benchmark",)) for host in (0, 1)]
            for rank, process in enumerate(ranks):
                _, err = process.communicate(timeout=1800)
                if process.returncode != 0:
                    raise RuntimeError(f"rank {rank} across hosts failed:\n{err[-3000:]}")
    except NamespacesUnavailable as e:
        print(f"[PP] across hosts: skipped ({e})")
        return None
    with open(output_json) as f:
        return json.load(f)["ours"]


def run_w64(extra: list[str], across_hosts: bool) -> None:
    env = dict(os.environ)
    one_thread = {**env, "OMP_NUM_THREADS": "1"}
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs["1 process x 2 threads"] = _benchmark(
            [sys.executable, "-m", "samples.benchmark", "--threads", "2", *extra], os.path.join(tmp, "one.json"), env)
        runs["TP=2, one host"] = _benchmark(_torchrun(["-m", "samples.benchmark", "--threads", "1", *extra]),
                                            os.path.join(tmp, "tp.json"), one_thread)
        runs["PP=2, one host"] = _benchmark(_torchrun(["-m", "samples.benchmark", "--threads", "1",
                                                       "--pipeline-parallelism", "2", *extra]),
                                            os.path.join(tmp, "pp.json"), one_thread)
        if across_hosts:
            for mode in ("tp", "pp"):
                r = _across_hosts(mode, extra, os.path.join(tmp, f"{mode}-hosts.json"))
                if r is not None:
                    runs[f"{mode.upper()}=2, two hosts"] = r
    base = runs["1 process x 2 threads"][TOKENS]
    for name, r in runs.items():
        print(f"[PP] W64 {name}: {r[TOKENS]:.1f} token/s ({r[TOKENS] / base:.3f}x), total "
              f"{r['total_latency(ms)'] / 1e3:.1f} s, avg generation-only iteration "
              f"{r['avg_generation_only_iteration(ms)']:.1f} ms at batch {r['avg_generation_batch_size']:.1f}")


def measure_steps(reps: int) -> None:
    """Under torchrun (2 ranks, PP=2): per step kind, each rank's wall and receive-wait ms, bytes."""
    import torch.distributed as dist

    from runtime import Engine, ModelRunner, WorldConfig
    from runtime.parallel.tensor_parallel import init_tensor_parallel
    from runtime.parallel.pipeline import StagePlan
    from samples.default_model import random_model_dir
    world = WorldConfig(tensor_parallelism=1, pipeline_parallelism=2)
    tp = init_tensor_parallel(world, torch.device("cpu"))
    engine = Engine.from_dir(random_model_dir(), shard=None, stage=StagePlan(tp.global_rank, 2))
    tpb = engine.build_config.tokens_per_block
    runner = ModelRunner(engine, 64 * -(-201 // tpb) + 8, tensor_parallel=tp, gather_logits_to_all=False)
    stage, cfg = runner.stage, engine.model_config
    rows = []
    for name, inputs in _steps(cfg.vocab_size, tpb).items():
        runner.forward(inputs)   # warm-up
        walls, waits, sent = [], [], []
        for _ in range(reps):
            dist.barrier(group=tp.control_group)
            stage.seconds_receiving, bytes_before = 0.0, stage.bytes_sent
            start = time.perf_counter()
            runner.forward(inputs)
            stage.flush()
            walls.append(time.perf_counter() - start)
            waits.append(stage.seconds_receiving)
            sent.append(stage.bytes_sent - bytes_before)
        walls.sort()
        waits.sort()
        message = len(pickle.dumps(("forward", ([], [], inputs)), protocol=pickle.HIGHEST_PROTOCOL))
        rows.append((name, walls[len(walls) // 2], waits[len(waits) // 2], sent[0], message))
    gathered = [None, None]
    dist.all_gather_object(gathered, rows, group=tp.control_group)
    if tp.global_rank == 0:
        print(f"[PP] step breakdown, 2 stages x 1 thread, random 57M LLaMA ({cfg.num_layers} layers: "
              f"{runner.stage.layers.num_layers} + {cfg.num_layers - runner.stage.layers.num_layers}, the last also "
              f"the final norm and lm_head), one step at a time; median of {reps}")
        for (name, wall0, wait0, sent0, message), (_, wall1, wait1, sent1, _) in zip(*gathered):
            print(f"[PP] {name}: stage 0 computes {(wall0 - wait0) * 1e3:.2f} ms and waits {wait0 * 1e3:.2f} ms "
                  f"for the logits; stage 1 waits {wait1 * 1e3:.2f} ms for the hidden states and computes "
                  f"{(wall1 - wait1) * 1e3:.2f} ms; sent: hidden states {sent0} B, logits {sent1} B, step "
                  f"message {message} B")
    dist.barrier(group=tp.control_group)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["all", "w64", "steps"], default="all")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--no-hosts", action="store_true", help="skip the runs across network namespaces")
    args = p.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:   # the step part, re-launched under torchrun
        torch.set_num_threads(1)
        measure_steps(args.reps)
        return
    if args.part in ("all", "w64"):
        run_w64(["--random-model", "--workload", "w64", "--num-samples", str(args.num_samples)], not args.no_hosts)
    if args.part in ("all", "steps"):
        subprocess.run(_torchrun(["-m", "samples.microbench.pipeline_parallel", "--reps", str(args.reps)]),
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    main()
