"""The Executor round of samples.chaos_soak: producer threads enqueue random requests (the soak's
valid mix, converted to Executor Requests with random priorities, plus about 5 % bad ones that
must raise ValueError naming their field at enqueue), cancel random ids, and keep enqueuing
while the executor is shut down in flight (those enqueues must raise). A consumer awaits every
response. Checked: every enqueued id got exactly one final response and nothing after it, no
response for an id never enqueued, the KV pool is whole, nothing is left in the executor's
queues and stores, and no thread the round started is left running."""
from __future__ import annotations

import math
import random
import threading
import time
from collections import Counter

import torch

from batch_manager import InferenceRequest, tensor_names as tn
from batch_manager.executor import (CapacitySchedulerPolicy, Executor, ExecutorConfig, KvCacheConfig, LoraConfig,
                                    OutputConfig, Request, SamplingConfig, SchedulerConfig)
from runtime.decoding import parse_word_list
from runtime.decoding.fields import SAMPLING_FIELDS
from samples.chaos_soak.requests import MAX_BEAM_WIDTH, make_valid
from samples.chaos_soak.tracker import threads_started_since

# (the field the ValueError must name, a request that is bad in that field)
BAD_REQUESTS = [
    ("sampling_config.top_k", lambda p: Request(p, 4, sampling_config=SamplingConfig(top_k=-1))),
    ("input_token_ids", lambda p: Request([5, 500], 4)),
    ("input_token_ids", lambda p: Request("t5 t6", 4)),
    ("max_tokens", lambda p: Request(p, 0)),
    ("priority", lambda p: Request(p, 4, priority=2.0)),
    ("sampling_config.beam_width", lambda p: Request(p, 4, sampling_config=SamplingConfig(beam_width=9))),
    ("sampling_config.temperature", lambda p: Request(p, 4, sampling_config=SamplingConfig(temperature=math.nan))),
    ("bad_words", lambda p: Request(p, 4, bad_words=[[5, 999]])),
    ("end_id", lambda p: Request(p, 4, end_id=1000)),
    ("embedding_bias", lambda p: Request(p, 4, embedding_bias=torch.zeros(3))),
    ("lora_config", lambda p: Request(p, 4, lora_config=LoraConfig(1))),
]

# wire tensor -> SamplingConfig field (the field table's; the seed is masked to uint64 below)
_SAMPLING = {f.tensor: f.executor_sampling for f in SAMPLING_FIELDS
             if f.executor_sampling is not None and f.param != "random_seed"}


def _to_executor_request(r: InferenceRequest) -> Request:
    """One of the soak's valid requests (GptManager's tensors) -> an Executor Request of the same settings."""
    t = r.input_tensors
    scalar = {name: t[name].reshape(-1)[0].item() for name in t if t[name].numel() == 1}
    sampling = {field: scalar[name] for name, field in _SAMPLING.items() if name in scalar}
    if tn.RANDOM_SEED in scalar:
        sampling["seed"] = scalar[tn.RANDOM_SEED] & ((1 << 64) - 1)
    words = {field: [list(w) for w in parse_word_list(t[name], name, 1 << 31)] if name in t else None
             for field, name in (("stop_words", tn.STOP_WORDS_LIST), ("bad_words", tn.BAD_WORDS_LIST))}
    return Request(t[tn.INPUT_IDS].reshape(-1).tolist(), scalar.get(tn.MAX_NEW_TOKENS), streaming=r.is_streaming,
                   sampling_config=SamplingConfig(**sampling), end_id=scalar.get(tn.END_ID),
                   pad_id=scalar.get(tn.PAD_ID), embedding_bias=t.get(tn.EMBEDDING_BIAS),
                   output_config=OutputConfig(return_log_probs=bool(scalar.get(tn.RETURN_LOG_PROBS, False)),
                                              num_top_log_probs=int(scalar.get(tn.NUM_TOP_LOG_PROBS, 0)),
                                              exclude_input_from_output=True), **words)


class _Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.enqueued: set[int] = set()
        self.counts: Counter = Counter()
        self.finals: Counter = Counter()
        self.after_final: list[int] = []
        self.unknown: list[int] = []
        self.wrong_bad: list[str] = []

    def count(self, key: str) -> None:
        with self.lock:
            self.counts[key] += 1


def _produce(executor: Executor, tally: _Tally, seed: int, num_requests: int, bad_rate: float) -> None:
    rng = random.Random(seed)
    mine: list[int] = []
    for _ in range(num_requests):
        if rng.random() < bad_rate:
            field, make = rng.choice(BAD_REQUESTS)
            try:
                executor.enqueue_request(make([5, 6, 7]))
                tally.wrong_bad.append(f"{field}: accepted")
            except ValueError as e:
                tally.count("bad")
                if field not in str(e):
                    tally.wrong_bad.append(f"{field}: {e}")
            except RuntimeError:
                tally.count("refused_after_shutdown")
            continue
        inference_request, _ = make_valid(rng, 0)
        request = _to_executor_request(inference_request)
        request.priority = rng.choice([0.1, 0.5, 0.5, 0.9])
        try:
            with tally.lock:    # recorded before a response of the id can be counted
                request_id = executor.enqueue_request(request)
                tally.enqueued.add(request_id)
                tally.counts["enqueued"] += 1
            mine.append(request_id)
        except RuntimeError:
            tally.count("refused_after_shutdown")
        if mine and rng.random() < 0.1:
            executor.cancel_request(rng.choice(mine))
            tally.count("cancels")
        if rng.random() < 0.3:
            time.sleep(rng.expovariate(1000.0))


def _consume(executor: Executor, tally: _Tally, stop: threading.Event) -> None:
    while not stop.is_set():
        for response in executor.await_responses(timeout=0.01):
            is_final = response.has_error() or response.result.is_final
            with tally.lock:
                rid = response.request_id
                if rid not in tally.enqueued:
                    tally.unknown.append(rid)
                elif tally.finals[rid]:
                    tally.after_final.append(rid)
                if is_final:
                    tally.finals[rid] += 1
                    tally.counts["errors" if response.has_error() else "served"] += 1
                    if not response.has_error() and response.result.finish_reasons[0].name == "CANCELLED":
                        tally.counts["cancelled"] += 1


def run_executor_round(engine_dir: str, pool_tokens: int, num_requests: int, num_producers: int, seed: int,
                       bad_rate: float = 0.05, timeout_s: float = 300.0) -> dict:
    threads_before = set(threading.enumerate())
    rng = random.Random(seed)
    policy = rng.choice([CapacitySchedulerPolicy.GUARANTEED_NO_EVICT, CapacitySchedulerPolicy.MAX_UTILIZATION])
    config = ExecutorConfig(max_beam_width=MAX_BEAM_WIDTH, scheduler_config=SchedulerConfig(policy),
                            kv_cache_config=KvCacheConfig(max_tokens=pool_tokens, enable_block_reuse=rng.random() < 0.5),
                            iter_stats_max_iterations=16, request_stats_max_iterations=4)
    start = time.monotonic()
    executor = Executor(engine_dir, executor_config=config)
    tally, stop = _Tally(), threading.Event()
    consumer = threading.Thread(target=_consume, args=(executor, tally, stop), name="chaos-executor-consumer")
    consumer.start()
    shares = [num_requests // num_producers + (i < num_requests % num_producers) for i in range(num_producers)]
    producers = [threading.Thread(target=_produce, args=(executor, tally, seed * 1000 + i, n, bad_rate))
                 for i, n in enumerate(shares)]
    for t in producers:
        t.start()
    deadline = time.monotonic() + timeout_s
    while tally.counts["enqueued"] + tally.counts["bad"] < num_requests * 2 // 3 and time.monotonic() < deadline \
            and any(t.is_alive() for t in producers):
        time.sleep(0.001)
    in_flight = len(tally.enqueued) - sum(1 for v in tally.finals.values() if v)
    executor.shutdown()                      # in flight: producers are still enqueuing
    for t in producers:
        t.join()
    while any(not tally.finals[rid] for rid in list(tally.enqueued)) and time.monotonic() < deadline:
        time.sleep(0.005)
    stop.set()
    consumer.join()
    kv = executor.kv_cache_manager
    try:
        kv.check_invariants()
        kv_ok = True
    except AssertionError:
        kv_ok = False
    leftovers = dict(executor.get_bookkeeping_counts(), used_blocks=kv.num_used_blocks)
    del executor, kv
    threads_left = threads_started_since(threads_before)
    return dict(policy=policy.name, enable_block_reuse=config.kv_cache_config.enable_block_reuse,
                requests=num_requests, **dict(tally.counts), in_flight_at_shutdown=in_flight,
                unanswered=sum(1 for rid in tally.enqueued if tally.finals[rid] == 0),
                several_finals=sum(1 for v in tally.finals.values() if v > 1),
                after_final=len(tally.after_final), unknown_ids=len(tally.unknown),
                wrong_bad=tally.wrong_bad[:10], kv_invariants_ok=kv_ok, leftovers=leftovers,
                threads_left=threads_left,
                wall_s=round(time.monotonic() - start, 2))


def executor_violations(r: dict) -> list[str]:
    found = [f"{key}: {r[key]}" for key in ("unanswered", "several_finals", "after_final", "unknown_ids",
                                            "wrong_bad") if r[key]]
    found += [f"left after shutdown: {k} {v}" for k, v in r["leftovers"].items() if v]
    if not r["kv_invariants_ok"]:
        found.append("KV invariants broken at the end")
    if r["threads_left"]:
        found.append(f"threads left running: {r['threads_left']}")
    return found
