"""Our backend of samples.benchmark: the dataset through a GptManager serving loop, the way the
legacy gptManagerBenchmark drove it (a thread-safe queue behind the get-requests callback,
per-response timing in the send-response callback, the stats callback's JSON kept per iteration)."""
from __future__ import annotations

import json
import os
import queue
import threading
import time

import torch
from tqdm import tqdm

from batch_manager import (DecodingConfig, GptManager, InferenceRequest, KvCacheConfig, SchedulerPolicy,
                           TrtGptModelOptionalParams, TrtGptModelType, tensor_names)
from runtime import WorldConfig
from samples.benchmark.dataset import Sample
from samples.benchmark.report import RequestTiming, RunResult, progress_bar

MODEL_TYPES = {"IFB": TrtGptModelType.InflightFusedBatching, "UIFB": TrtGptModelType.InflightBatching,
               "V1": TrtGptModelType.V1}
WARM_UP_ID_BASE = 1 << 40  # warm-up request ids, apart from the dataset's (0 .. n-1)


class BenchmarkClient:
    """The four callbacks. They run on the manager's worker thread; the feeding thread only puts
    requests on `incoming` and reads results after `done` is set."""

    def __init__(self, progress: tqdm | None = None):
        self.incoming: queue.Queue[InferenceRequest] = queue.Queue()
        self.lock = threading.Lock()
        self.start_s = time.perf_counter()
        self.timings: dict[int, RequestTiming] = {}
        self.token_events: list[tuple[float, int]] = []
        self.iteration_stats: list[dict] = []
        self.outputs: dict[int, list[int]] = {}   # request id -> generated tokens (beam 0)
        self.num_expected = 0
        self.num_final = 0
        self.done = threading.Event()
        self.progress = progress

    def now_s(self) -> float:
        return time.perf_counter() - self.start_s

    def reset(self, num_expected: int, progress: tqdm | None) -> None:
        """Start a new measured phase (after the warm-up)."""
        with self.lock:
            self.start_s = time.perf_counter()
            self.timings, self.token_events, self.iteration_stats, self.outputs = {}, [], [], {}
            self.num_expected, self.num_final, self.progress = num_expected, 0, progress
            self.done.clear()

    def submit(self, request: InferenceRequest) -> None:
        with self.lock:
            self.timings[request.request_id] = RequestTiming(enqueue_s=self.now_s())
        self.incoming.put(request)

    def get_requests(self, max_num_requests: int) -> list[InferenceRequest]:
        batch = []
        while len(batch) < max_num_requests:
            try:
                batch.append(self.incoming.get_nowait())
            except queue.Empty:
                break
        return batch

    def send_response(self, request_id: int, tensors, is_final: bool, err_msg: str) -> None:
        now_s = self.now_s()
        with self.lock:
            timing = self.timings.get(request_id)
            if timing is None:
                return
            if err_msg:
                timing.error = err_msg
            else:
                output = {t.name: t.tensor for t in tensors}
                num_new = int(output[tensor_names.SEQUENCE_LENGTH][0, 0])  # generated only: input excluded
                if num_new:
                    self.outputs.setdefault(request_id, []).extend(output[tensor_names.OUTPUT_IDS][0, 0, :num_new].tolist())
                    if timing.first_token_s is None:
                        timing.first_token_s = now_s
                    timing.num_output_tokens += num_new
                    self.token_events.append((now_s, num_new))
            if is_final:
                timing.end_s = now_s
                self.num_final += 1
                if self.progress is not None:
                    self.progress.update(1)
                if self.num_final >= self.num_expected:
                    self.done.set()

    def poll_stop_signals(self) -> set[int]:
        return set()

    def report_stats(self, stats_json: str) -> None:
        stats = json.loads(stats_json)
        with self.lock:
            stats["time_s"] = self.now_s()
            self.iteration_stats.append(stats)

    def callbacks(self):
        return self.get_requests, self.send_response, self.poll_stop_signals, self.report_stats


def make_request(request_id: int, sample: Sample, streaming: bool, end_id: int | None = None) -> InferenceRequest:
    r = InferenceRequest(request_id)
    if end_id is not None:
        r.end_id = torch.tensor([end_id], dtype=torch.int32)
    r.input_ids = torch.tensor(sample.input_ids, dtype=torch.int32)
    r.max_new_tokens = torch.tensor([[sample.output_len]], dtype=torch.int32)
    r.is_streaming = streaming
    return r


def optional_params(args) -> TrtGptModelOptionalParams:
    kv = KvCacheConfig(max_tokens=args.max_tokens_in_paged_kvcache,
                       free_gpu_memory_fraction=args.kv_cache_free_gpu_mem_fraction)
    return TrtGptModelOptionalParams(kv_cache_config=kv, max_batch_size=args.max_batch_size,
                                     max_num_tokens=args.max_num_tokens, world_config=world_config(args),
                                     decoding_config=DecodingConfig(max_decode_steps=args.max_decode_steps))


def world_config(args) -> WorldConfig | None:
    """--pipeline-parallelism P: the launcher's ranks as P stages (None: the default world)."""
    stages = getattr(args, "pipeline_parallelism", 1)   # (the serving sample has no such flag)
    if stages == 1:
        return None
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size % stages:
        raise SystemExit(f"error: --pipeline-parallelism {stages} does not divide the launcher's {world_size} ranks")
    return WorldConfig(tensor_parallelism=world_size // stages, pipeline_parallelism=stages)


def run_ours(model_dir: str, samples: list[Sample], delays_s: list[float], args, end_id: int | None = None) -> RunResult:
    """Warm up with `args.warm_up` copies of sample 0, then enqueue the samples on schedule and
    wait for every final response. Times count from the first enqueue after the warm-up. With
    `end_id`, requests end there (or at their output_len); the result's `outputs` hold the tokens."""
    client = BenchmarkClient()
    get, send, poll, stats = client.callbacks()
    with GptManager(model_dir, MODEL_TYPES[args.type], 1, SchedulerPolicy[args.scheduler_policy.upper()],
                    get, send, poll, stats, optional_params(args), exclude_input_in_output=True):
        if args.warm_up > 0:
            client.reset(args.warm_up, None)
            for i in range(args.warm_up):
                client.submit(make_request(WARM_UP_ID_BASE + i, samples[0], args.streaming, end_id))
            client.done.wait()
        progress = progress_bar(len(samples), "ours", not args.no_progress)
        client.reset(len(samples), progress)
        next_s = 0.0
        for request_id, (sample, delay_s) in enumerate(zip(samples, delays_s)):
            client.submit(make_request(request_id, sample, args.streaming, end_id))
            next_s += delay_s
            wait_s = next_s - client.now_s()
            if wait_s > 0:
                time.sleep(wait_s)
        client.done.wait()
        progress.close()
        total_s = max(t.end_s for t in client.timings.values())
    timings = [client.timings[i] for i in range(len(samples))]
    return RunResult("ours", timings, total_s, client.token_events, client.iteration_stats, args.streaming,
                     outputs=[client.outputs.get(i, []) for i in range(len(samples))])
