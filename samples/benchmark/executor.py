"""The Executor backend of samples.benchmark (`--api executor`): the same dataset, arrivals and
timings as `bench_ours` (GptManager), through enqueue_request and one consumer thread looping on
await_responses, as the bindings' examples do. Iteration stats are drained from the executor's
ring by the consumer and stamped when drained (within ~10 ms of their iteration)."""
from __future__ import annotations

import json
import threading
import time

from tqdm import tqdm

from batch_manager.executor import (BatchingType, CapacitySchedulerPolicy, DecodingConfig, Executor, ExecutorConfig,
                                    KvCacheConfig, OutputConfig, ParallelConfig, Request, SchedulerConfig)
from samples.benchmark.dataset import Sample
from samples.benchmark.ours import world_config
from samples.benchmark.report import RequestTiming, RunResult, progress_bar

BATCHING_TYPES = {"IFB": BatchingType.INFLIGHT, "V1": BatchingType.STATIC}


def executor_config(args) -> ExecutorConfig:
    if args.type not in BATCHING_TYPES:
        raise ValueError(f"--type: {args.type} has no Executor batching type (IFB or V1)")
    kv = KvCacheConfig(max_tokens=args.max_tokens_in_paged_kvcache,
                       free_gpu_memory_fraction=args.kv_cache_free_gpu_mem_fraction)
    world = world_config(args)
    return ExecutorConfig(
        scheduler_config=SchedulerConfig(CapacitySchedulerPolicy[args.scheduler_policy.upper()]),
        kv_cache_config=kv, batching_type=BATCHING_TYPES[args.type], max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens, iter_stats_max_iterations=100_000,
        decoding_config=DecodingConfig(max_decode_steps=args.max_decode_steps),
        parallel_config=None if world is None else ParallelConfig(
            tensor_parallelism=world.tensor_parallelism, pipeline_parallelism=world.pipeline_parallelism))


def make_request(sample: Sample, streaming: bool) -> Request:
    return Request(list(sample.input_ids), sample.output_len, streaming=streaming,
                   output_config=OutputConfig(exclude_input_from_output=True))


class _Consumer:
    """Awaits every response of `ids` on its own thread, recording times as bench_ours does."""

    def __init__(self, executor: Executor, start_s: float, progress: tqdm | None):
        self.executor, self.start_s, self.progress = executor, start_s, progress
        self.timings: dict[int, RequestTiming] = {}
        self.token_events: list[tuple[float, int]] = []
        self.iteration_stats: list[dict] = []
        self.lock = threading.Lock()
        self.num_expected, self.num_final = 0, 0
        self.done = threading.Event()

    def now_s(self) -> float:
        return time.perf_counter() - self.start_s

    def submit(self, request: Request) -> None:
        with self.lock:   # recorded before the id exists: the first response may come at once
            enqueue_s = self.now_s()
            request_id = self.executor.enqueue_request(request)
            self.timings[request_id] = RequestTiming(enqueue_s=enqueue_s)

    def run(self) -> None:
        while self.num_final < self.num_expected:
            responses = self.executor.await_responses(timeout=0.01)
            now_s = self.now_s()
            with self.lock:
                for response in responses:
                    self._record(response, now_s)
            for stats in self.executor.get_latest_iteration_stats():
                self.iteration_stats.append({**json.loads(stats.to_json_str()), "time_s": now_s})
        self.done.set()

    def _record(self, response, now_s: float) -> None:
        timing = self.timings[response.request_id]
        if response.has_error():
            timing.error, is_final = response.error_msg, True
        else:
            num_new = len(response.result.output_token_ids[0])
            if num_new:
                timing.first_token_s = timing.first_token_s if timing.first_token_s is not None else now_s
                timing.num_output_tokens += num_new
                self.token_events.append((now_s, num_new))
            is_final = response.result.is_final
        if is_final:
            timing.end_s = now_s
            self.num_final += 1
            if self.progress is not None:
                self.progress.update(1)


def _serve(executor: Executor, requests: list[Request], delays_s: list[float], progress) -> _Consumer:
    consumer = _Consumer(executor, time.perf_counter(), progress)
    consumer.num_expected = len(requests)
    thread = threading.Thread(target=consumer.run, name="ExecutorBenchConsumer")
    thread.start()
    next_s = 0.0
    for request, delay_s in zip(requests, delays_s):
        consumer.submit(request)
        next_s += delay_s
        wait_s = next_s - consumer.now_s()
        if wait_s > 0:
            time.sleep(wait_s)
    thread.join()
    return consumer


def run_executor(model_dir: str, samples: list[Sample], delays_s: list[float], args) -> RunResult:
    """Warm up with `args.warm_up` copies of sample 0, then the samples on schedule."""
    with Executor(model_dir, executor_config=executor_config(args)) as executor:
        if args.warm_up > 0:
            _serve(executor, [make_request(samples[0], args.streaming)] * args.warm_up, [0.0] * args.warm_up, None)
            executor.get_latest_iteration_stats()
        with progress_bar(len(samples), "executor", not args.no_progress) as progress:
            consumer = _serve(executor, [make_request(s, args.streaming) for s in samples], delays_s, progress)
    timings = [consumer.timings[i] for i in sorted(consumer.timings)]
    total_s = max(t.end_s for t in timings)
    return RunResult("executor", timings, total_s, consumer.token_events, consumer.iteration_stats, args.streaming)
