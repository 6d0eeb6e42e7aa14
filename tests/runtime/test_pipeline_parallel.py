"""Tensor x pipeline parallelism in the runtime: 4 spawned ranks as 2 stages of 2 tensor-parallel
ranks each, against one process (GptSession: greedy, beams, seeded sampling)."""
from __future__ import annotations

import os

import pytest
import torch

from runtime import Engine, GptSession, WorldConfig
from runtime.parallel.pipeline import StagePlan
from tests.distributed import RankPool
from tests.factories import make_checkpoint
from tests.runtime.test_tensor_parallel import _session_outputs

CASES = {   # case -> (arch, overrides)
    "llama_gqa": ("llama", {}),                     # 4 heads, 2 KV heads: one per TP rank
    "qwen2_tied_head": ("qwen2", {}),               # the last stage holds the tied embedding table
    "gpt2_learned_positions": ("gpt2", {"vocab_size": 129}),   # position embeddings on the first stage
}


@pytest.fixture(scope="module")
def pool():
    ranks = RankPool(4)
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}
    for case, (arch, overrides) in CASES.items():
        paths[case] = str(tmp_path_factory.mktemp(case))
        make_checkpoint(paths[case], arch, seed=3, **overrides)
    return paths


def rank_session(checkpoint: str) -> tuple[list, int]:
    """Rank r: tensor-parallel rank r % 2 of stage r // 2; its engine read as that slice of that stage."""
    rank = int(os.environ["RANK"])
    engine = Engine.from_dir(checkpoint, (rank % 2, 2), StagePlan(rank // 2, 2))
    session = GptSession(GptSession.Config(2, 2, 32), engine.model_config,
                         WorldConfig(tensor_parallelism=2, pipeline_parallelism=2), engine)
    return _session_outputs(session), engine.num_bytes_read


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_stages_of_two_tensor_parallel_ranks_match_one_process(pool, checkpoints, case):
    engine = Engine.from_dir(checkpoints[case])
    expected = _session_outputs(GptSession(GptSession.Config(2, 2, 32), engine.model_config, WorldConfig(), engine))
    results = pool.run(rank_session, checkpoints[case])
    for outputs, _ in results:
        for got, want in zip(outputs, expected):
            assert torch.equal(got, want)
    # Each rank reads its slices of its stage's layers: under half of the checkpoint, which its
    # tensor-parallel slices of every layer alone would take.
    assert max(num_bytes for _, num_bytes in results) < 0.5 * engine.num_bytes_read
