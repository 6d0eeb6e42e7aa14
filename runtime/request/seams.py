"""What a request carries of the manager's and the doors' objects, as Protocols: the request core
(torch-free, never importing batch_manager) states their shape without importing them. spec.py and
checks.py import these under TYPE_CHECKING only; tests/batch_manager/test_request_seams.py holds the
manager's objects to them."""
from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class AdapterHandle(Protocol):
    """A request's LoRA adapter as its door validated it (the manager's AdapterRef)."""

    @property
    def task_id(self) -> int: ...


@runtime_checkable
class KvSourceAddress(Protocol):
    """Where a generation-only request fetches its prompt's KV (the Executor's KvSource)."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...

    @property
    def handle(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


@runtime_checkable
class AdapterCacheBounds(Protocol):
    """The PEFT cache's bounds as a door's LoRA parsing reads them (the manager's PeftCacheManagerConfig)."""

    @property
    def max_adapter_size(self) -> int: ...

    @property
    def optimal_adapter_size(self) -> int: ...

    @property
    def num_host_module_layer(self) -> int: ...


@runtime_checkable
class AdapterWeightClaims(Protocol):
    """The PEFT cache's record of the weights behind each task id (the manager's AdapterWeights,
    thread-safe): a door checks weights re-sent with an id against it."""

    def claim(self, ref: AdapterHandle, weights_name: str) -> str | None:
        """The error refusing `ref` when its id names other weights, else None (the id is claimed)."""
