"""The precision modes across ranks: the int8 KV cache under tensor parallelism (each rank holds its
KV heads with their scales) and int8 KV / bf16 / both under two pipeline stages: 2 gloo ranks give
the logits of one process in the same mode."""
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


# -- pipeline parallelism: each stage's pool holds its layers' int8 values and scales; bf16 weights
# and activations travel between the stages as 16-bit payloads

PRECISIONS = {"int8_kv_cache": {"kv_cache_dtype": "int8"}, "bfloat16": {"dtype": "bfloat16"},
              "bfloat16_int8_kv_cache": {"dtype": "bfloat16", "kv_cache_dtype": "int8"}}


def rank_stage_forwards(checkpoint: str, overrides: dict) -> tuple[int, list[dict]]:
    from runtime.parallel.pipeline import StagePlan
    tp = init_tensor_parallel(WorldConfig(tensor_parallelism=1, pipeline_parallelism=2), torch.device("cpu"))
    engine = Engine.from_dir(checkpoint, None, StagePlan(tp.global_rank, 2), **overrides)
    runner = ModelRunner(engine, NUM_BLOCKS, tensor_parallel=tp)   # the logits reach every rank
    outputs = [{k: v.clone() for k, v in out.items()} for out in _forwards(runner, engine.model_config.vocab_size)]
    return runner.kv_pool.shape[0], outputs


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_two_pipeline_stages_match_one_process_in_each_precision(pool, checkpoint, precision):
    overrides = PRECISIONS[precision]
    engine = Engine.from_dir(checkpoint, **overrides)
    expected = _forwards(ModelRunner(engine, NUM_BLOCKS), engine.model_config.vocab_size)
    results = pool.run(rank_stage_forwards, checkpoint, overrides)
    assert sum(num_layers for num_layers, _ in results) == engine.model_config.num_layers
    tolerance = TOLERANCE   # the same ops in the same order: only the layers run in two processes
    for _, outputs in results:
        for got, want in zip(outputs, expected):
            torch.testing.assert_close(got["logits"], want["logits"], atol=tolerance, rtol=0)
            torch.testing.assert_close(got["context_logits"], want["context_logits"], atol=tolerance, rtol=0)
