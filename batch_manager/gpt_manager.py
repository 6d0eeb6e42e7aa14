"""GptManager: the legacy callback batch manager. A thin facade over `Worker`, which owns all
mutable state on its own thread (the facade holds no state the worker needs, so an unreferenced
manager can be collected and shut down)."""
from __future__ import annotations

import logging
import os
import threading
import weakref
from concurrent.futures import Future
from typing import Callable

import torch

from runtime import Engine, ModelRunner
from runtime.kv_cache_manager import KvCacheManager

from .callbacks import UserCallbacks
from .capacity_scheduler import make_capacity_scheduler
from .kv_sizing import num_kv_blocks
from .micro_batch_scheduler import MicroBatchScheduler
from .model_executor import ModelExecutor
from .options import KvCacheConfig, SchedulerConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType
from .scheduler import Scheduler
from .validation import AdmissionLimits
from .worker import Worker, WorkerConfig

logger = logging.getLogger(__name__)

_live_workers: "weakref.WeakSet[Worker]" = weakref.WeakSet()


def _shutdown_live_workers() -> None:
    for worker in list(_live_workers):
        worker.shutdown()


# Runs before the interpreter joins non-daemon threads, so a forgotten manager cannot hang exit.
if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_shutdown_live_workers)


class GptManager:
    def __init__(self, engine_dir: str | os.PathLike, model_type: TrtGptModelType, max_beam_width: int,
                 scheduler_policy: SchedulerPolicy | SchedulerConfig,
                 get_inference_requests_cb: Callable, send_response_cb: Callable,
                 poll_stop_signal_cb: Callable | None = None,
                 return_batch_manager_stats_cb: Callable | None = None,
                 optional_params: TrtGptModelOptionalParams | None = None,
                 terminate_req_id: int | None = None, exclude_input_in_output: bool = False):
        if not callable(get_inference_requests_cb) or not callable(send_response_cb):
            raise ValueError("get_inference_requests_cb and send_response_cb must be callables")
        for name, cb in (("poll_stop_signal_cb", poll_stop_signal_cb),
                         ("return_batch_manager_stats_cb", return_batch_manager_stats_cb)):
            if cb is not None and not callable(cb):
                raise ValueError(f"{name}: must be callable or None, got {type(cb).__name__}")
        model_type = TrtGptModelType(model_type)
        params = optional_params if optional_params is not None else TrtGptModelOptionalParams()
        policy = scheduler_policy.capacity_scheduler_policy if isinstance(scheduler_policy, SchedulerConfig) \
            else SchedulerPolicy(scheduler_policy)
        if not isinstance(max_beam_width, int) or max_beam_width < 1:
            raise ValueError(f"max_beam_width: must be an integer >= 1, got {max_beam_width!r}")

        ready: Future = Future()

        def build_and_run() -> None:
            # NOTE: the model is built on the thread that then runs it, so the caller's thread runs
            # no parallel torch work for us. On CPU a second thread that has run torch's OpenMP
            # regions keeps its thread pool alive; libgomp then counts more threads than cores and
            # stops spinning between parallel regions: generation steps measured 1.7x slower (2
            # cores, default model, batch 34) when the caller had built the model.
            try:
                worker = _build_worker(engine_dir, model_type, max_beam_width, policy, params,
                                       terminate_req_id, exclude_input_in_output, get_inference_requests_cb,
                                       send_response_cb, poll_stop_signal_cb, return_batch_manager_stats_cb)
            except BaseException as e:  # noqa: BLE001 - raised again by the constructor
                ready.set_exception(e)
                return
            built.append(worker)
            ready.set_result(worker)
            if not abandoned.is_set():
                worker.run()

        abandoned, built = threading.Event(), []
        threading.Thread(target=build_and_run, name="GptManagerWorker").start()
        try:
            self._worker = ready.result()
        except BaseException:
            # The build failed, or the caller was interrupted (Ctrl-C) while it ran: a worker
            # built after all must not keep the process alive.
            abandoned.set()
            for worker in built:
                worker.shutdown()
            raise
        _live_workers.add(self._worker)

    def shutdown(self) -> None:
        """Stop fetching, finish the requests in flight, join the worker. Idempotent."""
        self._worker.shutdown()

    def wait_until_terminate(self) -> None:
        """Join the worker without asking it to stop (it stops on terminate_req_id or shutdown)."""
        self._worker.join()

    def get_num_active_requests(self) -> int:
        return self._worker.num_active_requests

    @property
    def is_running(self) -> bool:
        """False after shutdown, termination, or a fatal internal error (see `fatal_error`)."""
        return self._worker.is_running

    @property
    def fatal_error(self) -> str | None:
        """The message of the internal error that stopped the worker's loop, else None. Requests
        arriving after it are answered with this error."""
        return self._worker.fatal_error

    def __enter__(self) -> "GptManager":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        worker = getattr(self, "_worker", None)
        if worker is not None:
            worker.shutdown()


def _build_worker(engine_dir, model_type: TrtGptModelType, max_beam_width: int, policy: SchedulerPolicy,
                  params: TrtGptModelOptionalParams, terminate_req_id: int | None,
                  exclude_input_in_output: bool, get_inference_requests_cb: Callable,
                  send_response_cb: Callable, poll_stop_signal_cb: Callable | None,
                  return_batch_manager_stats_cb: Callable | None) -> Worker:
    """Everything that touches the engine; runs on the worker thread (see GptManager.__init__).
    Takes no reference to the manager, so that an unreferenced manager is still collected."""
    kv_config = params.kv_cache_config
    _check_kv_cache_config(kv_config)
    engine = Engine.from_dir(engine_dir)
    build = engine.build_config
    max_batch_size = _positive("max_batch_size", params.max_batch_size, build.max_batch_size)
    max_num_tokens = _positive("max_num_tokens", params.max_num_tokens, build.max_num_tokens)
    max_num_sequences = _positive("max_num_sequences", params.max_num_sequences, max_batch_size)
    device = torch.device(params.device or ("cuda" if params.device_ids else "cpu"))
    num_blocks = num_kv_blocks(engine, kv_config, max_num_sequences, device)
    runner = ModelRunner(engine, num_blocks, kernels=params.kernel_backend, device=device,
                         max_attention_window=kv_config.max_attention_window,
                         sink_token_length=kv_config.sink_token_length)
    # The block manager releases what the runner's window (the model's own included) hides.
    kv = KvCacheManager(num_blocks, build.tokens_per_block, enable_block_reuse=bool(kv_config.enable_block_reuse),
                        attention_window=runner.attention_window, sink_token_length=runner.sink_token_length)
    enable_chunked_context, enable_trt_overlap = bool(params.enable_chunked_context), bool(params.enable_trt_overlap)
    if model_type == TrtGptModelType.V1 and (enable_chunked_context or enable_trt_overlap):
        logger.warning("enable_chunked_context and enable_trt_overlap have no effect with TrtGptModelType.V1 "
                       "(static lockstep batches)")
        enable_chunked_context = enable_trt_overlap = False
    if model_type == TrtGptModelType.V1:  # static lockstep batches, whatever the policy
        capacity = make_capacity_scheduler(SchedulerPolicy.STATIC_BATCH, kv, max_batch_size, max_num_tokens)
    else:
        capacity = make_capacity_scheduler(policy, kv, max_num_sequences)
    limits = AdmissionLimits(
        vocab_size=engine.model_config.vocab_size, max_input_len=build.max_input_len,
        max_seq_len=build.max_seq_len, max_beam_width=max_beam_width, max_num_blocks=num_blocks,
        tokens_per_block=build.tokens_per_block, gather_context_logits=build.gather_context_logits,
        gather_generation_logits=build.gather_generation_logits)
    config = WorkerConfig(model_type=model_type, max_num_sequences=max_num_sequences,
                          terminate_req_id=terminate_req_id, exclude_input_in_output=exclude_input_in_output,
                          limits=limits, enable_trt_overlap=enable_trt_overlap,
                          normalize_log_probs=bool(params.normalize_log_probs))
    scheduler = Scheduler(kv, capacity, MicroBatchScheduler(max_batch_size, max_num_tokens, enable_chunked_context),
                          separate_context_forward=model_type != TrtGptModelType.InflightFusedBatching)
    executor = ModelExecutor(runner, params.logits_post_processor_batched)
    callbacks = UserCallbacks(get_inference_requests_cb, send_response_cb, poll_stop_signal_cb,
                              return_batch_manager_stats_cb)
    return Worker(config, scheduler, executor, callbacks)


def _check_kv_cache_config(kv: KvCacheConfig) -> None:
    for name, low in (("max_attention_window", 1), ("sink_token_length", 0)):
        value = getattr(kv, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            raise ValueError(f"KvCacheConfig.{name}: must be an integer >= {low} or None, got {value!r}")


def _positive(name: str, value, default: int) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"TrtGptModelOptionalParams.{name}: must be a positive integer, got {value!r}")
    return value
