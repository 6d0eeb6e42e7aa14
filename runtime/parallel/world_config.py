"""WorldConfig: the processes one model runs on, the timeout of their collectives, and the error
a failed one raises (plain data, no torch: the manager's options import it). The collectives are
in runtime.parallel.tensor_parallel, the weight slices in runtime.parallel.tensor_shard."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

DIST_TIMEOUT_ENV = "BATCH_MANAGER_DIST_TIMEOUT_S"
DEFAULT_DIST_TIMEOUT_S = 60.0


class DistributedError(RuntimeError):
    """A collective failed: another rank died, timed out, or ended the run with an error."""


@contextlib.contextmanager
def failing_as(what: str, timeout_s: float | None = None, verb: str = "sent"):
    """A torch.distributed call's RuntimeError / ValueError as DistributedError "{what}: {error}",
    or, given the peer's `timeout_s`, "{what} ({error}); it stopped, failed, or {verb} nothing for ..."."""
    try:
        yield
    except (RuntimeError, ValueError) as e:
        if timeout_s is None:
            raise DistributedError(f"{what}: {e}") from e
        raise DistributedError(f"{what} ({e}); it stopped, failed, or {verb} nothing for "
                               f"{DIST_TIMEOUT_ENV}={timeout_s:g} s") from e


@dataclass(frozen=True)
class WorldConfig:
    """The processes one model runs on: `tensor_parallelism` ranks per pipeline stage times
    `pipeline_parallelism` stages. Global rank r is tensor-parallel rank r % T of stage r // T (a
    stage's ranks are consecutive, so with one node per stage the all-reduces stay inside a node
    and only activations cross). tensor_parallelism None: the launcher's world size divided by
    the stages (1 without a launcher). rank None: the launcher's RANK. pipeline_split: the layers
    of each stage, in order (default: `layer_ranges`' even split). device_ids: CUDA devices by
    local rank (default: device local_rank)."""
    tensor_parallelism: int | None = 1
    pipeline_parallelism: int = 1
    rank: int | None = None
    gpus_per_node: int | None = None
    device_ids: tuple[int, ...] | None = None
    pipeline_split: tuple[int, ...] | None = None

    def __post_init__(self):
        tp, pp = self.tensor_parallelism, self.pipeline_parallelism
        if tp is not None and (not isinstance(tp, int) or isinstance(tp, bool) or tp < 1):
            raise ValueError(f"WorldConfig.tensor_parallelism: must be a positive integer or None, got {tp!r}")
        if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
            raise ValueError(f"WorldConfig.pipeline_parallelism: must be a positive integer, got {pp!r}")
        if self.rank is not None and (not isinstance(self.rank, int) or self.rank < 0):
            raise ValueError(f"WorldConfig.rank: must be a non-negative integer or None, got {self.rank!r}")
        split = self.pipeline_split
        if split is not None and (not isinstance(split, (tuple, list)) or len(split) != pp
                                  or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                                             for n in split)):
            raise ValueError(f"WorldConfig.pipeline_split: expected {pp} layer counts >= 1 (one per stage), "
                             f"got {split!r}")

    @property
    def size(self) -> int:
        return self.resolved_tensor_parallelism() * self.pipeline_parallelism

    def resolved_tensor_parallelism(self) -> int:
        if self.tensor_parallelism is not None:
            return self.tensor_parallelism
        return max(1, launcher_world_size() // self.pipeline_parallelism)

    @property
    def global_rank(self) -> int:
        """This process's rank: `rank`, else the launcher's RANK (0 without a launcher)."""
        if self.rank is not None:
            return self.rank
        value = os.environ.get("RANK", "0")
        try:
            rank = int(value)
        except ValueError:
            raise ValueError(f"RANK: expected a non-negative integer, got {value!r}") from None
        if rank < 0:
            raise ValueError(f"RANK: expected a non-negative integer, got {value!r}")
        return rank

    @property
    def tensor_parallel_rank(self) -> int:
        """This process's rank within its pipeline stage (TensorRT-LLM's name)."""
        return self.global_rank % self.resolved_tensor_parallelism()

    @property
    def pipeline_parallel_rank(self) -> int:
        """This process's pipeline stage, 0 first (TensorRT-LLM's name)."""
        return self.global_rank // self.resolved_tensor_parallelism()

    @property
    def is_first_pipeline_parallel_rank(self) -> bool:
        return self.pipeline_parallel_rank == 0

    @property
    def is_last_pipeline_parallel_rank(self) -> bool:
        return self.pipeline_parallel_rank == self.pipeline_parallelism - 1

    def layer_ranges(self, num_layers: int) -> list[tuple[int, int]]:
        """[start, stop) of the layers of each stage (ValueError naming the field when they do not
        add up)."""
        return layer_ranges(num_layers, self.pipeline_parallelism, self.pipeline_split)


def layer_ranges(num_layers: int, num_stages: int, split=None) -> list[tuple[int, int]]:
    """Contiguous layers per stage: `split`'s counts, else as even as can be with the extra layers
    on the first stages (the last one also runs the final norm and lm_head, the first the
    embedding lookup, which is the cheaper of the two)."""
    if split is None:
        if num_stages > num_layers:
            raise ValueError(f"WorldConfig.pipeline_parallelism: {num_stages} stages for {num_layers} layers "
                             "(each stage needs one)")
        base, extra = divmod(num_layers, num_stages)
        split = [base + (1 if s < extra else 0) for s in range(num_stages)]
    elif sum(split) != num_layers:
        raise ValueError(f"WorldConfig.pipeline_split: {list(split)} adds up to {sum(split)} layers; the model "
                         f"has {num_layers}")
    ranges, start = [], 0
    for n in split:
        ranges.append((start, start + n))
        start += n
    return ranges


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
