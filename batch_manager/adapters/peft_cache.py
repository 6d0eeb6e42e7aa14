"""The PEFT (LoRA) cache's bookkeeping, owned by the scheduler as it owns KV blocks (plain Python;
adapters are opaque payloads here). Two levels, each keyed by task id:

- host: every adapter a later request may name by id alone, bounded by `host_capacity` (bytes or
  (module, layer) rows, per PeftCacheManagerConfig); an adapter some active request uses stays;
  idle ones leave least recently used first.
- device: the adapters resident in the runtime's weight store, bounded by `device_capacity` rows;
  one stays while a request holding KV blocks uses it; idle ones leave least recently used first.
  A request whose adapter cannot be made resident waits (the capacity scheduler asks
  `can_acquire` before starting it).

The runtime learns what to load and evict through the step (`take_changes`). A task id names one
adapter: weights sent again for a cached id are a repeat when identical (in the cache's dtype),
else refused; `weights` (batch_manager.adapters.adapter_weights.AdapterWeights, set by the engine builder)
keeps that record, thread-safe, for the Executor's check at enqueue too.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AdapterRef:
    """A request's adapter, as admission validated it."""
    task_id: int
    payload: Any = None        # runtime.adapters.lora.LoraAdapter when the request brought weights; None: id only
    host_cost: int = 0         # its size in the host cache's unit (bytes or rows)
    device_rows: int = 0       # rows it takes in the device cache


@dataclass
class _Entry:
    payload: Any
    host_cost: int
    device_rows: int
    num_users: int = 0         # active requests naming it (pins it in the host cache)
    num_running: int = 0       # requests holding KV blocks with it (pins it on the device)
    instance: int = 0          # distinct per registration of weights (a task id re-sent after eviction differs)


class PeftCache:
    def __init__(self, host_capacity: int, device_capacity: int):
        if host_capacity <= 0 or device_capacity <= 0:
            raise ValueError(f"PEFT cache: capacities must be positive, got host {host_capacity}, "
                             f"device {device_capacity} rows")
        self.host_capacity, self.device_capacity = host_capacity, device_capacity
        self._host: OrderedDict[int, _Entry] = OrderedDict()      # least recently used first
        self._host_used = 0
        self._device: OrderedDict[int, None] = OrderedDict()      # resident ids, least recently used first
        self._device_used = 0
        self._runtime_ids: set[int] = set()   # what the runtime holds after the last take_changes
        self.num_evictions = 0                # adapters dropped from the device or the host cache
        self._num_instances = 0
        self.weights = None                   # AdapterWeights: which weights each cached id names; None: unchecked

    @property
    def num_cached(self) -> int:
        return len(self._host)

    @property
    def num_resident(self) -> int:
        return len(self._device)

    def is_cached(self, task_id: int) -> bool:
        return task_id in self._host

    def register(self, ref: AdapterRef) -> str | None:
        """An admitted request's adapter -> None, or the error that refuses the request (an id
        neither cached nor sent with weights; an adapter larger than a whole cache; weights sent
        again for a cached id that differ from the cached ones: a cached id is never served with
        other weights, and identical ones are a repeat, not reloaded)."""
        entry = self._host.get(ref.task_id)
        if entry is not None and ref.payload is not None and self.weights is not None \
                and not self.weights.repeats_cached(ref):
            return (f"lora_weights: task id {ref.task_id} is cached with other weights; a cached id is never "
                    "served with other weights (send the new adapter under a new task id)")
        if entry is None:
            error = self._cannot_cache(ref)
            if error is not None:
                if self.weights is not None and ref.payload is not None:
                    self.weights.refuse(ref)
                return error
            if self.weights is not None:
                self.weights.cache(ref)
            self._num_instances += 1
            entry = _Entry(ref.payload, ref.host_cost, ref.device_rows, instance=self._num_instances)
            self._host[ref.task_id] = entry
            self._host_used += entry.host_cost
        entry.num_users += 1
        self._host.move_to_end(ref.task_id)
        self._trim_host()
        return None

    def _cannot_cache(self, ref: AdapterRef) -> str | None:
        if ref.payload is None:
            return (f"lora_task_id: {ref.task_id} is not in the PEFT cache; send lora_weights and lora_config "
                    "with it")
        if ref.device_rows > self.device_capacity:
            return (f"lora_weights: adapter {ref.task_id} needs {ref.device_rows} device cache rows; the cache "
                    f"has {self.device_capacity} (num_device_module_layer / device_cache_percent)")
        if ref.host_cost > self.host_capacity:
            return (f"lora_weights: adapter {ref.task_id} needs {ref.host_cost} of the host cache's "
                    f"{self.host_capacity} (host_cache_size / num_host_module_layer)")
        return None

    def instance(self, task_id: int) -> int:
        """Which weights `task_id` names now: block reuse keys KV computed with an adapter by it."""
        return self._host[task_id].instance

    def unregister(self, task_id: int) -> None:
        """A request that named `task_id` ended."""
        entry = self._host[task_id]
        assert entry.num_users > 0, f"adapter {task_id}: unregistered more often than registered"
        entry.num_users -= 1
        self._trim_host()

    def can_acquire(self, task_id: int) -> bool:
        """Whether `task_id` is resident or can be, by evicting idle resident adapters."""
        if task_id in self._device:
            return True
        idle = sum(self._host[t].device_rows for t in self._device if self._host[t].num_running == 0)
        return self._host[task_id].device_rows <= self.device_capacity - self._device_used + idle

    def acquire(self, task_id: int) -> bool:
        """Make `task_id` resident (evicting idle adapters, least recently used first) and pin it
        for one more running request. False (and nothing changed) when it cannot be."""
        if not self.can_acquire(task_id):
            return False
        entry = self._host[task_id]
        if task_id not in self._device:
            for victim in [t for t in self._device if self._host[t].num_running == 0]:
                if self._device_used + entry.device_rows <= self.device_capacity:
                    break
                self._evict_device(victim)
            self._device[task_id] = None
            self._device_used += entry.device_rows
        entry.num_running += 1
        self._device.move_to_end(task_id)
        self._host.move_to_end(task_id)
        return True

    def release(self, task_id: int) -> None:
        """A running request with `task_id` paused or ended; the adapter stays resident while idle."""
        entry = self._host[task_id]
        assert entry.num_running > 0, f"adapter {task_id}: released more often than acquired"
        entry.num_running -= 1

    def take_changes(self) -> tuple[tuple[tuple[int, Any], ...], tuple[int, ...]]:
        """-> (loads: (task id, payload), evictions: task ids) since the last call; the runtime
        applies the evictions first."""
        resident = set(self._device)
        loads = tuple((t, self._host[t].payload) for t in self._device if t not in self._runtime_ids)
        evictions = tuple(sorted(self._runtime_ids - resident))
        self._runtime_ids = resident
        return loads, evictions

    def _evict_device(self, task_id: int) -> None:
        del self._device[task_id]
        self._device_used -= self._host[task_id].device_rows
        self.num_evictions += 1

    def _trim_host(self) -> None:
        """Drop idle adapters, least recently used first, while the host cache is over capacity.
        Adapters in use stay even then (each fits alone; the cache shrinks back as they end)."""
        for task_id in [t for t, e in self._host.items() if e.num_users == 0]:
            if self._host_used <= self.host_capacity:
                return
            entry = self._host.pop(task_id)
            self._host_used -= entry.host_cost
            if self.weights is not None:
                self.weights.forget(task_id)
            if task_id in self._device:
                del self._device[task_id]
                self._device_used -= entry.device_rows
            self.num_evictions += 1

    def check_invariants(self) -> None:
        assert self._host_used == sum(e.host_cost for e in self._host.values())
        assert self._device_used == sum(self._host[t].device_rows for t in self._device)
        assert self._device_used <= self.device_capacity
        assert all(e.num_running == 0 or t in self._device for t, e in self._host.items())
        assert all(e.num_running <= e.num_users for e in self._host.values())
        if self.weights is not None:
            self.weights.check_invariants(self._host)
