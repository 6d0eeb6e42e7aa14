"""Collectives through shared memory among the tensor-parallel ranks of one host (CPUs).

gloo's loopback TCP costs ~0.3 ms per small all-reduce, a shared region ~8 us (a step's 17
all-reduces of 2 KiB: 5.84 vs 0.13 ms, samples.microbench.tensor_parallel), so on CPUs the model's
float32 all-reduces and logits gathers go through one region mapped by every rank (the native
bm_shm_all_reduce of runtime/kernels/cpu/collectives.cpp: copy in, post a sequence number, wait for the
peers', then sum the slots in rank order, so every rank gets the same bits, or copy them out).
BATCH_MANAGER_SHM_ALL_REDUCE=0 keeps gloo.
"""
from __future__ import annotations

import logging
import os
import socket
import uuid

import torch

from .world_config import DIST_TIMEOUT_ENV, DistributedError

logger = logging.getLogger(__name__)

SHM_ALL_REDUCE_ENV = "BATCH_MANAGER_SHM_ALL_REDUCE"   # "0": gloo for every all-reduce on CPUs
# Floats per rank and phase of the shared region (2 MiB); larger calls run in chunks. A world of N
# ranks maps 2 * N slots plus N control lines (8 MiB for 2 ranks).
SHM_SLOT_FLOATS = 1 << 19


class SharedMemoryCollectives:
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
    def create(rank: int, size: int, control_group, timeout_s: float) -> "SharedMemoryCollectives | None":
        """Collective (every rank calls it): the region when every rank is on this host and can map
        it and run the native kernels; else None everywhere (gloo)."""
        import torch.distributed as dist

        from ..kernels.cpu.cpu_native import native_ops
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
        dist.broadcast_object_list(paths, group_src=0, group=control_group)
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
        return SharedMemoryCollectives(native, region, rank, size, timeout_s)
