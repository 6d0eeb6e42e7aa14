"""Pipeline parallelism: which layers a stage holds (`StageLayers`, plain data) and the transfers
between stages (`PipelineStage`, over torch.distributed).

A stage holds a contiguous range of layers (WorldConfig.layer_ranges); the first also the
embedding (and position embeddings, the embedding norm), the last the final norm and lm_head (and
the embedding table when it is tied to the head). Every rank of a stage holds its tensor-parallel
slices of those. A forward runs stage after stage: each stage's rank r receives the hidden states
[T, hidden] from rank r of the stage before (every tensor-parallel rank has them whole after its
all-reduce), runs its layers and sends them on; the last stage's logits go to global rank 0 (the
manager's decoder) or to every rank (GptSession, which decodes everywhere).
"""
from __future__ import annotations

import datetime
import re
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .world_config import failing_as, layer_ranges

# Point-to-point tags (messages of one tag between two ranks arrive in the order sent); the
# manager's control messages use CONTROL_TAG (batch_manager.distributed).
CONTROL_TAG, HIDDEN_TAG, LOGITS_TAG = 0, 1, 2

_LAYER = re.compile(r"^layers\.(\d+)\.")
_FIRST_STAGE = ("embed_norm.", "position_embeddings")
_LAST_STAGE = ("final_norm.", "lm_head")


@dataclass(frozen=True)
class StageLayers:
    """Stage `stage` of `num_stages`: layers [start, stop)."""
    stage: int
    num_stages: int
    start: int
    stop: int

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def num_layers(self) -> int:
        return self.stop - self.start

    def holds(self, name: str, tied_embeddings: bool) -> bool:
        """Whether the canonical weight `name` (or a weight-only part of it) is this stage's."""
        layer = _LAYER.match(name)
        if layer is not None:
            return self.start <= int(layer.group(1)) < self.stop
        if name.startswith("embed_tokens"):
            return self.is_first or (self.is_last and tied_embeddings)
        if name.startswith(_FIRST_STAGE):
            return self.is_first
        if name.startswith(_LAST_STAGE):
            return self.is_last
        return True


@dataclass(frozen=True)
class StagePlan:
    """What a rank knows of its stage before it reads the model: its index and the split rule."""
    stage: int
    num_stages: int
    split: tuple[int, ...] | None = None

    def layers(self, num_layers: int) -> StageLayers:
        start, stop = layer_ranges(num_layers, self.num_stages, self.split)[self.stage]
        return StageLayers(self.stage, self.num_stages, start, stop)


def _as_wire(tensor: torch.Tensor) -> torch.Tensor:
    """gloo moves bytes of the types it knows: 16-bit floats travel as int16."""
    return tensor.view(torch.int16) if tensor.dtype in (torch.bfloat16, torch.float16) else tensor


class PendingReceive:
    """A receive posted ahead (rank 0 posts each micro-batch's logits receive when it launches it)."""

    def __init__(self, stage: "PipelineStage", shape: tuple[int, ...], dtype: torch.dtype, source: int, what: str):
        self.stage, self.source, self.what = stage, source, what
        self.tensor = torch.empty(shape, dtype=dtype)
        with stage.receiving(source, what):
            self._work = dist.irecv(_as_wire(self.tensor), src=source, group=stage.group, tag=LOGITS_TAG)

    def wait(self) -> torch.Tensor:
        start = time.perf_counter()
        with self.stage.receiving(self.source, self.what):
            self._work.wait(datetime.timedelta(seconds=self.stage.timeout_s))
        self.stage.seconds_receiving += time.perf_counter() - start
        return self.tensor


class PipelineStage:
    """This rank's place in the pipeline and its transfers (each raises DistributedError naming the
    peer when it fails or the peer sends nothing within the timeout).

    Sends are asynchronous (gloo's blocking send waits until the receiver has posted its receive,
    which would hold a stage until the next one finished its previous micro-batch): each tensor
    is kept until its send completes, at most `max_pending_sends` at a time."""

    def __init__(self, layers: StageLayers, global_rank: int, tensor_parallelism: int, group, timeout_s: float):
        self.layers = layers
        self.global_rank = global_rank
        self.group, self.timeout_s = group, timeout_s
        self.previous = None if layers.is_first else global_rank - tensor_parallelism
        self.next = None if layers.is_last else global_rank + tensor_parallelism
        # The rank that sends the logits on: the last stage's first tensor-parallel rank.
        self.logits_source = (layers.num_stages - 1) * tensor_parallelism
        self.sends_logits = global_rank == self.logits_source
        self.bytes_sent = 0
        self.seconds_receiving = 0.0   # waiting for (and taking) hidden states and logits (benchmarks)
        self.max_pending_sends = 2 * layers.num_stages
        self._pending_sends: deque = deque()   # (work, tensor kept alive, peer, what), oldest first

    def send(self, tensor: torch.Tensor, to: int, what: str, tag: int = HIDDEN_TAG) -> None:
        wire = _as_wire(tensor.contiguous())
        with failing_as(f"rank {self.global_rank}: sending the {what} to rank {to} failed"):
            work = dist.isend(wire, dst=to, group=self.group, tag=tag)
        self._pending_sends.append((work, wire, to, what))
        self.bytes_sent += wire.numel() * wire.element_size()
        while self._pending_sends and self._pending_sends[0][0].is_completed():
            self._complete_oldest_send()
        while len(self._pending_sends) > self.max_pending_sends:
            self._complete_oldest_send()

    def flush(self) -> None:
        """Wait until every send has completed."""
        while self._pending_sends:
            self._complete_oldest_send()

    def _complete_oldest_send(self) -> None:
        work, _, to, what = self._pending_sends.popleft()
        with failing_as(f"rank {self.global_rank}: sending the {what} to rank {to} failed", self.timeout_s, "took"):
            work.wait(datetime.timedelta(seconds=self.timeout_s))

    def receiving(self, source: int, what: str):
        return failing_as(f"rank {self.global_rank}: no {what} from rank {source}", self.timeout_s)

    def receive(self, shape: tuple[int, ...], dtype: torch.dtype, source: int, what: str) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        start = time.perf_counter()
        with self.receiving(source, what):
            dist.recv(_as_wire(tensor), src=source, group=self.group, tag=HIDDEN_TAG)
        self.seconds_receiving += time.perf_counter() - start
        return tensor

    def post_logits_receive(self, shape: tuple[int, ...], what: str) -> PendingReceive:
        """Rank 0: the float32 logits the last stage will send, received whenever they come."""
        return PendingReceive(self, shape, torch.float32, self.logits_source, what)

    def broadcast_from_last(self, tensor: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
        """The last stage's float32 `tensor` on every rank."""
        if not self.sends_logits:
            tensor = torch.empty(shape, dtype=torch.float32)
        with failing_as(f"rank {self.global_rank}: the logits broadcast from rank {self.logits_source} failed"):
            dist.broadcast(tensor, src=self.logits_source, group=self.group)
        return tensor
