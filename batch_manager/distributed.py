"""The manager across tensor-parallel ranks: rank 0 leads, the other ranks follow its forwards.

Rank 0 runs the whole engine core (front-end callbacks or queues, admission, scheduler, KV block
bookkeeping, decoder, responses). Before each forward it sends every other rank what the forward
needs (the packed step inputs, the block copies, the LoRA adapters loaded or evicted since the
last one), point to point and without waiting for them to take it: under pipeline parallelism
rank 0 launches the next micro-batch while the later stages still compute the last one;
every other rank (`Follower`) holds only its slice of the model and its KV heads' pool and runs
the same forward on it. The logits are gathered on rank 0, which samples.

Why sample on rank 0 rather than everywhere: the followers then hold no request state at all
(no scheduler, no decoder, no grammar matchers), so nothing can drift apart between ranks
(a grammar compiled sooner on one rank, a stop signal polled between two steps, a time-based
policy), user code (callbacks, logits post-processors) runs once, and a follower receives one
message per forward, which it could not avoid anyway. The cost is the logits gather to one rank
instead of an all-gather, i.e. less traffic, not more.

Liveness: rank 0 sends a heartbeat while it has nothing to run (at least once a second); a
follower that hears nothing for BATCH_MANAGER_DIST_TIMEOUT_S gives up with an error. Shutdown,
termination and rank 0's fatal errors are broadcast; a rank that dies fails the others'
next collective, which ends them with an error naming it.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from runtime.parallel.tensor_parallel import DistributedError, TensorParallel

logger = logging.getLogger(__name__)

# Rank 0 broadcasts a heartbeat when it has sent nothing for this long (API.md: at least once a second).
HEARTBEAT_INTERVAL_S = 0.5

# Messages, rank 0 -> every follower: (kind, payload).
HEARTBEAT, FORWARD, STOP, ERROR = "heartbeat", "forward", "stop", "error"


class StepBroadcaster:
    """Rank 0's side: one message per forward, heartbeats while idle, the end of the run."""

    def __init__(self, tensor_parallel: TensorParallel):
        self.tp = tensor_parallel
        self._last_sent = time.monotonic()
        self._closed = False
        # LoRA changes not sent yet: (task id, adapter or None for an eviction), in order
        self._pending_adapters: list[tuple[int, Any]] = []

    def adapters_changed(self, evictions, loads) -> None:
        self._pending_adapters += [(task_id, None) for task_id in evictions]
        self._pending_adapters += list(loads)

    def forward(self, block_copies: list[tuple[int, int]], inputs: dict) -> None:
        """Before rank 0's own forward of `inputs` (ModelRunner's tensor dict)."""
        adapters, self._pending_adapters = self._pending_adapters, []
        self._send((FORWARD, (adapters, block_copies, inputs)))

    def heartbeat(self) -> None:
        if not self._closed and time.monotonic() - self._last_sent >= HEARTBEAT_INTERVAL_S:
            self._send((HEARTBEAT, None))

    def close(self, error: str | None = None) -> None:
        """The run ended (shutdown, termination) or failed (`error`): tell the followers, once."""
        if self._closed:
            return
        self._closed = True
        try:
            self._send((STOP, None) if error is None else (ERROR, error))
            self.tp.flush_objects()
        except DistributedError as e:   # a follower is gone already: nothing left to tell it
            logger.warning("could not tell the other ranks that the run ended: %s", e)

    def _send(self, message: tuple) -> None:
        self.tp.send_object(message)
        self._last_sent = time.monotonic()


class Follower:
    """A rank > 0: runs rank 0's forwards on its slice until rank 0 ends the run. Has the
    worker's interface for the front-ends (GptManager, Executor): it has no requests of its own,
    and `shutdown` waits for rank 0 to end the run."""

    def __init__(self, runner, tensor_parallel: TensorParallel):
        self.runner, self.tp = runner, tensor_parallel
        self.fatal_error: str | None = None
        self.num_forwards = 0
        self.thread = threading.current_thread()   # run() is called on the thread that built this
        self._ended = threading.Event()

    @property
    def num_active_requests(self) -> int:
        return 0

    @property
    def is_running(self) -> bool:
        return self.fatal_error is None and not self._ended.is_set()

    def run(self) -> None:
        try:
            while True:
                kind, payload = self.tp.receive_object()
                if kind == FORWARD:
                    self._forward(*payload)
                elif kind == STOP:
                    return
                elif kind == ERROR:
                    self.fatal_error = f"rank 0 failed: {payload}"
                    logger.error("rank %d: %s", self.tp.global_rank, self.fatal_error)
                    return
        except DistributedError as e:
            self.fatal_error = str(e)
            logger.error("rank %d: the tensor-parallel run ended: %s", self.tp.global_rank, e)
        except BaseException as e:  # noqa: BLE001 - an internal bug; rank 0 sees its collectives fail
            logger.exception("rank %d: follower crashed", self.tp.global_rank)
            self.fatal_error = f"internal error in the follower of rank {self.tp.global_rank}: {e!r}"
        finally:
            self._ended.set()

    def _forward(self, adapters: list[tuple[int, Any]], block_copies: list[tuple[int, int]], inputs: dict) -> None:
        for task_id, adapter in adapters:
            if adapter is None:
                self.runner.lora_store.evict(task_id)
            else:
                self.runner.lora_store.load(task_id, adapter)
        try:
            if block_copies:
                self.runner.copy_blocks([src for src, _ in block_copies], [dst for _, dst in block_copies])
            self.runner.forward(inputs)
        except DistributedError:
            raise
        except Exception as e:  # noqa: BLE001 - bad inputs fail on every rank before any collective;
            # rank 0 fails the group's requests, and the run goes on.
            logger.warning("rank %d: forward failed (rank 0 fails its requests): %r", self.tp.global_rank, e)
        self.num_forwards += 1

    def shutdown(self) -> None:
        """Wait until rank 0 ends the run (its shutdown or termination), or the run fails."""
        self.join()

    def join(self) -> None:
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join()
