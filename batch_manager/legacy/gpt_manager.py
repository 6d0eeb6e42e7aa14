"""GptManager: the legacy callback batch manager. A thin facade over `Worker`, which owns all
mutable state on its own thread (the facade holds no state the worker needs, so an unreferenced
manager can be collected and shut down)."""
from __future__ import annotations

import logging
import os
from typing import Callable

from .callbacks import UserCallbacks
from ..engine_builder import build_engine_core, start_worker
from ..distributed import Follower
from .front_end import CallbackFrontEnd
from ..options import SchedulerConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType
from ..worker import Worker

logger = logging.getLogger(__name__)


class GptManager:
    def __init__(self, engine_dir: str | os.PathLike, model_type: TrtGptModelType, max_beam_width: int,
                 scheduler_policy: SchedulerPolicy | SchedulerConfig,
                 get_inference_requests_cb: Callable | None, send_response_cb: Callable | None,
                 poll_stop_signal_cb: Callable | None = None,
                 return_batch_manager_stats_cb: Callable | None = None,
                 optional_params: TrtGptModelOptionalParams | None = None,
                 terminate_req_id: int | None = None, exclude_input_in_output: bool = False):
        for name, cb in (("get_inference_requests_cb", get_inference_requests_cb),
                         ("send_response_cb", send_response_cb)):
            if cb is not None and not callable(cb):
                raise ValueError(f"{name}: must be callable, got {type(cb).__name__}")
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

        self._worker = start_worker(
            lambda: _build_worker(engine_dir, model_type, max_beam_width, policy, params, terminate_req_id,
                                  exclude_input_in_output, get_inference_requests_cb, send_response_cb,
                                  poll_stop_signal_cb, return_batch_manager_stats_cb),
            "GptManagerWorker")

    def shutdown(self) -> None:
        """Stop fetching, finish the requests in flight, join the worker. Idempotent. On a rank > 0
        of a tensor-parallel world: wait until rank 0 ends the run."""
        self._worker.shutdown()

    def wait_until_terminate(self) -> None:
        """Join the worker without asking it to stop (it stops on terminate_req_id or shutdown)."""
        self._worker.join()

    def get_num_active_requests(self) -> int:
        return self._worker.num_active_requests

    @property
    def worker(self) -> Worker | Follower:
        """The loop that owns the engine's state on its own `thread`: a Worker (its `scheduler`,
        `executor`, `forward_pool`), or a Follower on a rank > 0 (its `num_forwards`). For tests
        and benchmarks that watch or patch the loop; it changes on the worker thread."""
        return self._worker

    @property
    def kv_cache_manager(self):
        """The KV block manager (runtime.cache.KvCacheManager), for reading: free blocks, reuse,
        `check_invariants()`. Rank 0 only; it changes on the worker thread."""
        return _leader(self._worker).scheduler.kv

    @property
    def model_executor(self):
        """The step executor (batch_manager.model_executor.ModelExecutor): its `runner`, its
        `execute(step)` (the worker calls it once per step) and its `fault_injector` hook, for
        benchmarks and fault-injection tests. Rank 0 only."""
        return _leader(self._worker).executor

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


def _leader(worker):
    if not hasattr(worker, "scheduler"):
        raise RuntimeError("a rank > 0 of a tensor-parallel world has no scheduler or step executor of its own")
    return worker


def _build_worker(engine_dir, model_type: TrtGptModelType, max_beam_width: int, policy: SchedulerPolicy,
                  params: TrtGptModelOptionalParams, terminate_req_id: int | None,
                  exclude_input_in_output: bool, get_inference_requests_cb: Callable | None,
                  send_response_cb: Callable | None, poll_stop_signal_cb: Callable | None,
                  return_batch_manager_stats_cb: Callable | None) -> Worker | Follower:
    """Runs on the worker thread (see engine_builder.start_worker). Takes no reference to the
    manager, so that an unreferenced manager is still collected."""
    core = build_engine_core(engine_dir, model_type, max_beam_width, policy, params)
    if isinstance(core, Follower):   # a rank > 0 of a tensor-parallel world: rank 0 calls the callbacks
        return core
    if get_inference_requests_cb is None or send_response_cb is None:
        raise ValueError("get_inference_requests_cb and send_response_cb must be callables (only ranks > 0 of "
                         "a tensor-parallel world may pass None)")
    callbacks = UserCallbacks(get_inference_requests_cb, send_response_cb, poll_stop_signal_cb,
                              return_batch_manager_stats_cb)
    front_end = CallbackFrontEnd(callbacks, core.limits, terminate_req_id, exclude_input_in_output,
                                 bool(params.normalize_log_probs), model_type == TrtGptModelType.V1)
    return Worker(core.worker_config, core.scheduler, core.executor, front_end, core.kv_events)
