"""WorldConfig: the processes one model runs on, the timeout of their collectives, and the error
a failed one raises (plain data, no torch: the manager's options import it). The collectives are
in runtime.parallel.tensor_parallel, the weight slices in runtime.parallel.tensor_shard."""
from __future__ import annotations

import os
from dataclasses import dataclass

DIST_TIMEOUT_ENV = "BATCH_MANAGER_DIST_TIMEOUT_S"
DEFAULT_DIST_TIMEOUT_S = 60.0


class DistributedError(RuntimeError):
    """A collective failed: another rank died, timed out, or ended the run with an error."""


@dataclass(frozen=True)
class WorldConfig:
    """The processes one model runs on. tensor_parallelism None: the torch.distributed launcher's
    world size (1 without a launcher). rank None: the launcher's RANK. pipeline_parallelism must be 1.
    device_ids: CUDA devices by local rank (default: device local_rank)."""
    tensor_parallelism: int | None = 1
    pipeline_parallelism: int = 1
    rank: int | None = None
    gpus_per_node: int | None = None
    device_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        tp = self.tensor_parallelism
        if tp is not None and (not isinstance(tp, int) or isinstance(tp, bool) or tp < 1):
            raise ValueError(f"WorldConfig.tensor_parallelism: must be a positive integer or None, got {tp!r}")
        if self.pipeline_parallelism != 1:
            raise ValueError(f"WorldConfig.pipeline_parallelism: only 1 is supported, got {self.pipeline_parallelism!r}")
        if self.rank is not None and (not isinstance(self.rank, int) or self.rank < 0):
            raise ValueError(f"WorldConfig.rank: must be a non-negative integer or None, got {self.rank!r}")

    @property
    def size(self) -> int:
        return self.resolved_tensor_parallelism() * self.pipeline_parallelism

    def resolved_tensor_parallelism(self) -> int:
        if self.tensor_parallelism is not None:
            return self.tensor_parallelism
        return launcher_world_size()


def launcher_world_size() -> int:
    """WORLD_SIZE of a torch.distributed launch (1 outside one)."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return max(1, int(value))
    except ValueError:
        raise ValueError(f"WORLD_SIZE: expected an integer, got {value!r}") from None


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
