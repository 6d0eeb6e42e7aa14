"""A `tritonclient` gRPC streaming client of the `tensorrt_llm` model: requests by id on one
bidirectional stream, each request's responses gathered (tokens, arrival times, error) until its
final one; when the stream itself breaks, every request still waiting gets that error. Used by the
benchmark, the chaos soak and the tests."""
from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import tritonclient.grpc as grpcclient


@dataclasses.dataclass
class Result:
    tokens: list[int] = dataclasses.field(default_factory=list)
    arrival_s: list[float] = dataclasses.field(default_factory=list)   # perf_counter of each response
    error: str | None = None
    outputs: dict = dataclasses.field(default_factory=dict)            # the last response's arrays by name


def input_tensor(name: str, array: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), grpcclient.np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


def llm_inputs(prompt: list[int], max_new_tokens: int, streaming: bool, end_id: int | None = None,
               **scalars: np.ndarray) -> list[grpcclient.InferInput]:
    """The backend's inputs for one sequence (batch dimension 1); `scalars`: more by name."""
    arrays = {"input_ids": np.array([prompt], np.int32), "input_lengths": np.array([[len(prompt)]], np.int32),
              "request_output_len": np.array([[max_new_tokens]], np.int32),
              "streaming": np.array([[streaming]], bool)}
    if end_id is not None:
        arrays["end_id"] = np.array([[end_id]], np.int32)
    arrays.update(scalars)
    return [input_tensor(name, array) for name, array in arrays.items()]


class StreamClient:
    """One stream to `model`; `submit` then `wait(request_id)`."""

    def __init__(self, url: str, model: str = "tensorrt_llm"):
        self.model = model
        self.client = grpcclient.InferenceServerClient(url)
        self._lock = threading.Lock()
        self._id_to_result: dict[str, Result] = {}
        self._id_to_done: dict[str, threading.Event] = {}
        self.num_finals: dict[str, int] = {}   # request id -> final responses seen (errors included)
        self.unattributed_errors: list[str] = []   # errors that named no request of this stream
        self.client.start_stream(callback=self._on_response)

    def submit(self, request_id: str, inputs: list[grpcclient.InferInput]) -> None:
        with self._lock:
            self._id_to_result[request_id] = Result()
            self._id_to_done[request_id] = threading.Event()
            self.num_finals[request_id] = 0
        self.client.async_stream_infer(self.model, inputs, request_id=request_id, enable_empty_final_response=True)

    def send_stop(self, request_id: str) -> None:
        """The backend's stop: a request with the live request's id and `stop` set (its own empty
        final answer is not asked for, so the live request's final response is the one seen)."""
        inputs = llm_inputs([0], 1, False, stop=np.array([[True]], bool))
        self.client.async_stream_infer(self.model, inputs, request_id=request_id)

    def _on_response(self, result, error) -> None:
        now_s = time.perf_counter()
        if error is not None:
            self._on_error(error)
            return
        response = result.get_response()
        request_id = response.id
        with self._lock:
            entry, done = self._id_to_result.get(request_id), self._id_to_done.get(request_id)
        if entry is None:
            return
        output_ids = result.as_numpy("output_ids")
        if output_ids is not None and output_ids.size and not done.is_set():
            lengths = result.as_numpy("sequence_length")
            entry.tokens.extend(output_ids[0, 0, :lengths[0, 0]].tolist())
            entry.arrival_s.append(now_s)
            entry.outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
        if response.parameters["triton_final_response"].bool_param:
            self._finish(request_id, None)

    def _on_error(self, error) -> None:
        """A request's error (its id leads the message), or the stream's own (a gRPC status:
        the stream is over, so every request still waiting ends with it)."""
        if error.status() is not None:
            with self._lock:
                waiting = [i for i, done in self._id_to_done.items() if not done.is_set()]
            for request_id in waiting:
                self._finish(request_id, f"the stream broke: {error}")
            return
        request_id = self._error_request_id(str(error))
        if request_id is None:
            self.unattributed_errors.append(str(error))
        else:
            self._finish(request_id, str(error))

    def _finish(self, request_id: str, error: str | None) -> None:
        with self._lock:
            entry, done = self._id_to_result[request_id], self._id_to_done[request_id]
            self.num_finals[request_id] += 1
            if not done.is_set() and error is not None:
                entry.error = error
        done.set()

    def _error_request_id(self, text: str) -> str | None:
        """A stream error carries its request id only in the message: `[request id: 7] ...`; the
        longest id of this stream that fits (an id may hold `]`)."""
        marker = "[request id: "
        if marker not in text:
            return None
        rest = text.split(marker, 1)[1]
        with self._lock:
            fitting = [i for i in self._id_to_result if rest.startswith(i + "]")]
        return max(fitting, key=len) if fitting else None

    def result(self, request_id: str) -> Result:
        """The request's result so far (the stream's thread adds to it until its final response)."""
        return self._id_to_result[request_id]

    def is_done(self, request_id: str) -> bool:
        return self._id_to_done[request_id].is_set()

    def wait(self, request_id: str, timeout_s: float = 120.0) -> Result:
        if not self._id_to_done[request_id].wait(timeout_s):
            raise TimeoutError(f"request {request_id}: no final response after {timeout_s} s")
        return self.result(request_id)

    def close(self, cancel_requests: bool = False) -> None:
        """End the stream: after every request's final response, or at once with the requests
        cancelled (a client that disconnects)."""
        stream = self.client._stream   # tritonclient's _InferStream, None once stopped
        self.client.stop_stream(cancel_requests=cancel_requests)
        if cancel_requests and stream is not None:
            # tritonclient ends the request iterator (a None in its queue) only on a graceful stop.
            # After a cancel, gRPC's thread that feeds the requests to the call stays blocked in that
            # queue for ever when it was waiting for the next request (grpc/grpc#21995): one thread
            # leaked per disconnected stream. The end marker lets it return.
            stream._request_queue.put(None)
        self.client.close()
