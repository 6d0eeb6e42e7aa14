"""WorldConfig's TensorRT-LLM rank properties (API.md "Several processes"): global rank r is
tensor-parallel rank r % T of stage r // T; without `rank`, the launcher's RANK."""
from __future__ import annotations

import pytest

from runtime import WorldConfig


@pytest.mark.parametrize("rank, tp_rank, pp_rank, first, last", [
    (0, 0, 0, True, False), (1, 1, 0, True, False), (2, 0, 1, False, False), (5, 1, 2, False, True)])
def test_ranks_are_tensor_fastest(rank, tp_rank, pp_rank, first, last):
    world = WorldConfig(tensor_parallelism=2, pipeline_parallelism=3, rank=rank)
    assert (world.tensor_parallel_rank, world.pipeline_parallel_rank) == (tp_rank, pp_rank)
    assert (world.is_first_pipeline_parallel_rank, world.is_last_pipeline_parallel_rank) == (first, last)


def test_one_process_is_both_the_first_and_the_last_stage(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    world = WorldConfig()
    assert (world.tensor_parallel_rank, world.pipeline_parallel_rank) == (0, 0)
    assert world.is_first_pipeline_parallel_rank and world.is_last_pipeline_parallel_rank


def test_without_a_rank_the_launchers_rank_is_used(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    world = WorldConfig(tensor_parallelism=None, pipeline_parallelism=2)
    assert (world.tensor_parallel_rank, world.pipeline_parallel_rank) == (1, 1)
    assert world.is_last_pipeline_parallel_rank
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK: expected a non-negative integer, got 'x'"):
        world.tensor_parallel_rank
