"""`python -m samples.chaos_soak [--requests N] [--producers P] [--seed S] [--json OUT]`: a chaos
soak of GptManager, then of the Executor (samples.chaos_soak.executor_round) and of its disaggregated
requests (samples.chaos_soak.disaggregated_round).

Rounds of construct / serve / shut down, one per (batching type x capacity policy), with block
reuse, chunked context and overlap switched on and off between rounds, over a KV pool small
enough to force pauses; then three identical rounds for the memory check (RSS must not grow
across them, as the legacy binding's own test did). In each round, producer threads submit
random requests (greedy, seeded sampling, beam search of width 2-4, streaming or not, about 5 %
bad requests of every kind of API.md's validation list, duplicates of active ids, ids reused
after their final response); user callbacks raise at random; model steps raise at random
through the worker's `fault_injector` test hook (while prepared) and a wrapper of the
executor's forward (on the forward thread under overlap); stop signals name active and unknown ids.

Checked continuously (from the stats callback, between iterations): the KV block invariants
and the stats' block counts. Checked at the end of each round: every submission got exactly one
final response (an error naming the field for a bad one, the request_id for a duplicate), every
KV block is free with reference count 0, no thread the round started is left running, shutdown
(called with requests in flight) returned within 2 s of the last step, and a sample of the
greedy requests that were neither stopped nor failed equal a solo GptSession run.

The model is a tiny random-weight LLaMA (vocab 128, hidden 64, 2 layers, 4 heads, 2 KV heads)
written through samples.default_model, so that 10,000 requests run in minutes on 2 CPU cores.
Exit status 1 when an invariant broke. The short mode (the default, a few hundred requests)
runs in the test suite; the long mode is `--requests 10000`. The KV-events round
(samples.chaos_soak.kv_events_round) serves requests while hostile peers attack the events endpoint;
the fused-step round (samples.chaos_soak.fused_step_round) serves mixed rows through the fused
native generation step and compares their tokens with the eager path's; the Triton round
(samples.chaos_soak.triton_round, where Triton can run) serves streaming clients that stop
requests and disconnect mid-stream, then shuts the server down with requests queued.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass

import torch
from safetensors.torch import load_file, save_file

from batch_manager import (GptManager, KvCacheConfig, PeftCacheManagerConfig, SchedulerPolicy,
                           TrtGptModelOptionalParams, TrtGptModelType)
from runtime import Engine, GenerationInput, GenerationOutput, GptSession, SamplingConfig, WorldConfig, build_engine

from .disaggregated_round import disaggregated_violations, run_disaggregated_round
from .executor_round import executor_violations, run_executor_round
from .fused_step_round import fused_step_violations, run_fused_step_round
from .kv_events_round import kv_events_violations, run_kv_events_round
from .triton_round import run_triton_round, triton_summary, triton_violations
from . import requests as chaos_requests
from .requests import MAX_BEAM_WIDTH, make_bad, make_valid
from samples.benchmark.lora import random_adapter
from .tracker import ChaosClient, threads_started_since
from samples.default_model import write_random_llama

MODEL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, max_position_embeddings=256)
MODEL_NAME = "tiny random-weight LLaMA (vocab 128, hidden 64, 2 layers, 4 heads / 2 KV heads, fp32)"
# gather_generation_logits: the solo reference runs report their logits (near-tie diagnosis).
BUILD = dict(tokens_per_block=4, max_batch_size=8, max_input_len=48, max_seq_len=96, max_num_tokens=128,
             gather_generation_logits=True)
POOL_TOKENS = 192            # 48 blocks of 4 tokens: a handful of requests at once, so pauses happen
BAD_RATE = 0.05
SHUTDOWN_BOUND_S = 2.0
# RSS may rise a little between identical rounds (allocator caches, torch's thread pools, log
# records): growth from the first to the third memory round above this is reported as a leak.
RSS_TOLERANCE_MIB = 16.0
GREEDY_CHECKS_PER_ROUND = 8   # at least; one per 40 requests of the round beyond that
# Three adapters (task id -> rank) on all 14 (module, layer) rows of the model; the PEFT cache holds
# two on the device and two on the host, so adapters are evicted, reloaded and forgotten.
LORA_RANKS = {1: 2, 2: 4, 3: 8}
PEFT_CACHE = PeftCacheManagerConfig(num_device_module_layer=28, num_host_module_layer=28)
DRAIN_TIMEOUT_S = 120.0
FUSED_ROUND_MIN_REQUESTS = 40


@dataclass(frozen=True)
class RoundConfig:
    model_type: str
    policy: str
    enable_block_reuse: bool
    enable_chunked_context: bool
    enable_trt_overlap: bool


def round_configs() -> list[RoundConfig]:
    """Every batching type x capacity policy; reuse, chunking and overlap alternate on and off."""
    configs = []
    for i, (model_type, policy) in enumerate((m, p) for m in TrtGptModelType for p in SchedulerPolicy):
        configs.append(RoundConfig(model_type.name, policy.name, enable_block_reuse=i % 2 == 0,
                                   enable_chunked_context=i % 3 != 1, enable_trt_overlap=i % 4 in (0, 3)))
    return configs


MEMORY_CONFIG = RoundConfig("InflightFusedBatching", "MAX_UTILIZATION", True, True, True)


def make_engine(directory: str) -> str:
    """The soak's model: random weights widened to N(0, 0.2) so greedy argmaxes are clear (a
    batched and a solo run then pick the same tokens), built into an engine directory."""
    hf = write_random_llama(os.path.join(directory, "hf"), seed=0, **MODEL)
    path = os.path.join(hf, "model.safetensors")
    tensors = {k: (v * 10 if v.dim() >= 2 else v) for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    engine_dir = os.path.join(directory, "engine")
    build_engine(hf, engine_dir, **BUILD)
    return engine_dir


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def _produce(client: ChaosClient, seed: int, num_requests: int) -> None:
    rng = random.Random(seed)
    for _ in range(num_requests):
        request_id = client.take_id(rng)
        make = make_bad if rng.random() < BAD_RATE else make_valid
        client.submit(*make(rng, request_id))
        if rng.random() < 0.3:
            time.sleep(rng.expovariate(1000.0))   # bursts and gaps of ~1 ms


def build_round_manager(engine_dir: str, config: RoundConfig, callbacks: tuple, world_config=None) -> GptManager:
    """The manager of one round. Under tensor (or pipeline) parallelism every rank builds it;
    ranks > 0 pass (None, None, None, None) as the callbacks. world_config: a runtime.WorldConfig
    (default: the launcher's world as tensor parallelism)."""
    params = TrtGptModelOptionalParams(
        kv_cache_config=KvCacheConfig(max_tokens=POOL_TOKENS, enable_block_reuse=config.enable_block_reuse),
        enable_chunked_context=config.enable_chunked_context, enable_trt_overlap=config.enable_trt_overlap,
        max_num_tokens=64 if config.enable_chunked_context else None, peft_cache_manager_config=PEFT_CACHE,
        world_config=world_config)
    return GptManager(engine_dir, TrtGptModelType[config.model_type], MAX_BEAM_WIDTH, SchedulerPolicy[config.policy],
                      *callbacks, params)


def follow_round(engine_dir: str, config: RoundConfig, world_config=None) -> str | None:
    """A rank > 0 of a tensor- or pipeline-parallel soak: the round's manager, until rank 0 ends the
    run; -> its fatal error (None when the run ended cleanly)."""
    manager = build_round_manager(engine_dir, config, (None, None, None, None), world_config)
    manager.shutdown()
    return manager.fatal_error


def use_soak_adapters(engine_dir: str) -> None:
    """The LoRA adapters the soak's requests name (random, seeded per task id)."""
    config = Engine.from_dir(engine_dir).model_config
    chaos_requests.LORA_ADAPTERS.update({task_id: random_adapter(config, rank, seed=task_id)
                                         for task_id, rank in LORA_RANKS.items()})


def run_round(engine_dir: str, config: RoundConfig, num_requests: int, num_producers: int, seed: int,
              session: GptSession, world_config=None) -> dict:
    threads_before = set(threading.enumerate())
    client = ChaosClient(seed)
    start = time.monotonic()
    manager = build_round_manager(engine_dir, config, (client.get, client.send, client.poll_stop,
                                                        client.report_stats), world_config)
    client.kv = manager.kv_cache_manager   # checked after each round
    manager.model_executor.fault_injector = client.fault_injector
    shares = [num_requests // num_producers + (i < num_requests % num_producers) for i in range(num_producers)]
    producers = [threading.Thread(target=_produce, args=(client, seed * 1000 + i, n), name=f"producer-{i}")
                 for i, n in enumerate(shares)]
    for t in producers:
        t.start()
    for t in producers:
        t.join()
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while client.num_queued and time.monotonic() < deadline and manager.is_running:   # every request fetched ...
        time.sleep(0.001)
    worker_died = not manager.is_running
    num_in_flight = client.num_outstanding
    shutdown_start = time.monotonic()
    manager.shutdown()                                          # ... and shut down with them in flight
    shutdown_end = time.monotonic()
    kv = client.kv
    leaked = kv.num_blocks - kv.num_free_blocks
    nonzero_refs = sum(1 for b in range(kv.num_blocks) if kv.ref_count(b) != 0)
    try:
        kv.check_invariants()
        kv_ok = True
    except AssertionError:
        kv_ok = False
    del manager
    gc.collect()
    threads_left = threads_started_since(threads_before)
    mismatches, checked = check_greedy_sample(client, session, random.Random(seed))
    counts = client.counts
    return dict(
        config=asdict(config), requests=num_requests, submitted=counts["submitted"], served=counts["served"],
        greedy=counts["greedy"], sampled=counts["sampled"], beam=counts["beam"], bad=counts["bad"],
        duplicates=counts["duplicate"], bad_fields=dict(client.bad_fields),
        stopped=counts["stopped"], expected_errors=counts["expected_errors"], faulted=counts["faulted"],
        lora_served=counts["lora_served"], lora_uncached=counts["lora_uncached"],
        lora_evictions=client.num_lora_evictions,
        unexpected_errors=counts["unexpected"], worker_died=worker_died,
        unanswered=client.num_outstanding + client.num_queued,
        unexpected_messages=list(client.unexpected), paused=client.num_paused, leaked_blocks=leaked,
        nonzero_ref_counts=nonzero_refs, kv_invariants_ok=kv_ok, threads_left=threads_left,
        in_flight_at_shutdown=num_in_flight,
        shutdown_s=round(shutdown_end - shutdown_start, 4),
        shutdown_after_last_step_s=round(shutdown_end - client.last_activity_s, 4),
        greedy_checked=checked, greedy_mismatches=mismatches, rss_mib=round(rss_mib(), 1),
        wall_s=round(time.monotonic() - start, 2))


def check_greedy_sample(client: ChaosClient, session: GptSession, rng: random.Random) -> tuple[list[int], int]:
    """Greedy requests neither stopped nor failed: a sample must equal a solo GptSession run."""
    done = client.greedy_done
    sample = rng.sample(done, min(max(GREEDY_CHECKS_PER_ROUND, client.num_fetched // 40), len(done)))
    mismatches = []
    for sub, tokens in sample:
        p = sub.prompt
        out = GenerationOutput()
        session.generate(out, GenerationInput(sub.end_id, 0, torch.tensor([p], dtype=torch.int32),
                                              torch.tensor([len(p)], dtype=torch.int32),
                                              max_new_tokens=sub.max_new_tokens), SamplingConfig(beam_width=1))
        expected = out.ids[0, 0, :int(out.lengths[0, 0])].tolist()
        if expected != tokens:
            d = next((i for i, (a, b) in enumerate(zip(expected, tokens)) if a != b), min(len(expected), len(tokens)))
            logits = out.generation_logits[0, 0, d - len(p)] if d - len(p) < sub.max_new_tokens else None
            top2 = logits.topk(2).values.tolist() if logits is not None else [0.0, 0.0]
            mismatches.append(dict(request_id=sub.request_id, kind=sub.kind, prompt=p, end_id=sub.end_id,
                                   max_new_tokens=sub.max_new_tokens, expected=expected, got=tokens,
                                   first_difference=d, solo_top2_logit_margin=top2[0] - top2[1]))
    return mismatches, len(sample)


def violations(round_report: dict) -> list[str]:
    r, found = round_report, []
    for key in ("unexpected_errors", "unanswered", "leaked_blocks", "nonzero_ref_counts"):
        if r[key]:
            found.append(f"{key}: {r[key]}")
    if r["worker_died"]:
        found.append("the worker thread died before shutdown")
    if not r["kv_invariants_ok"]:
        found.append("KV invariants broken at the end")
    if r["threads_left"]:
        found.append(f"threads left running: {r['threads_left']}")
    if r["shutdown_after_last_step_s"] > SHUTDOWN_BOUND_S:
        found.append(f"shutdown returned {r['shutdown_after_last_step_s']} s after the last step")
    if r["greedy_mismatches"]:
        found.append(f"greedy requests differ from their solo run: {r['greedy_mismatches']}"[:2000])
    return found


def run_soak(num_requests: int = 300, num_producers: int = 4, seed: int = 0, workdir: str | None = None) -> dict:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        engine_dir = make_engine(tmp)
        engine = Engine.from_dir(engine_dir)
        use_soak_adapters(engine_dir)
        session = GptSession(GptSession.Config(max_batch_size=1, max_beam_width=1,
                                               max_sequence_length=BUILD["max_seq_len"]),
                             engine.model_config, WorldConfig(), engine)
        configs = round_configs() + [MEMORY_CONFIG] * 3
        per_round = max(1, num_requests // len(configs))
        rounds = []
        for i, config in enumerate(configs):
            n = per_round + (num_requests - per_round * len(configs) if i == len(configs) - 1 else 0)
            memory_round = i >= len(configs) - 3
            # The memory rounds repeat one workload exactly: same seed, same size.
            round_seed = seed * 100 + (len(configs) - 3 if memory_round else i)
            rounds.append(run_round(engine_dir, config, per_round if memory_round else n, num_producers,
                                    round_seed, session))
        memory = [r["rss_mib"] for r in rounds[-3:]]
        executor_round = run_executor_round(engine_dir, POOL_TOKENS, per_round, num_producers, seed * 100 + 99)
        kv_events_round = run_kv_events_round(engine_dir, POOL_TOKENS, per_round, seed * 100 + 97)
        disaggregated_round = run_disaggregated_round(engine_dir, POOL_TOKENS, per_round, num_producers,
                                                      seed * 100 + 98)
        fused_step_round = run_fused_step_round(engine_dir, POOL_TOKENS, max(per_round, FUSED_ROUND_MIN_REQUESTS),
                                                seed * 100 + 96)
        triton_round = run_triton_round(engine_dir, POOL_TOKENS, per_round, num_producers, seed * 100 + 95)
    found = [f"round {i} ({r['config']['model_type']}, {r['config']['policy']}): {v}"
             for i, r in enumerate(rounds) for v in violations(r)]
    found += [f"executor round: {v}" for v in executor_violations(executor_round)]
    found += [f"KV-events round: {v}" for v in kv_events_violations(kv_events_round)]
    found += [f"disaggregated round: {v}" for v in disaggregated_violations(disaggregated_round)]
    found += [f"fused-step round: {v}" for v in fused_step_violations(fused_step_round)]
    found += [f"Triton round: {v}" for v in triton_violations(triton_round)]
    growth = round(memory[-1] - memory[0], 1)
    if growth > RSS_TOLERANCE_MIB:
        found.append(f"RSS grew {growth} MiB across three identical rounds (tolerance {RSS_TOLERANCE_MIB})")
    total = {key: sum(r[key] for r in rounds) for key in (
        "requests", "submitted", "greedy", "sampled", "beam", "bad", "duplicates", "served", "stopped",
        "expected_errors", "faulted", "lora_served", "lora_uncached", "lora_evictions", "unexpected_errors",
        "unanswered", "leaked_blocks", "nonzero_ref_counts", "paused", "greedy_checked")}
    return dict(model=MODEL_NAME, num_rounds=len(rounds), producers=num_producers, seed=seed, totals=total,
                greedy_mismatches=sum(len(r["greedy_mismatches"]) for r in rounds),
                bad_fields=dict(sum((Counter(r["bad_fields"]) for r in rounds), Counter())),
                memory_rounds_rss_mib=memory, memory_growth_mib=growth, rss_tolerance_mib=RSS_TOLERANCE_MIB,
                slowest_shutdown_s=max(r["shutdown_s"] for r in rounds),
                slowest_shutdown_after_last_step_s=max(r["shutdown_after_last_step_s"] for r in rounds),
                wall_s=round(time.monotonic() - start, 1), violations=found, rounds=rounds,
                kv_events_round=kv_events_round,
                executor_round=executor_round, disaggregated_round=disaggregated_round,
                fused_step_round=fused_step_round, triton_round=triton_round)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m samples.chaos_soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300, help="requests over all rounds (long mode: 10000)")
    p.add_argument("--producers", type=int, default=4, help="producer threads per round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the full report here")
    args = p.parse_args(argv)
    # The manager logs every contained fault with its traceback: thousands of expected ones.
    logging.basicConfig(level=os.environ.get("CHAOS_SOAK_LOG_LEVEL", "CRITICAL"))
    report = run_soak(args.requests, args.producers, args.seed)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    t = report["totals"]
    print(f"model: {report['model']}")
    print(f"rounds: {report['num_rounds']}, producers: {report['producers']}, seed: {report['seed']}")
    print(f"requests submitted: {t['submitted']} ({t['greedy']} greedy, {t['sampled']} sampled, {t['beam']} beam, "
          f"{t['bad']} bad, {t['duplicates']} duplicates of active ids), served: {t['served']} "
          f"({t['stopped']} stopped), expected errors: {t['expected_errors']} ({t['faulted']} injected step "
          f"faults), unexpected errors: {t['unexpected_errors']}, unanswered: {t['unanswered']}")
    print(f"LoRA: {t['lora_served']} adapter requests served, {t['lora_uncached']} id-only ones refused as evicted, "
          f"{t['lora_evictions']} evictions")
    print(f"bad requests by field: {report['bad_fields']}")
    print(f"pauses: {t['paused']}, blocks leaked: {t['leaked_blocks']}, non-zero reference counts: "
          f"{t['nonzero_ref_counts']}, greedy checked: {t['greedy_checked']}, "
          f"mismatches: {report['greedy_mismatches']}")
    print(f"memory rounds RSS (MiB): {report['memory_rounds_rss_mib']}, growth {report['memory_growth_mib']} MiB "
          f"(tolerance {report['rss_tolerance_mib']})")
    print(f"slowest shutdown: {report['slowest_shutdown_s']} s (drain included), "
          f"{report['slowest_shutdown_after_last_step_s']} s after the last step; wall {report['wall_s']} s")
    print(triton_summary(report["triton_round"]))
    for v in report["violations"]:
        print(f"VIOLATION {v}")
    for r in report["rounds"]:
        for m in r["unexpected_messages"]:
            print(f"  unexpected: {m}")
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
