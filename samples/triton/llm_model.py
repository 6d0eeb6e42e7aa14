"""The `tensorrt_llm` model: one GptManager per model instance, driven only through its four
callbacks. `execute` (Triton's thread) queues requests and stop signals in the request book; the
callbacks (the manager's worker thread) hand them over, answer through each request's decoupled
response sender, return the stop signals and turn the stats into metrics. A watcher thread turns
client cancellations and the launcher's drain into stops. Every request gets exactly one final
response: its own, or an empty one (stopped before it started) or an error."""
from __future__ import annotations

import logging
import os
import threading

import numpy as np

from batch_manager import (GptManager, KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType)
from samples.triton.llm_requests import BadRequest, input_names, make_request, parse_inputs
from samples.triton.request_book import NOT_STARTED, LiveRequest, RequestBook
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


class LlmModel:
    def __init__(self, pb_utils, model_config: dict, model_name: str, model_version: str):
        self.pb_utils = pb_utils
        parameters = read_parameters(model_config)
        model_type = MODEL_TYPES[parameters.get("gpt_model_type", "inflight_fused_batching").lower()]
        self._cancel_check_period_s = int(parameters.get("cancellation_check_period_ms", "100")) / 1e3
        self._drain_file = parameters.get("drain_file")   # once it exists: stop what runs, refuse new work
        self._drained_file = parameters.get("drained_file")   # written once the drain answered everyone
        self._book = RequestBook()
        self._exclude_input = _bool(parameters, "exclude_input_in_output")
        self._is_busy = False   # the worker's view: a request was live at its last get-requests call
        self._output_names = [o["name"] for o in model_config["output"]]
        self._is_closing = threading.Event()
        # held by the watcher while it asks requests, and by whoever sends a final response
        self._finalize_lock = threading.Lock()
        self.metrics = StatsMetrics(pb_utils, model_name, model_version, model_type == TrtGptModelType.V1)
        self.manager = GptManager(parameters["gpt_model_path"], model_type, int(parameters.get("max_beam_width", "1")),
                                  POLICIES[parameters.get("batch_scheduler_policy", "guaranteed_no_evict").lower()],
                                  self._get_requests, self._send_response, self._poll_stop_signals,
                                  self.metrics.update, manager_options(parameters),
                                  exclude_input_in_output=self._exclude_input)
        # NOTE: a cancellation check is a round trip to the server process: done on a thread of its
        # own, never on the GptManager's worker (it would cost every step one round trip per request).
        self._cancel_watcher = threading.Thread(target=self._watch_cancellations, name="cancellations", daemon=True)
        self._cancel_watcher.start()

    # Triton's thread

    def execute(self, requests) -> None:
        self._drain_if_asked()
        for request in requests:
            triton_id = _triton_id(request)
            sender = request.get_response_sender()
            try:
                self._accept(request, sender, triton_id)
            except BadRequest as e:
                self._send_error(sender, triton_id, str(e))
            except Exception as e:  # noqa: BLE001 - any request gets an answer that carries its id
                logger.exception("accepting request %.80r failed", triton_id)
                self._send_error(sender, triton_id, f"internal error: {e!r}")

    def _accept(self, request, sender, triton_id: str) -> None:
        arrays = {}
        for name in input_names():
            tensor = self.pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                arrays[name] = tensor.as_numpy()
        parsed = parse_inputs(arrays)
        if parsed.is_stop:
            unstarted = self._book.stop(triton_id)
            if unstarted is not None:   # it never reached the GptManager: it ends here, with no tokens
                self._finish_unstarted([unstarted], None)
            self._send_final(sender, None)
            return
        input_ids = parsed.tensors.get("input_ids")
        num_echoed = 0 if self._exclude_input or input_ids is None else input_ids.shape[-1]
        self._book.accept(LiveRequest(triton_id, request, sender, num_echoed),
                          lambda request_id: make_request(request_id, parsed))

    def finalize(self) -> None:
        """Unloading: requests in flight stop at once with what they have (a final response each),
        requests not yet handed over get an error; then the GptManager shuts down."""
        self._is_closing.set()
        self._cancel_watcher.join()
        self._finish_unstarted(self._book.drain(), "the model is unloading")
        self.manager.shutdown()

    # any thread

    def _drain_if_asked(self) -> None:
        """Once the drain file exists: nothing more is handed over, the waiting requests get an
        error, the handed ones stop (every poll returns them until their final response)."""
        if self._drain_file and not self._book.is_draining and os.path.exists(self._drain_file):
            logger.info("drain file found: stopping %d live requests, refusing new ones", self._book.num_live)
            self._finish_unstarted(self._book.drain(), NOT_STARTED)

    def _finish_unstarted(self, unstarted: list[LiveRequest], error: str | None) -> None:
        """Final responses of requests that left the book before the GptManager had them: the
        error, or (stopped or cancelled) an empty final response."""
        with self._finalize_lock:
            for live in unstarted:
                if error is None:
                    self._send_final(live.sender, None)
                else:
                    self._send_error(live.sender, live.triton_id, error)

    def _watch_cancellations(self) -> None:
        """Each period: the drain file (and once it answered every request, the drained file),
        then the live requests whose client cancelled."""
        has_drained = False
        while not self._is_closing.wait(self._cancel_check_period_s):
            self._drain_if_asked()
            if self._book.is_draining and not has_drained and not self._book.num_live:
                has_drained = True
                _tell_drained(self._drained_file)
            with self._finalize_lock:   # never ask a request whose final response went out: it is freed
                cancelled = [(request_id, live) for request_id, live in self._book.live_items()
                             if live.request.is_cancelled()]
            if cancelled:
                self._finish_unstarted(self._book.cancel(cancelled), None)

    # the GptManager's worker thread

    def _get_requests(self, max_num_requests: int) -> list:
        if self._book.has_waiting:   # a stat only when something would start: none starts after the drain
            self._drain_if_asked()
        requests = self._book.take(max_num_requests)
        is_idle = not self._book.num_live
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
        live = self._book.handed(request_id, is_final)
        if live is None:
            return
        if err_msg:
            self._send_error(live.sender, live.triton_id, err_msg)
            return
        if is_final and self._book.is_draining and not live.has_streamed and _num_generated(tensors, live) == 0:
            # handed over but still waiting in the GptManager (for KV blocks) when the drain stopped it
            self._send_error(live.sender, live.triton_id, NOT_STARTED)
            return
        outputs = [self.pb_utils.Tensor(t.name, np.ascontiguousarray(t.tensor.numpy()))
                   for t in tensors if t.name in self._output_names]
        response = self.pb_utils.InferenceResponse(output_tensors=outputs)
        if is_final:
            self._send_final(live.sender, response)
        else:
            live.sender.send(response)
            live.has_streamed = True

    def _send_error(self, sender, triton_id: str, message: str) -> None:
        """A final error response, its message led by the request id as Triton's own errors are
        (a streaming client's error callback gets only the message)."""
        error = self.pb_utils.TritonError(f"[request id: {triton_id or '<id_unknown>'}] {message}")
        self._send_final(sender, self.pb_utils.InferenceResponse(error=error))

    def _send_final(self, sender, response) -> None:
        """The request's last send: its sender is spent after it, whether or not it arrives."""
        final = self.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            if response is None:
                sender.send(flags=final)
            else:
                sender.send(response, flags=final)
        except Exception:  # noqa: BLE001 - a client gone; the worker and the other requests go on
            logger.warning("a final response could not be sent", exc_info=True)

    def _poll_stop_signals(self) -> set[int]:
        return self._book.stop_ids()


def _num_generated(tensors, live: LiveRequest) -> int:
    """Tokens a final response says were generated (the longest beam), 0 without sequence_length."""
    lengths = [t.tensor for t in tensors if t.name == "sequence_length"]
    return int(lengths[0].max()) - live.num_echoed_tokens if lengths and lengths[0].numel() else 0


def _triton_id(request) -> str:
    try:
        return request.request_id()
    except Exception:  # noqa: BLE001 - an id the stub cannot decode: answered as an unknown id
        logger.warning("a request id could not be read", exc_info=True)
        return ""


def _tell_drained(path: str | None) -> None:
    """The launcher's sign that nothing is left to answer: from now on Triton's exit may be cut short."""
    logger.info("drained: every request has its final response")
    if path:
        with open(path, "w"):
            pass
