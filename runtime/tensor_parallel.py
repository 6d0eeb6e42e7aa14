"""Tensor parallelism over torch.distributed: which slice of every weight a rank holds
(`TensorShard`, plain arithmetic) and the collectives the model and the manager use
(`TensorParallel`: gloo on CPUs, NCCL on GPUs for the model's tensors, gloo for control messages).

The split (Megatron's): q/k/v and the MLP's up/gate are column-parallel (a rank computes its heads
and its intermediate columns), the attention output and the MLP's down projection are
row-parallel (each rank a partial sum, one all-reduce per layer, or per block with a parallel
residual), the embedding and lm_head are vocab-parallel (a masked lookup plus an all-reduce; the
logits gathered where the decoder runs). KV heads split like the query heads; with fewer KV heads
than ranks each rank keeps the one its query heads read (replicated), so each rank's KV pool holds
only the heads it attends with.

On CPUs, when every rank runs on one host, the model's all-reduces and logits gathers go through a
shared-memory region instead of gloo (`_SharedMemoryAllReduce`: a native copy, post, wait and sum
or copy out): gloo's loopback TCP costs ~0.3 ms per small all-reduce, the region ~8 us (17
all-reduces of 2 KiB: 5.83 ms vs 0.13 ms, samples.microbench.tensor_parallel);
BATCH_MANAGER_SHM_ALL_REDUCE=0 keeps gloo.

Processes come from `torchrun` (or any launcher setting RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT); left unset, the tensor parallelism is the launcher's world size. Every collective has
the timeout `BATCH_MANAGER_DIST_TIMEOUT_S` (default 60 s): a rank that waits longer on the others
fails with an error instead of hanging.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import pickle
import socket
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from .config import ModelConfig
from .world_config import WorldConfig, launcher_world_size

__all__ = ["DIST_TIMEOUT_ENV", "DistributedError", "TensorParallel", "TensorShard", "WorldConfig",
           "init_tensor_parallel", "launcher_world_size", "local_device", "take"]

logger = logging.getLogger(__name__)

DIST_TIMEOUT_ENV = "BATCH_MANAGER_DIST_TIMEOUT_S"
DEFAULT_DIST_TIMEOUT_S = 60.0
SHM_ALL_REDUCE_ENV = "BATCH_MANAGER_SHM_ALL_REDUCE"   # "0": gloo for every all-reduce on CPUs
# Floats per rank and phase of the shared region (2 MiB); larger all-reduces run in chunks. A world
# of N ranks maps 2 * N slots plus N control lines (8 MiB for 2 ranks).
SHM_SLOT_FLOATS = 1 << 19

Ranges = tuple[tuple[int, int], ...]   # [start, stop) spans, ascending


class DistributedError(RuntimeError):
    """A collective failed: another rank died, timed out, or ended the run with an error."""


def dist_timeout_s() -> float:
    value = os.environ.get(DIST_TIMEOUT_ENV)
    if value is None:
        return DEFAULT_DIST_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{DIST_TIMEOUT_ENV}: expected a positive number of seconds, got {value!r}")
    return seconds


def _spans(start: int, stop: int) -> Ranges:
    return ((start, stop),) if stop > start else ()


@dataclass(frozen=True)
class TensorShard:
    """Rank `rank` of `size`: the heads, intermediate columns and vocabulary rows it holds.

    Weights are in the canonical layout (runtime.weights): qkv rows [all q, all k, all v],
    mlp_in rows [gate, up] (gated) or [fc], out and mlp_out [hidden, in]."""
    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    gated_mlp: bool

    @staticmethod
    def of(cfg: ModelConfig, rank: int, size: int) -> "TensorShard":
        """ValueError naming the field when `cfg` does not split over `size` ranks."""
        if not 0 <= rank < size:
            raise ValueError(f"rank: expected 0 <= rank < {size}, got {rank}")
        if cfg.num_heads % size:
            raise ValueError(f"tensor_parallelism: {size} does not divide the model's num_heads {cfg.num_heads}")
        kv = cfg.num_kv_heads
        if (kv >= size and kv % size) or (kv < size and size % kv):
            raise ValueError(f"tensor_parallelism: {size} ranks cannot share the model's {kv} KV heads "
                             "(one must divide the other)")
        if cfg.intermediate_size % size:
            raise ValueError(f"tensor_parallelism: {size} does not divide the model's intermediate_size "
                             f"{cfg.intermediate_size}")
        return TensorShard(rank, size, cfg.num_heads, kv, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size,
                           cfg.mlp_type == "gated")

    # -- what this rank holds ---------------------------------------------------------------------

    @property
    def num_local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def num_local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def first_head(self) -> int:
        return self.rank * self.num_local_heads

    @property
    def first_kv_head(self) -> int:
        """Its first KV head; with fewer KV heads than ranks, the one its query heads read."""
        if self.num_kv_heads >= self.size:
            return self.rank * self.num_local_kv_heads
        return self.rank * self.num_kv_heads // self.size

    @property
    def num_local_intermediate(self) -> int:
        return self.intermediate_size // self.size

    @property
    def vocab_chunk(self) -> int:
        """Rows of every rank's (padded) vocabulary slice: ceil(vocab / size)."""
        return -(-self.vocab_size // self.size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """[start, stop) of the vocabulary rows it holds (the last rank's may be shorter or empty)."""
        start = min(self.rank * self.vocab_chunk, self.vocab_size)
        return start, min(start + self.vocab_chunk, self.vocab_size)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config of the slice the rank computes: its heads and intermediate columns (the
        vocabulary stays whole: ids and logits are global)."""
        return dataclasses.replace(cfg, num_heads=self.num_local_heads, num_kv_heads=self.num_local_kv_heads,
                                   intermediate_size=self.num_local_intermediate)

    def head_index(self) -> torch.Tensor:
        """int64 [local heads]: the global index of each query head (ALiBi slopes)."""
        return torch.arange(self.first_head, self.first_head + self.num_local_heads)

    # -- the slices of the canonical weights -----------------------------------------------------

    def qkv_rows(self) -> Ranges:
        d, q_size, kv_size = self.head_dim, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q0, k0 = self.first_head * d, self.first_kv_head * d
        nq, nk = self.num_local_heads * d, self.num_local_kv_heads * d
        return (*_spans(q0, q0 + nq), *_spans(q_size + k0, q_size + k0 + nk),
                *_spans(q_size + kv_size + k0, q_size + kv_size + k0 + nk))

    def out_columns(self) -> Ranges:
        d = self.head_dim
        return _spans(self.first_head * d, (self.first_head + self.num_local_heads) * d)

    def intermediate_columns(self) -> Ranges:
        n = self.num_local_intermediate
        return _spans(self.rank * n, (self.rank + 1) * n)

    def mlp_in_rows(self) -> Ranges:
        (start, stop), = self.intermediate_columns()
        if not self.gated_mlp:
            return ((start, stop),)
        i = self.intermediate_size
        return ((start, stop), (i + start, i + stop))

    def selection(self, name: str) -> tuple[int, Ranges] | None:
        """(dim, spans) of the canonical weight `name` this rank holds, or None: it holds it whole
        (norms, position embeddings, the row-parallel linears' biases)."""
        suffix = name.rsplit(".", 2)
        linear = suffix[-2] if len(suffix) >= 2 and name.startswith("layers.") else None
        if name in ("embed_tokens", "lm_head", "lm_head.bias"):
            return 0, _spans(*self.vocab_range)
        if linear == "qkv":
            return 0, self.qkv_rows()
        if linear == "mlp_in":
            return 0, self.mlp_in_rows()
        if linear == "out" and name.endswith(".weight"):
            return 1, self.out_columns()
        if linear == "mlp_out" and name.endswith(".weight"):
            return 1, self.intermediate_columns()
        return None

    def local_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the rank's slice of a canonical weight of `shape`."""
        sel = self.selection(name)
        if sel is None:
            return tuple(shape)
        dim, spans = sel
        out = list(shape)
        out[dim] = sum(stop - start for start, stop in spans)
        return tuple(out)

    def slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's slice of a whole canonical weight held in memory (GptSession given a whole
        engine; LoRA factors). Loading from files reads only the slice: runtime.weights."""
        sel = self.selection(name)
        if sel is None:
            return tensor
        return take(tensor, *sel)


def take(tensor: torch.Tensor, dim: int, spans: Ranges) -> torch.Tensor:
    """The spans of `tensor` along `dim`, concatenated (a copy)."""
    parts = [tensor.narrow(dim, start, stop - start) for start, stop in spans]
    if not parts:
        shape = list(tensor.shape)
        shape[dim] = 0
        return tensor.new_empty(shape)
    return torch.cat(parts, dim).contiguous() if len(parts) > 1 else parts[0].contiguous()


# -- processes and collectives -----------------------------------------------------------------------

_GROUPS: dict[tuple[str, float], Any] = {}


def _group(backend: str, timeout_s: float):
    """Our own process group over every rank (made once per backend and timeout: creating one is a
    collective, which every rank runs in the same order since all build the same objects)."""
    import torch.distributed as dist
    key = (backend, timeout_s)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return _GROUPS[key]


def init_tensor_parallel(world_config: WorldConfig | None, device: torch.device) -> "TensorParallel | None":
    """Join (or start) the torch.distributed world for `world_config`; None when it is one process.

    Starts the default process group from the launcher's environment when no one has (gloo, or
    NCCL on CUDA devices). ValueError when the world does not match the tensor parallelism."""
    world_config = world_config or WorldConfig()
    size = world_config.resolved_tensor_parallelism()
    if size == 1:
        return None
    import torch.distributed as dist
    if not dist.is_available():
        raise ValueError("tensor_parallelism: this torch build has no torch.distributed")
    timeout_s = dist_timeout_s()
    device_backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing or launcher_world_size() == 1:
            raise ValueError(f"WorldConfig.tensor_parallelism: {size} needs processes started by torchrun (or "
                             f"another launcher setting RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); "
                             f"missing {missing or ['WORLD_SIZE']}")
        dist.init_process_group(backend="cuda:nccl,cpu:gloo" if device_backend == "nccl" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world != size:
        raise ValueError(f"WorldConfig.tensor_parallelism: {size}, but the torch.distributed world has {world} "
                         "processes (pipeline parallelism is not supported: they must be equal)")
    rank = dist.get_rank()
    if world_config.rank is not None and world_config.rank != rank:
        raise ValueError(f"WorldConfig.rank: {world_config.rank}, but this process is rank {rank}")
    control = _group("gloo", timeout_s)
    tensors = control if device_backend == "gloo" else _group(device_backend, timeout_s)
    shared = _SharedMemoryAllReduce.create(rank, world, control, timeout_s) if device_backend == "gloo" else None
    return TensorParallel(rank, world, tensors, control, timeout_s, shared)


def local_device(world_config: WorldConfig | None, device: torch.device) -> torch.device:
    """The CUDA device of this rank (device_ids[local rank], else the local rank); others unchanged."""
    if device.type != "cuda" or device.index is not None:
        return device
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    ids = world_config.device_ids if world_config is not None else None
    return torch.device("cuda", ids[local_rank] if ids else local_rank)


class TensorParallel:
    """This rank's view of the world: rank, size and the collectives (each raises
    DistributedError naming what failed; after one the world is unusable)."""

    def __init__(self, rank: int, size: int, group, control_group, timeout_s: float,
                 shared: "_SharedMemoryAllReduce | None" = None):
        self.rank, self.size = rank, size
        self.group, self.control_group = group, control_group
        self.shared = shared   # same-host CPU ranks: float32 all-reduces through shared memory
        self.timeout_s = timeout_s
        self.num_all_reduces = 0
        self.all_reduce_seconds = 0.0   # wall time in all-reduce (benchmarks read it)
        self.time_all_reduce = False

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def shard(self, cfg: ModelConfig) -> TensorShard:
        return TensorShard.of(cfg, self.rank, self.size)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (tensor must be contiguous); returns it."""
        import time

        import torch.distributed as dist
        start = time.perf_counter() if self.time_all_reduce else 0.0
        if self.shared is not None and tensor.dtype == torch.float32 and tensor.device.type == "cpu":
            self.shared(tensor.view(-1))
        else:
            try:
                dist.all_reduce(tensor, group=self.group)
            except (RuntimeError, ValueError) as e:
                raise DistributedError(f"all-reduce failed on rank {self.rank}: {e}") from e
        if self.time_all_reduce:
            self.all_reduce_seconds += time.perf_counter() - start
        self.num_all_reduces += 1
        return tensor

    def gather_columns(self, tensor: torch.Tensor, to_all: bool) -> torch.Tensor | None:
        """tensor [rows, c] on every rank -> [rows, size * c], rank-major columns: on every rank
        (to_all) or on rank 0 only (others get None)."""
        import torch.distributed as dist
        tensor = tensor.contiguous()
        if self.shared is not None and tensor.dtype == torch.float32 and tensor.device.type == "cpu":
            parts = self.shared.gather(tensor.view(-1), to_all)
            if parts is None:
                return None
            rows, columns = tensor.shape
            return parts.view(self.size, rows, columns).permute(1, 0, 2).reshape(rows, self.size * columns)
        try:
            if to_all:
                parts = [torch.empty_like(tensor) for _ in range(self.size)]
                dist.all_gather(parts, tensor, group=self.group)
            else:
                parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else None
                dist.gather(tensor, parts, dst=0, group=self.group)
        except (RuntimeError, ValueError) as e:
            raise DistributedError(f"gathering the logits failed on rank {self.rank}: {e}") from e
        return torch.cat(parts, dim=1) if parts is not None else None

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (ranks agreeing on a pool size)."""
        import torch.distributed as dist
        t = torch.tensor([value], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        except (RuntimeError, ValueError) as e:
            raise DistributedError(f"agreeing on a value failed on rank {self.rank}: {e}") from e
        return int(t.item())

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj`, on every rank (pickled; one length and one payload broadcast). Waits up
        to the timeout; DistributedError when rank 0 is gone or nothing came in time."""
        import torch.distributed as dist
        try:
            if self.rank == 0:
                payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                           dtype=torch.uint8)
                length = torch.tensor([payload.numel()], dtype=torch.int64)
                dist.broadcast(length, src=0, group=self.control_group)
                dist.broadcast(payload, src=0, group=self.control_group)
                return obj
            length = torch.empty(1, dtype=torch.int64)
            dist.broadcast(length, src=0, group=self.control_group)
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
            dist.broadcast(payload, src=0, group=self.control_group)
        except (RuntimeError, ValueError) as e:
            raise DistributedError(f"rank {self.rank}: no message from rank 0 ({e}); it stopped, failed, or sent "
                                   f"nothing for {DIST_TIMEOUT_ENV}={self.timeout_s:g} s") from e
        return pickle.loads(payload.numpy().tobytes())


class _SharedMemoryAllReduce:
    """float32 all-reduces and gathers among the ranks of one host through one shared region (the
    native bm_shm_all_reduce: copy in, post a sequence number, wait for the peers', sum the slots
    in rank order so every rank gets the same bits, or copy them out). Raises DistributedError
    when a peer does not post within the timeout or its process is gone."""

    def __init__(self, native, region: torch.Tensor, rank: int, size: int, timeout_s: float):
        self.native, self.region = native, region   # region: uint8, mapped from a file already unlinked
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.seq = 0

    def __call__(self, flat: torch.Tensor) -> None:
        """Sum flat (float32, contiguous) over the ranks, in place."""
        for start in range(0, flat.numel(), SHM_SLOT_FLOATS):
            self._call(flat[start:start + SHM_SLOT_FLOATS], None)

    def gather(self, flat: torch.Tensor, to_all: bool) -> torch.Tensor | None:
        """float32 [size, n]: row r is rank r's flat (contiguous, n floats), on every rank (to_all)
        or rank 0 (the others get None)."""
        out = torch.empty(self.size, flat.numel()) if to_all or self.rank == 0 else None
        for start in range(0, flat.numel(), SHM_SLOT_FLOATS):
            chunk = flat[start:start + SHM_SLOT_FLOATS]
            self._call(chunk, out[:, start:start + chunk.numel()] if out is not None else None)
        return out

    def _call(self, chunk: torch.Tensor, gathered: torch.Tensor | None) -> None:
        self.seq += 1
        status = self.native.shm_all_reduce(chunk, self.region, SHM_SLOT_FLOATS, self.rank, self.size,
                                            self.seq, self.timeout_s, gathered)
        if status:
            reason = "a peer's process exited" if status == 2 else \
                f"a peer sent nothing for {DIST_TIMEOUT_ENV}={self.timeout_s:g} s"
            raise DistributedError(f"all-reduce failed on rank {self.rank}: {reason}")

    @staticmethod
    def create(rank: int, size: int, control_group, timeout_s: float) -> "_SharedMemoryAllReduce | None":
        """Collective (every rank calls it): the region when every rank is on this host and can map
        it and run the native kernels; else None everywhere (gloo)."""
        import torch.distributed as dist

        from .kernels.cpu_native import native_ops
        native = native_ops() if os.environ.get(SHM_ALL_REDUCE_ENV, "").strip() != "0" else None
        hosts: list = [None] * size
        dist.all_gather_object(hosts, socket.gethostname(), group=control_group)
        nbytes = 64 * size + 2 * size * SHM_SLOT_FLOATS * 4
        path = None
        if rank == 0 and native is not None and len(set(hosts)) == 1 and os.path.isdir("/dev/shm"):
            path = f"/dev/shm/batch-manager-tp-{uuid.uuid4().hex}"
            try:
                with open(path, "wb") as f:
                    f.truncate(nbytes)
            except OSError as e:
                logger.info("tensor parallel: no shared-memory all-reduce (%s); using gloo", e)
                path = None
        paths = [path]
        dist.broadcast_object_list(paths, src=0, group=control_group)
        region = None
        if paths[0] is not None and native is not None:
            try:
                region = torch.from_file(paths[0], shared=True, size=nbytes, dtype=torch.uint8)
                region[64 * rank + 8:64 * rank + 16].view(torch.int64)[0] = os.getpid()
            except (OSError, RuntimeError) as e:
                logger.info("tensor parallel: cannot map the shared region (%s); using gloo", e)
                region = None
        ok = torch.tensor([int(region is not None)])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=control_group)   # also: every rank has mapped it
        if rank == 0 and paths[0] is not None:
            os.unlink(paths[0])   # the mappings stay; nothing is left behind, even if a rank dies
        if not int(ok):
            return None
        return _SharedMemoryAllReduce(native, region, rank, size, timeout_s)
