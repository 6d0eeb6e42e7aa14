"""A torch.distributed world of spawned processes on loopback (gloo), for tests.

`RankPool(size)` starts `size` processes that join one process group (as torchrun's would: RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK in the environment) and then run, on every rank
at once, the module-level functions `run(fn, *args)` names; it returns each rank's result (or
raises the first rank's error). A test module keeps one pool for all its tests: starting a world
costs seconds. Each rank runs torch with one thread (2 ranks x 1 thread on a 2-core machine).
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import socket
import traceback
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_env(rank: int, size: int, port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_WORLD_SIZE": str(size),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **(extra or {})}


def _rank_main(env: dict[str, str], tasks, results, num_threads: int) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(num_threads)
    rank = int(env["RANK"])
    try:
        dist.init_process_group("gloo")
    except BaseException:  # noqa: BLE001
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, "ready"))
    while True:
        task = tasks.get()
        if task is None:
            break
        module, name, args = task
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(*args)))
        except BaseException:  # noqa: BLE001 - reported to the test
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, size: int, env: dict[str, str] | None = None, num_threads: int = 1,
                 start_timeout_s: float = 120):
        ctx = mp.get_context("spawn")
        port = free_port()
        self.size = size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(size)]
        self.processes = [ctx.Process(target=_rank_main, args=(world_env(r, size, port, env), self.tasks[r],
                                                                 self.results, num_threads), daemon=True)
                          for r in range(size)]
        for p in self.processes:
            p.start()
        self._collect(start_timeout_s)

    def _collect(self, timeout_s: float, ranks: list[int] | None = None) -> list[Any]:
        ranks = list(range(self.size)) if ranks is None else ranks
        out: dict[int, Any] = {}
        errors = []
        while len(out) + len(errors) < len(ranks):
            try:
                rank, ok, value = self.results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"ranks {sorted(set(ranks) - set(out))} did not answer in "
                                   f"{timeout_s} s") from None
            if rank not in ranks:
                continue
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError("\n".join(errors))
        return [out[r] for r in ranks]

    def run(self, fn: Callable, *args, timeout_s: float = 300, ranks: list[int] | None = None) -> list[Any]:
        """fn(*args) on every rank at once (fn: a module-level function); -> the results of `ranks`
        (default all), in rank order. A test that kills a rank waits for the others only."""
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, args))
        return self._collect(timeout_s, ranks)

    def close(self) -> None:
        """Stop the ranks, and join the queues' feeder threads too: a test after this one that
        counts the process's threads must not see them end during its run."""
        for q in self.tasks:
            q.put(None)
        for p in self.processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        for q in [*self.tasks, self.results]:
            q.close()
            q.join_thread()
