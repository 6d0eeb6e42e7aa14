"""LoRA overhead on the W64 benchmark: the same dataset through one GptManager without adapters and
with every request on one of N rank-r adapters (all seven projections of every layer), alternating
in one run; reports each pass's throughput and the adapter overhead (time with / time without).

    python -m samples.benchmark.lora                      # W64, 4 adapters of rank 16, 2 rounds
    python -m samples.benchmark.lora --num-adapters 8 --rank 8 --rounds 1 --output-json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from batch_manager import GptManager, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType
from runtime.config import ModelConfig
from runtime.adapters.lora import lora_modules
from samples.benchmark.cli import model_limits
from samples.benchmark.dataset import LengthDistribution, Sample, synthetic_dataset
from samples.benchmark.ours import BenchmarkClient, make_request
from samples.default_model import add_model_arguments, model_from_arguments

MODULES = ("attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_gate", "mlp_4h_to_h")


def random_adapter(cfg: ModelConfig, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TensorRT-LLM format tensors (weights [N, W], config int32 [N, 3]) of a random rank-`rank`
    adapter on every projection of every layer."""
    gen = torch.Generator().manual_seed(seed)
    modules = {m.name: (i, m) for i, m in lora_modules(cfg).items()}
    rows, config = [], []
    for layer in range(cfg.num_layers):
        for name in MODULES:
            if name not in modules:
                continue
            module_id, m = modules[name]
            rows.append(torch.randn(rank * (m.in_features + m.out_features), generator=gen) * 0.02)
            config.append((module_id, layer, rank))
    weights = torch.zeros(len(rows), max(r.numel() for r in rows))
    for i, row in enumerate(rows):
        weights[i, :row.numel()] = row
    return weights, torch.tensor(config, dtype=torch.int32)


def run_pass(manager_client: BenchmarkClient, samples: list[Sample], first_id: int,
             adapters: list[tuple[torch.Tensor, torch.Tensor]] | None, sent: set[int]) -> tuple[float, int]:
    """All samples at once (offline); request i on adapter i % N (weights with a task's first
    request only). -> (seconds until the last final response, generated tokens)."""
    client = manager_client
    client.reset(len(samples), None)
    for i, sample in enumerate(samples):
        r = make_request(first_id + i, sample, streaming=False)
        if adapters is not None:
            task_id = i % len(adapters)
            r.lora_task_id = torch.tensor([task_id], dtype=torch.uint64)
            if task_id not in sent:
                r.lora_weights, r.lora_config = adapters[task_id]
                sent.add(task_id)
        client.submit(r)
    client.done.wait()
    errors = [t.error for t in client.timings.values() if t.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    total_s = max(t.end_s for t in client.timings.values())
    return total_s, sum(t.num_output_tokens for t in client.timings.values())


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, "--engine-dir")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--prompt-len", default="uniform:16:256")
    p.add_argument("--output-len", default="uniform:16:128")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="passes of each kind, alternating (base first)")
    p.add_argument("--output-json", metavar="PATH")
    args = p.parse_args(argv)
    model_dir = model_from_arguments(args.engine_dir, args.random_model)
    cfg, max_seq_len = model_limits(model_dir)
    samples = synthetic_dataset(args.num_samples, LengthDistribution.parse("--prompt-len", args.prompt_len),
                                LengthDistribution.parse("--output-len", args.output_len), cfg.vocab_size,
                                args.seed, max_seq_len)
    adapters = [random_adapter(cfg, args.rank, seed) for seed in range(args.num_adapters)]
    client = BenchmarkClient()
    times: dict[str, list[float]] = {"base": [], "lora": []}
    tokens = 0
    sent: set[int] = set()
    with GptManager(model_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *client.callbacks(), TrtGptModelOptionalParams(), exclude_input_in_output=True):
        # Warm-up: one request per adapter (brings its weights; later passes send ids only), then base.
        run_pass(client, samples[:args.num_adapters], 1 << 40, adapters, sent)
        run_pass(client, samples[:4], 1 << 41, None, sent)
        for k in range(args.rounds):
            for kind in ("base", "lora"):
                seconds, tokens = run_pass(client, samples, (k * 2 + (kind == "lora")) * len(samples),
                                           adapters if kind == "lora" else None, sent)
                times[kind].append(seconds)
    base, lora = statistics.median(times["base"]), statistics.median(times["lora"])
    report = {"num_samples": len(samples), "num_adapters": args.num_adapters, "rank": args.rank,
              "generated_tokens": tokens, "base_s": times["base"], "lora_s": times["lora"],
              "base_token_throughput": tokens / base, "lora_token_throughput": tokens / lora,
              "lora_overhead_ratio": lora / base}
    for key, value in report.items():
        print(f"{key:>24}: {value}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
