"""InferenceRequest and NamedTensor: what users hand to, and get back from, the manager."""
from __future__ import annotations

from typing import Any, Callable

from . import tensor_names


class NamedTensor:
    """A (tensor, name) pair; `name` is read-only as in the legacy binding."""
    __slots__ = ("tensor", "_name")

    def __init__(self, tensor: Any, name: str):
        self.tensor = tensor
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        shape = list(getattr(self.tensor, "shape", []))
        return f"NamedTensor(name={self._name!r}, shape={shape})"


def _tensor_property(wire_name: str) -> property:
    def get(self):
        return self._tensors.get(wire_name)

    def set(self, value):
        if value is None:
            self._tensors.pop(wire_name, None)
        else:
            self._tensors[wire_name] = value

    return property(get, set, doc=f"input tensor {wire_name!r}")


class InferenceRequest:
    """One request: an id, named input tensors (torch, CPU), streaming flag, optional logits post-processor.

    InferenceRequest(request_id[, logits_post_processor=fn]) or the legacy
    InferenceRequest(request_id, {wire_name: tensor}). With use_batched_logits_post_processor set,
    the manager's batched post-processor (TrtGptModelOptionalParams.logits_post_processor_batched)
    sees this request's logits together with those of every other request that set it.
    """

    def __init__(self, request_id: int, tensors_or_post_processor: Any = None, *,
                 logits_post_processor: Callable | None = None):
        self._request_id = request_id
        self._tensors: dict[str, Any] = {}
        self.is_streaming = False
        self.logits_post_processor = logits_post_processor
        self.use_batched_logits_post_processor = False
        if isinstance(tensors_or_post_processor, dict):
            for name, tensor in tensors_or_post_processor.items():
                self.emplace_input_tensor(name, tensor)
        elif callable(tensors_or_post_processor):
            self.logits_post_processor = tensors_or_post_processor
        elif tensors_or_post_processor is not None:
            raise TypeError("InferenceRequest: second argument must be a dict of tensors or a logits "
                            f"post-processor, got {type(tensors_or_post_processor).__name__}")

    @property
    def request_id(self) -> int:
        return self._request_id

    @property
    def input_tensors(self) -> dict[str, Any]:
        return dict(self._tensors)

    def emplace_input_tensor(self, name: str, tensor: Any) -> None:
        if name not in tensor_names.INPUT_NAMES:
            raise ValueError(f"Invalid tensor name: {name!r}")
        self._tensors[name] = tensor

    def get_input_tensor(self, name: str) -> Any:
        if name not in self._tensors:
            raise KeyError(f"Undefined tensor: {name!r}")
        return self._tensors[name]

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def __repr__(self) -> str:
        return f"InferenceRequest(request_id={self._request_id}, tensors={sorted(self._tensors)}, " \
               f"is_streaming={self.is_streaming})"


for _wire, _prop in tensor_names.INPUT_NAME_TO_PROPERTY.items():
    setattr(InferenceRequest, _prop, _tensor_property(_wire))
del _wire, _prop
