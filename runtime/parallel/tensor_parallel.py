"""Tensor parallelism over torch.distributed: joining the world and the collectives the model
and the manager use (`TensorParallel`: gloo on CPUs, NCCL on GPUs for the model's tensors, gloo for
control messages; on one host's CPUs, shared memory: runtime.parallel.shm_collectives). Which slice of
every weight a rank holds: runtime.parallel.tensor_shard.

Processes come from `torchrun` (or any launcher setting RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT); left unset, the tensor parallelism is the launcher's world size. Every collective has
the timeout `BATCH_MANAGER_DIST_TIMEOUT_S` (default 60 s): a rank that waits longer on the others
fails with an error instead of hanging.
"""
from __future__ import annotations

import datetime
import logging
import os
import pickle
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from ..config import ModelConfig
from .pipeline import CONTROL_TAG, PipelineStage, StagePlan
from .shm_collectives import SHM_ALL_REDUCE_ENV, SharedMemoryCollectives
from .tensor_shard import Ranges, TensorShard, take
from .world_config import (DIST_TIMEOUT_ENV, DistributedError, WorldConfig, dist_timeout_s, failing_as,
                           launcher_world_size)

__all__ = ["DIST_TIMEOUT_ENV", "SHM_ALL_REDUCE_ENV", "DistributedError", "Ranges", "TensorParallel", "TensorShard",
           "WorldConfig", "init_tensor_parallel", "local_device", "take"]

logger = logging.getLogger(__name__)


# Objects rank 0 may have sent per other rank that it has not taken yet (messages of the manager:
# one per forward, a heartbeat while idle) before `send_object` waits for it.
MAX_PENDING_OBJECTS = 16

# -- processes and collectives -----------------------------------------------------------------------

_GROUPS: dict[tuple[str, float], Any] = {}


def _group(backend: str, timeout_s: float):
    """Our own process group over every rank (made once per backend and timeout: creating one is a
    collective, which every rank runs in the same order since all build the same objects)."""
    key = (backend, timeout_s)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return _GROUPS[key]


def init_tensor_parallel(world_config: WorldConfig | None, device: torch.device) -> "TensorParallel | None":
    """Join (or start) the torch.distributed world for `world_config`; None when it is one process.

    Starts the default process group from the launcher's environment when no one has (gloo, or
    NCCL on CUDA devices). ValueError when the world does not match tensor x pipeline parallelism."""
    world_config = world_config or WorldConfig()
    size = world_config.size
    if size == 1:
        return None
    tp, pp = world_config.resolved_tensor_parallelism(), world_config.pipeline_parallelism
    if not dist.is_available():
        raise ValueError("tensor_parallelism: this torch build has no torch.distributed")
    timeout_s = dist_timeout_s()
    device_backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing or launcher_world_size() == 1:
            what = f"WorldConfig.tensor_parallelism: {tp} needs" if pp == 1 else \
                f"WorldConfig: tensor_parallelism {tp} x pipeline_parallelism {pp} need"
            raise ValueError(f"{what} processes started by torchrun (or another launcher setting RANK, "
                             f"WORLD_SIZE, MASTER_ADDR, MASTER_PORT); missing {missing or ['WORLD_SIZE']}")
        dist.init_process_group(backend="cuda:nccl,cpu:gloo" if device_backend == "nccl" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world != size:
        raise ValueError(f"WorldConfig: tensor_parallelism {tp} x pipeline_parallelism {pp} = {size} ranks, but "
                         f"the torch.distributed world has {world} processes")
    rank = dist.get_rank()
    if world_config.rank is not None and world_config.rank != rank:
        raise ValueError(f"WorldConfig.rank: {world_config.rank}, but this process is rank {rank}")
    control = _group("gloo", timeout_s)
    world_tensors = control if device_backend == "gloo" else _group(device_backend, timeout_s)
    stage_index = rank // tp
    if pp == 1:
        tp_control, tp_tensors = control, world_tensors
    else:   # every rank makes every stage's groups, in one order (creating a group is a collective)
        tp_control = tp_tensors = None
        for s in range(pp):
            ranks = list(range(s * tp, (s + 1) * tp))
            group_control = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s), backend="gloo")
            group_tensors = group_control if device_backend == "gloo" else dist.new_group(
                ranks, timeout=datetime.timedelta(seconds=timeout_s), backend=device_backend)
            if s == stage_index:
                tp_control, tp_tensors = group_control, group_tensors
    shared = None
    if device_backend == "gloo" and tp > 1:
        shared = SharedMemoryCollectives.create(rank % tp, tp, tp_control, timeout_s)
    plan = StagePlan(stage_index, pp, world_config.pipeline_split) if pp > 1 else None
    return TensorParallel(rank % tp, tp, tp_tensors, control, timeout_s, shared, global_rank=rank, world_size=size,
                          stage_plan=plan, stage_group=world_tensors)


def local_device(device: torch.device, device_ids=None) -> torch.device:
    """The CUDA device of this rank: device_ids[local rank], else the local rank (a device with an
    index, or not CUDA, unchanged)."""
    if device.type != "cuda" or device.index is not None:
        return device
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", device_ids[local_rank] if device_ids else local_rank)


class TensorParallel:
    """This rank's view of the world: its tensor-parallel `rank` of `size` within its pipeline
    stage, with their collectives; its `global_rank` of `world_size` with the world's control
    messages (`send_object` from global rank 0 and `receive_object`, `min_int`); its stage (`stage_plan`, None
    without pipeline parallelism). Each collective raises DistributedError naming what failed;
    after one the world is unusable."""

    def __init__(self, rank: int, size: int, group, control_group, timeout_s: float,
                 shared: "SharedMemoryCollectives | None" = None, global_rank: int | None = None,
                 world_size: int | None = None, stage_plan: StagePlan | None = None, stage_group=None):
        self.rank, self.size = rank, size
        self.global_rank = rank if global_rank is None else global_rank
        self.world_size = size if world_size is None else world_size
        self.group, self.control_group = group, control_group
        self.shared = shared   # same-host CPU ranks: float32 all-reduces through shared memory
        self.timeout_s = timeout_s
        self.stage_plan, self._stage_group = stage_plan, stage_group
        self.all_reduce_seconds = 0.0   # wall time in all-reduce while time_all_reduce (benchmarks)
        self.time_all_reduce = False
        self._pending_objects: deque = deque()   # send_object's (works, tensors kept alive, rank), oldest first

    def pipeline_stage(self, num_layers: int) -> PipelineStage | None:
        """This rank's stage of a model of `num_layers` layers (None without pipeline parallelism)."""
        if self.stage_plan is None:
            return None
        return PipelineStage(self.stage_plan.layers(num_layers), self.global_rank, self.size, self._stage_group,
                             self.timeout_s)

    def shard(self, cfg: ModelConfig) -> TensorShard:
        return TensorShard.of(cfg, self.rank, self.size)

    def _through_shared_memory(self, tensor: torch.Tensor) -> bool:
        return self.shared is not None and tensor.dtype == torch.float32 and tensor.device.type == "cpu"

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks: in `tensor` when it is contiguous, else in a contiguous copy;
        returns the sum."""
        start = time.perf_counter() if self.time_all_reduce else 0.0
        tensor = tensor.contiguous()
        if self._through_shared_memory(tensor):
            self.shared(tensor.view(-1))
        else:
            with failing_as(f"all-reduce failed on rank {self.global_rank}"):
                dist.all_reduce(tensor, group=self.group)
        if self.time_all_reduce:
            self.all_reduce_seconds += time.perf_counter() - start
        return tensor

    def gather_columns(self, tensor: torch.Tensor, to_all: bool) -> torch.Tensor | None:
        """tensor [rows, c] on every rank -> [rows, size * c], rank-major columns: on every rank
        (to_all) or on rank 0 only (others get None)."""
        tensor = tensor.contiguous()
        if self._through_shared_memory(tensor):
            parts = self.shared.gather(tensor.view(-1), to_all)
            if parts is None:
                return None
            rows, columns = tensor.shape
            return parts.view(self.size, rows, columns).permute(1, 0, 2).reshape(rows, self.size * columns)
        with failing_as(f"gathering the logits failed on rank {self.global_rank}"):
            if to_all:
                parts = [torch.empty_like(tensor) for _ in range(self.size)]
                dist.all_gather(parts, tensor, group=self.group)
            else:
                parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else None
                dist.gather(tensor, parts, group_dst=0, group=self.group)
        return torch.cat(parts, dim=1) if parts is not None else None

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (ranks agreeing on a pool size)."""
        t = torch.tensor([value], dtype=torch.int64)
        with failing_as(f"agreeing on a value failed on rank {self.global_rank}"):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())

    def send_object(self, obj: Any) -> None:
        """Global rank 0: `obj` to every other rank, without waiting for them (pickled; a length and
        a payload, point to point, in order). Each rank takes it with `receive_object`; up to
        MAX_PENDING_OBJECTS sent objects wait to be taken before this blocks (with the timeout)."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        for rank in range(1, self.world_size):
            with failing_as(f"rank 0: sending a message to rank {rank} failed"):
                works = [dist.isend(t, dst=rank, group=self.control_group, tag=CONTROL_TAG) for t in (length, payload)]
            self._pending_objects.append((works, length, payload, rank))
        while self._pending_objects and all(w.is_completed() for w in self._pending_objects[0][0]):
            self._pending_objects.popleft()
        while len(self._pending_objects) > MAX_PENDING_OBJECTS * (self.world_size - 1):
            self.flush_objects(1)

    def flush_objects(self, count: int | None = None) -> None:
        """Wait until the oldest `count` (default: every) objects sent have been taken."""
        while self._pending_objects and (count is None or count > 0):
            works, _, _, rank = self._pending_objects.popleft()
            with failing_as(f"rank 0: rank {rank} took no message", self.timeout_s, "took"):
                for work in works:
                    work.wait(datetime.timedelta(seconds=self.timeout_s))
            count = None if count is None else count - 1

    def receive_object(self) -> Any:
        """The next object global rank 0 sent (`send_object`). Waits up to the timeout;
        DistributedError when rank 0 is gone or nothing came in time."""
        with failing_as(f"rank {self.global_rank}: no message from rank 0", self.timeout_s):
            length = torch.empty(1, dtype=torch.int64)
            dist.recv(length, src=0, group=self.control_group, tag=CONTROL_TAG)
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
            dist.recv(payload, src=0, group=self.control_group, tag=CONTROL_TAG)
        return pickle.loads(payload.numpy().tobytes())
