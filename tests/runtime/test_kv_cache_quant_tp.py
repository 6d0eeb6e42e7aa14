"""The int8 KV cache under tensor parallelism: each rank holds its KV heads with their scales,
and 2 gloo ranks give the logits of one process with the same int8 cache."""
from __future__ import annotations

import pytest
import torch

from runtime import Engine, ModelRunner
from runtime.parallel.tensor_parallel import WorldConfig, init_tensor_parallel
from tests.distributed import RankPool
from tests.factories import make_checkpoint
from tests.runtime.test_tensor_parallel import NUM_BLOCKS, TOLERANCE, _forwards


@pytest.fixture(scope="module")
def pool():
    ranks = RankPool(2)
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama_gqa"))
    make_checkpoint(path, "llama", seed=3)   # 4 heads, 2 KV heads: one per rank
    return path


def rank_int8_forwards(checkpoint: str) -> tuple[list[int], list[int], list[dict]]:
    tp = init_tensor_parallel(WorldConfig(tensor_parallelism=2), torch.device("cpu"))
    engine = Engine.from_dir(checkpoint, (tp.rank, tp.size), kv_cache_dtype="int8")
    runner = ModelRunner(engine, NUM_BLOCKS, tensor_parallel=tp)
    outputs = [{k: v.clone() for k, v in out.items()} for out in _forwards(runner, engine.model_config.vocab_size)]
    return list(runner.kv_pool.shape), list(runner.kv_scales.shape), outputs


def test_two_ranks_with_an_int8_cache_match_one_process(pool, checkpoint):
    engine = Engine.from_dir(checkpoint, kv_cache_dtype="int8")
    expected = _forwards(ModelRunner(engine, NUM_BLOCKS), engine.model_config.vocab_size)
    tpb = engine.build_config.tokens_per_block
    for pool_shape, scale_shape, outputs in pool.run(rank_int8_forwards, checkpoint):
        assert pool_shape == [2, 2, NUM_BLOCKS, tpb, 1, 16] and scale_shape == pool_shape[:-1]
        for got, want in zip(outputs, expected):
            torch.testing.assert_close(got["logits"], want["logits"], atol=TOLERANCE, rtol=0)
            torch.testing.assert_close(got["context_logits"], want["context_logits"], atol=TOLERANCE, rtol=0)
    assert ModelRunner.kv_bytes_per_block(engine, 2) * 2 == ModelRunner.kv_bytes_per_block(engine)
