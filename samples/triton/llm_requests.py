"""Triton requests of the `tensorrt_llm` model as InferenceRequests: the tensors by name (the
backend's wire names, three renamed to the GptManager's), and the Triton request id (a string) as
the GptManager's integer id. Pure functions of numpy arrays; no Triton import."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch

from batch_manager import InferenceRequest, tensor_names
from samples.triton.model_configs import LLM_INPUTS

# backend input -> GptManager tensor, where the names differ
BACKEND_TO_MANAGER = {"runtime_top_p_min": tensor_names.TOP_P_MIN, "runtime_top_p_decay": tensor_names.TOP_P_DECAY,
                      "runtime_top_p_reset_ids": tensor_names.TOP_P_RESET_IDS}
# inputs of the backend read here, not handed to the GptManager
FLAG_INPUTS = ("stop", "streaming")
IGNORED_INPUTS = ("input_lengths",)          # obsolete in the backend too
UNSUPPORTED_INPUTS = ("draft_acceptance_threshold",)   # drafts are accepted on exact match here
FIRST_MAPPED_ID = 1 << 62                    # ids for non-numeric Triton ids start here


class BadRequest(ValueError):
    """A request the model answers with an error (it names the tensor)."""


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    tensors: dict[str, torch.Tensor]   # GptManager wire name -> tensor, the batch dimension kept ([1, ...])
    is_streaming: bool
    is_stop: bool


def parse_inputs(arrays: dict[str, np.ndarray]) -> ParsedRequest:
    """arrays: backend input name -> the request's array, batch dimension first (one sequence)."""
    tensors = {}
    for name, array in arrays.items():
        if array.ndim == 0 or array.shape[0] != 1:
            raise BadRequest(f"{name}: one sequence per request (batch dimension 1), got shape {list(array.shape)}")
        if name in IGNORED_INPUTS or name in FLAG_INPUTS or name in UNSUPPORTED_INPUTS:
            continue
        if name == tensor_names.EARLY_STOPPING:
            array = array.astype(np.int32)
        # a copy: the request's memory is the backend's, released once execute returns
        tensors[BACKEND_TO_MANAGER.get(name, name)] = torch.from_numpy(np.array(array, copy=True))
    return ParsedRequest(tensors, _flag(arrays, "streaming"), _flag(arrays, "stop"))


def _flag(arrays: dict[str, np.ndarray], name: str) -> bool:
    array = arrays.get(name)
    return bool(array is not None and array.size and array.reshape(-1)[0])


def input_names() -> tuple[str, ...]:
    return tuple(spec.name for spec in LLM_INPUTS)


def make_request(request_id: int, parsed: ParsedRequest) -> InferenceRequest:
    request = InferenceRequest(request_id)
    for name, tensor in parsed.tensors.items():
        request.emplace_input_tensor(name, tensor)
    request.is_streaming = parsed.is_streaming
    return request


def spelled_id(triton_id: str) -> int | None:
    """The integer below FIRST_MAPPED_ID that a Triton id spells in plain ASCII decimal digits
    without leading zeros, or None (`²` is a digit to str.isdigit but not to int; `007` would
    share 7's id)."""
    if not (0 < len(triton_id) <= len(str(FIRST_MAPPED_ID)) and triton_id.isascii() and triton_id.isdigit()):
        return None
    if triton_id != "0" and triton_id.startswith("0"):
        return None
    value = int(triton_id)
    return value if value < FIRST_MAPPED_ID else None


class RequestIds:
    """Triton request id (string) -> GptManager id: the integer it spells (`spelled_id`), else one
    handed out (and kept while the request lives); an empty id gets a fresh one each time."""

    def __init__(self):
        self._mapped: dict[str, int] = {}
        self._next_ids = itertools.count(FIRST_MAPPED_ID)

    def lookup(self, triton_id: str) -> int | None:
        """The id a live request with this Triton id has, or None."""
        spelled = spelled_id(triton_id)
        return spelled if spelled is not None else self._mapped.get(triton_id)

    def assign(self, triton_id: str) -> int:
        request_id = self.lookup(triton_id) if triton_id else None
        if request_id is None:
            request_id = next(self._next_ids)
            if triton_id:
                self._mapped[triton_id] = request_id
        return request_id

    def release(self, triton_id: str) -> None:
        self._mapped.pop(triton_id, None)
