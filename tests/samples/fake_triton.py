"""A stand-in for the Python backend's `triton_python_backend_utils` and its requests, enough to run
samples.triton's `tensorrt_llm` model in the test process (no server): responses are recorded per
request, and a send after the final one fails as the backend's does."""
from __future__ import annotations

import threading
import time
import types

import numpy as np

FINAL = 1


class Tensor:
    def __init__(self, name: str, array: np.ndarray):
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class TritonError:
    def __init__(self, message: str):
        self._message = message

    def message(self) -> str:
        return self._message


class InferenceResponse:
    def __init__(self, output_tensors=(), error: TritonError | None = None):
        self.outputs = {t.name(): t.as_numpy() for t in output_tensors}
        self.error = error


class _Metric:
    def __init__(self, labels: dict):
        self.labels, self.value = labels, None

    def set(self, value: float) -> None:
        self.value = value


class MetricFamily:
    GAUGE = 0

    def __init__(self, name: str, description: str, kind: int):
        self.name = name

    def Metric(self, labels: dict) -> _Metric:  # noqa: N802 - the backend's spelling
        return _Metric(labels)


def get_input_tensor_by_name(request, name: str):
    array = request.arrays.get(name)
    return None if array is None else Tensor(name, array)


pb_utils = types.SimpleNamespace(Tensor=Tensor, TritonError=TritonError, InferenceResponse=InferenceResponse,
                                 MetricFamily=MetricFamily, get_input_tensor_by_name=get_input_tensor_by_name,
                                 TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL)


class Sender:
    """Records a request's responses: (output arrays, error message or None, is_final)."""

    def __init__(self):
        self.responses: list[tuple[dict, str | None, bool]] = []
        self.done = threading.Event()
        self.num_sends_after_final = 0

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self.done.is_set():
            self.num_sends_after_final += 1
            raise RuntimeError("Unable to send response. Response sender has been closed.")
        error = response.error.message() if response is not None and response.error is not None else None
        self.responses.append((response.outputs if response is not None else {}, error, flags == FINAL))
        if flags == FINAL:
            self.done.set()

    @property
    def num_finals(self) -> int:
        return sum(is_final for _, _, is_final in self.responses)

    @property
    def error(self) -> str | None:
        return next((error for _, error, _ in self.responses if error is not None), None)

    @property
    def tokens(self) -> list[int]:
        tokens = []
        for outputs, _, _ in self.responses:
            if "output_ids" in outputs:
                tokens.extend(outputs["output_ids"][0, 0, :outputs["sequence_length"][0, 0]].tolist())
        return tokens

    def wait(self, timeout_s: float = 60.0) -> "Sender":
        assert self.done.wait(timeout_s), f"no final response after {timeout_s} s: {self.responses[-3:]}"
        return self


class Request:
    def __init__(self, triton_id: str, arrays: dict[str, np.ndarray]):
        self._triton_id, self.arrays = triton_id, arrays
        self.sender = Sender()
        self.is_cancelled_flag = False

    def request_id(self) -> str:
        return self._triton_id

    def get_response_sender(self) -> Sender:
        return self.sender

    def is_cancelled(self) -> bool:
        assert not self.sender.done.is_set(), "asked after its final response (the request is freed)"
        return self.is_cancelled_flag


def llm_request(triton_id: str, prompt: list[int], max_new_tokens: int, streaming: bool = True,
                stop: bool = False) -> Request:
    arrays = {"input_ids": np.array([prompt], np.int32), "request_output_len": np.array([[max_new_tokens]], np.int32),
              "streaming": np.array([[streaming]], bool)}
    if stop:
        arrays["stop"] = np.array([[True]], bool)
    return Request(triton_id, arrays)


def wait_for(predicate, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.002)
