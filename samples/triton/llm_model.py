"""The `tensorrt_llm` model: one GptManager per model instance, driven only through its four
callbacks. `execute` (Triton's thread) queues requests and stop signals; the callbacks (the
manager's worker thread) hand them over, answer through each request's decoupled response
sender, turn client cancellations into stop signals and the stats into metrics."""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading

import numpy as np

from batch_manager import (GptManager, KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType)
from samples.triton.llm_requests import BadRequest, RequestIds, input_names, make_request, parse_inputs
from samples.triton.stats_metrics import StatsMetrics

logger = logging.getLogger(__name__)

MODEL_TYPES = {"v1": TrtGptModelType.V1, "inflight_batching": TrtGptModelType.InflightBatching,
               "inflight_fused_batching": TrtGptModelType.InflightFusedBatching}
POLICIES = {"max_utilization": SchedulerPolicy.MAX_UTILIZATION,
            "guaranteed_no_evict": SchedulerPolicy.GUARANTEED_NO_EVICT,
            "static_batch": SchedulerPolicy.STATIC_BATCH}


def read_parameters(model_config: dict) -> dict[str, str]:
    """parameters -> their string values, leaving out unfilled `${...}` templates and empty ones."""
    values = {key: entry.get("string_value", "") for key, entry in model_config.get("parameters", {}).items()}
    return {key: value for key, value in values.items() if value and not value.startswith("${")}


def _bool(parameters: dict[str, str], key: str, default: bool = False) -> bool:
    return parameters.get(key, str(default)).strip().lower() in ("true", "1", "yes")


def _int(parameters: dict[str, str], key: str) -> int | None:
    return int(parameters[key]) if key in parameters else None


def manager_options(parameters: dict[str, str]) -> TrtGptModelOptionalParams:
    fraction = parameters.get("kv_cache_free_gpu_mem_fraction")
    kv_cache = KvCacheConfig(max_tokens=_int(parameters, "max_tokens_in_paged_kv_cache"),
                             max_attention_window=_int(parameters, "max_attention_window_size"),
                             free_gpu_memory_fraction=float(fraction) if fraction else None,
                             enable_block_reuse=_bool(parameters, "enable_kv_cache_reuse"))
    return TrtGptModelOptionalParams(kv_cache_config=kv_cache, enable_trt_overlap=_bool(parameters, "enable_trt_overlap"),
                                     normalize_log_probs=_bool(parameters, "normalize_log_probs", True),
                                     enable_chunked_context=_bool(parameters, "enable_chunked_context"))


@dataclasses.dataclass
class LiveRequest:
    triton_id: str
    request: object   # the Triton request: its cancellation flag
    sender: object    # its decoupled response sender


class LlmModel:
    def __init__(self, pb_utils, model_config: dict, model_name: str, model_version: str):
        self.pb_utils = pb_utils
        parameters = read_parameters(model_config)
        model_type = MODEL_TYPES[parameters.get("gpt_model_type", "inflight_fused_batching").lower()]
        self._cancel_check_period_s = int(parameters.get("cancellation_check_period_ms", "100")) / 1e3
        self._drain_file = parameters.get("drain_file")   # once it exists: stop what runs, refuse new work
        self._is_draining = False
        self._lock = threading.Lock()   # guards the three below: execute and the worker share them
        self._incoming = collections.deque()
        self._id_to_live: dict[int, LiveRequest] = {}
        self._stop_ids: set[int] = set()
        self._ids = RequestIds()
        self._is_busy = False   # the worker's view: a request was live at its last get-requests call
        self._output_names = [o["name"] for o in model_config["output"]]
        self._is_closing = threading.Event()
        # held by the watcher while it asks requests, and by the worker while it sends a final response
        self._finalize_lock = threading.Lock()
        self.metrics = StatsMetrics(pb_utils, model_name, model_version, model_type == TrtGptModelType.V1)
        self.manager = GptManager(parameters["gpt_model_path"], model_type, int(parameters.get("max_beam_width", "1")),
                                  POLICIES[parameters.get("batch_scheduler_policy", "guaranteed_no_evict").lower()],
                                  self._get_requests, self._send_response, self._poll_stop_signals,
                                  self.metrics.update, manager_options(parameters),
                                  exclude_input_in_output=_bool(parameters, "exclude_input_in_output"))
        # NOTE: a cancellation check is a round trip to the server process: done on a thread of its
        # own, never on the GptManager's worker (it would cost every step one round trip per request).
        self._cancel_watcher = threading.Thread(target=self._watch_cancellations, name="cancellations", daemon=True)
        self._cancel_watcher.start()

    # Triton's thread

    def execute(self, requests) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._accept(request, sender)
            except BadRequest as e:
                self._send_error(sender, request.request_id(), str(e))

    def _accept(self, request, sender) -> None:
        arrays = {}
        for name in input_names():
            tensor = self.pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                arrays[name] = tensor.as_numpy()
        parsed = parse_inputs(arrays)
        triton_id = request.request_id()
        with self._lock:
            live_id = self._ids.lookup(triton_id) if triton_id else None
            is_live = live_id is not None and live_id in self._id_to_live
            if parsed.is_stop:
                if is_live:
                    self._stop_ids.add(live_id)
                self._send_final(sender, None)
                return
            if is_live:
                raise BadRequest(f"request id {triton_id!r} is already in use by a live request")
            if self._is_draining:
                raise BadRequest("the server is shutting down")
            request_id = self._ids.assign(triton_id)
            self._id_to_live[request_id] = LiveRequest(triton_id, request, sender)
            self._incoming.append(make_request(request_id, parsed))

    def finalize(self) -> None:
        """Unloading: requests in flight stop at once with what they have (a final response each),
        requests not yet handed over get an error; then the GptManager shuts down."""
        self._is_closing.set()
        self._cancel_watcher.join()
        with self._lock:
            pending = [self._id_to_live.pop(r.request_id) for r in self._incoming]
            self._incoming.clear()
            self._stop_ids.update(self._id_to_live)
        for live in pending:
            self._send_error(live.sender, live.triton_id, "the model is unloading")
        self.manager.shutdown()

    def _watch_cancellations(self) -> None:
        """Each period, the live requests whose client cancelled become stop signals; once the
        drain file exists (the launcher's shutdown), every live request does."""
        while not self._is_closing.wait(self._cancel_check_period_s):
            if self._drain_file and not self._is_draining and os.path.exists(self._drain_file):
                with self._lock:
                    self._is_draining = True
                    self._stop_ids.update(self._id_to_live)
            with self._finalize_lock:   # never ask a request whose final response went out: it is freed
                with self._lock:
                    live = list(self._id_to_live.items())
                cancelled_ids = {request_id for request_id, entry in live if entry.request.is_cancelled()}
            if cancelled_ids:
                with self._lock:
                    self._stop_ids.update(cancelled_ids & self._id_to_live.keys())

    # the GptManager's worker thread

    def _get_requests(self, max_num_requests: int) -> list:
        with self._lock:
            requests = [self._incoming.popleft() for _ in range(min(max_num_requests, len(self._incoming)))]
            is_idle = not self._id_to_live
        if is_idle and self._is_busy:   # called each iteration, also idle ones: the metrics follow
            self.metrics.mark_idle()
        self._is_busy = not is_idle
        return requests

    def _send_response(self, request_id: int, tensors, is_final: bool, err_msg: str) -> None:
        if is_final:
            with self._finalize_lock:
                self._respond(request_id, tensors, is_final, err_msg)
        else:
            self._respond(request_id, tensors, is_final, err_msg)

    def _respond(self, request_id: int, tensors, is_final: bool, err_msg: str) -> None:
        with self._lock:
            live = self._id_to_live.pop(request_id, None) if is_final else self._id_to_live.get(request_id)
            if live is not None and is_final:
                self._ids.release(live.triton_id)
                self._stop_ids.discard(request_id)
        if live is None:
            return
        if err_msg:
            self._send_error(live.sender, live.triton_id, err_msg)
            return
        outputs = [self.pb_utils.Tensor(t.name, np.ascontiguousarray(t.tensor.numpy()))
                   for t in tensors if t.name in self._output_names]
        response = self.pb_utils.InferenceResponse(output_tensors=outputs)
        if is_final:
            self._send_final(live.sender, response)
        else:
            live.sender.send(response)

    def _send_error(self, sender, triton_id: str, message: str) -> None:
        """A final error response, its message led by the request id as Triton's own errors are
        (a streaming client's error callback gets only the message)."""
        error = self.pb_utils.TritonError(f"[request id: {triton_id or '<id_unknown>'}] {message}")
        self._send_final(sender, self.pb_utils.InferenceResponse(error=error))

    def _send_final(self, sender, response) -> None:
        final = self.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if response is None:
            sender.send(flags=final)
        else:
            sender.send(response, flags=final)

    def _poll_stop_signals(self) -> set[int]:
        with self._lock:
            stop_ids, self._stop_ids = self._stop_ids, set()
        return stop_ids
