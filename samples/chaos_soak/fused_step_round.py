"""The fused-step round of samples.chaos_soak: GptManager serves greedy and seeded sampled requests
(prompts of 1-40 tokens, 1-24 new tokens, some ending on an end id, half streamed, a few stopped while
they run) at most 8 sequences at a time, so that its generation steps run the fused native step
(runtime/kernels/cpu/cpu_decode_step.py, counted) over rows that finish at different steps while new
ones join, with multi-step decoding on (DecodingConfig.max_decode_steps 4: the calls that ran several
steps counted). Then the same requests, minus the stopped ones, through a manager on the eager path
(BATCH_MANAGER_FUSED_DECODE=0). Checked: every request got exactly one final response and no error,
nothing after it, the pool is whole, the fused step ran, calls of several steps ran, and each greedy request's tokens equal the
eager run's (the soak's engine is float32, where the two agree token for token; sampled requests
are counted, not compared: a draw that falls on a near tie may go either way)."""
from __future__ import annotations

import os
import random
import threading
import time
from collections import deque

import torch

from batch_manager import (DecodingConfig, GptManager, InferenceRequest, KvCacheConfig, SchedulerPolicy,
                           TrtGptModelOptionalParams)
from batch_manager import TrtGptModelType, tensor_names as tn
from runtime.kernels.cpu import cpu_decode_step

from .requests import MAX_NEW_TOKENS, MAX_PROMPT_LEN, VOCAB_SIZE

STOP_RATE = 0.05      # per request: stopped after its first streamed response
SAMPLED_RATE = 0.3
DRAIN_TIMEOUT_S = 120.0
MAX_DECODE_STEPS = 4


class _Client:
    """The four callbacks over a queue, recording every response (nothing raises here: the round is
    about the fused step, the other rounds inject faults)."""

    def __init__(self, requests: list[InferenceRequest], stop_ids: set[int]):
        self.lock = threading.Lock()
        self.queue = deque(requests)
        self.stop_after_first = set(stop_ids)
        self.to_stop: set[int] = set()
        self.tokens: dict[int, list[int]] = {r.request_id: [] for r in requests}
        self.finals: dict[int, int] = {}           # request id -> final responses received
        self.errors: dict[int, str] = {}
        self.after_final: list[int] = []           # ids answered again after their final response

    def get(self, max_num_requests: int) -> list[InferenceRequest]:
        with self.lock:
            return [self.queue.popleft() for _ in range(min(max_num_requests, len(self.queue)))]

    def send(self, request_id, tensors, is_final: bool, err_msg: str) -> None:
        with self.lock:
            if request_id in self.finals:
                self.after_final.append(request_id)
            if err_msg:
                self.errors[request_id] = err_msg
            else:
                out = {t.name: t.tensor for t in tensors}
                self.tokens[request_id] += out[tn.OUTPUT_IDS][0, 0, :int(out[tn.SEQUENCE_LENGTH][0, 0])].tolist()
                if request_id in self.stop_after_first:
                    self.stop_after_first.discard(request_id)
                    self.to_stop.add(request_id)
            if is_final:
                self.finals[request_id] = self.finals.get(request_id, 0) + 1

    def poll_stop(self) -> set[int]:
        with self.lock:
            ids, self.to_stop = self.to_stop, set()
            return ids

    @staticmethod
    def report_stats(stats_json: str) -> None:
        pass

    @property
    def is_done(self) -> bool:
        with self.lock:
            return len(self.finals) == len(self.tokens)


class _CountingStep:
    """The runner's fused step, counting its calls and the rows of each."""

    def __init__(self, step):
        self.step, self.max_rows, self.rows = step, step.max_rows, []

    def __call__(self, *args):
        self.rows.append(len(args[0]))
        return self.step(*args)


def _requests(rng: random.Random, num_requests: int) -> tuple[list[InferenceRequest], dict[int, str], set[int]]:
    """-> (requests, request id -> "greedy" | "sampled", ids to stop after their first response)."""
    requests, kinds, stops = [], {}, set()
    for request_id in range(1, num_requests + 1):
        prompt = [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randrange(1, MAX_PROMPT_LEN + 1))]
        r = InferenceRequest(request_id)
        r.input_ids = torch.tensor(prompt, dtype=torch.int32)
        r.max_new_tokens = torch.tensor([[rng.randrange(1, MAX_NEW_TOKENS + 1)]], dtype=torch.int32)
        r.is_streaming = rng.random() < 0.5
        if rng.random() < 0.3:   # rows that end early, on their end id
            r.end_id = torch.tensor([rng.randrange(3, VOCAB_SIZE)], dtype=torch.int32)
        kinds[request_id] = "sampled" if rng.random() < SAMPLED_RATE else "greedy"
        if kinds[request_id] == "sampled":
            r.temperature = torch.tensor([rng.uniform(0.5, 1.5)])
            r.random_seed = torch.tensor([rng.randrange(1 << 62)], dtype=torch.int64)
            r.runtime_top_k = torch.tensor([rng.randrange(0, 40)], dtype=torch.int32)
        if r.is_streaming and rng.random() < STOP_RATE:
            stops.add(request_id)
        requests.append(r)
    return requests, kinds, stops


def _serve(engine_dir: str, pool_tokens: int, requests: list[InferenceRequest], stops: set[int],
           fused: bool) -> tuple[_Client, dict]:
    """One manager over `requests` (the eager one built with the switch off) -> (its client, facts)."""
    client = _Client(requests, stops)
    params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=pool_tokens),
                                       decoding_config=DecodingConfig(max_decode_steps=MAX_DECODE_STEPS if fused else 1))
    saved = os.environ.get(cpu_decode_step.ENV_VAR)
    os.environ[cpu_decode_step.ENV_VAR] = "1" if fused else "0"   # read once, as the runner is built
    try:
        manager = GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.MAX_UTILIZATION,
                             client.get, client.send, client.poll_stop, client.report_stats, params,
                             exclude_input_in_output=True)
    finally:
        if saved is None:
            os.environ.pop(cpu_decode_step.ENV_VAR, None)
        else:
            os.environ[cpu_decode_step.ENV_VAR] = saved
    runner = manager.model_executor.runner
    counter = None
    if runner.decode_step is not None:
        counter = runner.decode_step = _CountingStep(runner.decode_step)
    multi_step_calls = []   # steps of each call that ran several
    decode_greedy = runner.decode_greedy

    def counting_decode_greedy(*args, **kwargs):
        steps = decode_greedy(*args, **kwargs)
        multi_step_calls.append(steps.tokens.shape[1])
        return steps
    runner.decode_greedy = counting_decode_greedy
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while not client.is_done and time.monotonic() < deadline and manager.is_running:
        time.sleep(0.005)
    manager.shutdown()
    kv = manager.kv_cache_manager
    facts = dict(has_fused_step=counter is not None, fused_calls=len(counter.rows) if counter else 0,
                 fused_rows=sorted(set(counter.rows)) if counter else [],
                 leaked_blocks=kv.num_blocks - kv.num_free_blocks, worker_died=manager.fatal_error is not None,
                 multi_step_calls=len(multi_step_calls), multi_steps=sum(multi_step_calls))
    return client, facts


def run_fused_step_round(engine_dir: str, pool_tokens: int, num_requests: int, seed: int) -> dict:
    rng = random.Random(seed)
    requests, kinds, stops = _requests(rng, num_requests)
    served, fused = _serve(engine_dir, pool_tokens, requests, stops, fused=True)
    kept = [r for r in _requests(random.Random(seed), num_requests)[0] if r.request_id not in stops]
    reference, eager = _serve(engine_dir, pool_tokens, kept, set(), fused=False)
    greedy = [i for i, kind in kinds.items() if kind == "greedy" and i not in stops]
    sampled = [i for i, kind in kinds.items() if kind == "sampled" and i not in stops]
    return dict(
        submitted=num_requests, answered=len(served.finals), stopped=len(stops),
        multiple_finals=sorted(i for i, n in served.finals.items() if n != 1),
        unanswered=sorted(set(served.tokens) - set(served.finals)), after_final=served.after_final,
        errors=dict(list(served.errors.items())[:10]), eager_errors=dict(list(reference.errors.items())[:10]),
        has_fused_step=fused["has_fused_step"], fused_calls=fused["fused_calls"], fused_rows=fused["fused_rows"],
        eager_fused_calls=eager["fused_calls"], multi_step_calls=fused["multi_step_calls"],
        multi_steps=fused["multi_steps"], eager_multi_step_calls=eager["multi_step_calls"], leaked_blocks=fused["leaked_blocks"] + eager["leaked_blocks"],
        worker_died=fused["worker_died"] or eager["worker_died"], greedy_compared=len(greedy),
        greedy_mismatches=[dict(request_id=i, fused=served.tokens[i], eager=reference.tokens[i])
                           for i in greedy if served.tokens[i] != reference.tokens[i]][:10],
        sampled_served=len(sampled), sampled_equal=sum(served.tokens[i] == reference.tokens[i] for i in sampled))


def fused_step_violations(report: dict) -> list[str]:
    r, found = report, []
    for key in ("multiple_finals", "unanswered", "after_final", "errors", "eager_errors", "greedy_mismatches"):
        if r[key]:
            found.append(f"{key}: {r[key]}"[:2000])
    if r["answered"] != r["submitted"]:
        found.append(f"{r['submitted']} submitted, {r['answered']} answered")
    if r["leaked_blocks"]:
        found.append(f"{r['leaked_blocks']} KV blocks not returned")
    if r["worker_died"]:
        found.append("a worker died")
    if r["has_fused_step"] and (r["fused_calls"] == 0 or len(r["fused_rows"]) < 2):
        found.append(f"the fused step ran {r['fused_calls']} times over row counts {r['fused_rows']}")
    if r["has_fused_step"] and r["multi_step_calls"] == 0:
        found.append("no call ran several generation steps (DecodingConfig.max_decode_steps)")
    if r["eager_multi_step_calls"]:
        found.append(f"the eager reference ran {r['eager_multi_step_calls']} calls of several steps")
    if r["eager_fused_calls"]:
        found.append(f"the eager reference ran the fused step {r['eager_fused_calls']} times")
    return found
