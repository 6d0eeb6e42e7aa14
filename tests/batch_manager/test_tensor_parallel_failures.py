"""A tensor-parallel run that breaks ends every rank with a clear error in bounded time, never a
hang: a follower killed mid-run fails rank 0's requests; rank 0 killed ends the followers; rank 0's
internal crash is broadcast. Each test starts its own 2-rank world (the broken one is discarded)."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from batch_manager import GptManager, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType
from runtime import WorldConfig, build_engine
from tests.batch_manager.conftest import Client, make_request, wait_until
from tests.distributed import RankPool
from tests.factories import make_checkpoint

TIMEOUT_S = 5   # BATCH_MANAGER_DIST_TIMEOUT_S of these worlds
BOUND_S = 3 * TIMEOUT_S
PROMPTS = [[5, 9, 17, 33, 2, 8, 99], [3, 4, 5, 6], [40, 41, 42]]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_failures")
    make_checkpoint(root / "hf", "llama", seed=5)
    build_engine(root / "hf", root / "engine", tokens_per_block=4, max_batch_size=8, max_input_len=48,
                 max_seq_len=200, max_num_tokens=128)
    return str(root / "engine")


def run_in_new_world(fn, engine_dir: str, ranks: list[int] | None = None, pipeline: bool = False) -> list:
    """fn(engine_dir, pipeline) on both ranks of a fresh 2-rank world (discarded after); -> results of
    `ranks`. pipeline: the two ranks are two pipeline stages (else two tensor-parallel ranks)."""
    pool = RankPool(2, env={"BATCH_MANAGER_DIST_TIMEOUT_S": str(TIMEOUT_S)})
    try:
        return pool.run(fn, engine_dir, pipeline, ranks=ranks)
    finally:
        pool.close()


def build_manager(engine_dir: str, pipeline: bool, *callbacks) -> GptManager:
    """The manager every rank builds; a follower passes no callbacks."""
    world = WorldConfig(tensor_parallelism=1, pipeline_parallelism=2) if pipeline else None
    return GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                      *(callbacks or (None, None)), optional_params=TrtGptModelOptionalParams(world_config=world))


def _kill_self_after(condition) -> None:
    def watch():
        wait_until(condition, 60)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, daemon=True).start()


def follower_dies(engine_dir: str, pipeline: bool):
    """Rank 1 is killed after a few forwards; rank 0 -> (seconds until every request is answered,
    the error messages, the manager's fatal error)."""
    rank = int(os.environ["RANK"])
    if rank == 1:
        manager = build_manager(engine_dir, pipeline)
        _kill_self_after(lambda: manager.worker.num_forwards >= 3)
        manager.shutdown()
        return None
    client = Client([make_request(i, p, 150) for i, p in enumerate(PROMPTS)])
    manager = build_manager(engine_dir, pipeline, *client.callbacks())
    start = time.monotonic()
    client.wait(BOUND_S + 30)
    elapsed = time.monotonic() - start
    errors = [client.final(i)[2] for i in range(len(PROMPTS))]
    fatal = manager.fatal_error
    manager.shutdown()
    return elapsed, errors, fatal


@pytest.mark.parametrize("pipeline", [False, True], ids=["tp2", "pp2"])
def test_a_killed_follower_fails_rank_zero_in_bounded_time(engine_dir, pipeline):
    (elapsed, errors, fatal), = run_in_new_world(follower_dies, engine_dir, ranks=[0], pipeline=pipeline)
    assert elapsed < BOUND_S
    assert fatal is not None and "tensor-parallel run failed" in fatal
    assert all(e and "tensor-parallel run failed" in e for e in errors), errors


def leader_dies(engine_dir: str, pipeline: bool):
    """Rank 0 is killed after a few steps; rank 1 -> (seconds its shutdown() waited, its fatal error)."""
    rank = int(os.environ["RANK"])
    if rank == 0:
        client = Client([make_request(0, PROMPTS[0], 150)])
        manager = build_manager(engine_dir, pipeline, *client.callbacks())
        _kill_self_after(lambda: len(client.stats) >= 3)
        client.wait(120)
        return None
    manager = build_manager(engine_dir, pipeline)
    start = time.monotonic()
    manager.shutdown()
    return time.monotonic() - start, manager.fatal_error, manager.is_running


@pytest.mark.parametrize("pipeline", [False, True], ids=["tp2", "pp2"])
def test_a_killed_leader_ends_the_followers_in_bounded_time(engine_dir, pipeline):
    (elapsed, fatal, running), = run_in_new_world(leader_dies, engine_dir, ranks=[1], pipeline=pipeline)
    assert elapsed < BOUND_S
    assert fatal is not None and "rank 1" in fatal and not running


def leader_crashes(engine_dir: str, pipeline: bool):
    """Rank 0's worker hits an internal error; -> (rank, fatal error, seconds until the run ended)."""
    rank = int(os.environ["RANK"])
    if rank != 0:
        manager = build_manager(engine_dir, pipeline)
        start = time.monotonic()
        manager.shutdown()
        return rank, manager.fatal_error, time.monotonic() - start
    client = Client([make_request(0, PROMPTS[0], 20), make_request(1, PROMPTS[1], 20)])
    manager = build_manager(engine_dir, pipeline, *client.callbacks())
    scheduler = manager.worker.scheduler
    update = scheduler.update

    def broken_update(step, result):
        if step.iteration == 3:
            raise AssertionError("a scheduler bug")
        return update(step, result)

    scheduler.update = broken_update
    start = time.monotonic()
    client.wait(60)
    errors = [client.final(i)[2] for i in range(2)]
    assert all("a scheduler bug" in e for e in errors), errors
    fatal = manager.fatal_error
    manager.shutdown()
    return rank, fatal, time.monotonic() - start


def test_rank_zero_crash_is_broadcast(engine_dir):
    (_, leader_fatal, _), (_, follower_fatal, elapsed) = run_in_new_world(leader_crashes, engine_dir)
    assert "a scheduler bug" in leader_fatal
    assert follower_fatal.startswith("rank 0 failed: internal error") and "a scheduler bug" in follower_fatal
    assert elapsed < BOUND_S
