"""Tensor parallelism in the runtime: 2 gloo ranks (spawned processes on loopback) against one
process on the same checkpoints: every architecture's logits over a mixed packed step sequence
(fresh contexts, a chunk over cached blocks, generation), a vocabulary that does not split evenly,
one KV head replicated, ALiBi slopes split by head, LoRA adapters sliced like their linears,
logits gathered on rank 0 only, all-reduces through shared memory (same host) or gloo, large ones
in chunks, and GptSession under a WorldConfig."""
from __future__ import annotations

import os

import pytest
import torch

from runtime import Engine, GenerationInput, GenerationOutput, GptSession, ModelRunner, SamplingConfig
from runtime.kernels.cpu.cpu_native import native_ops
from runtime.parallel.pipeline import StageLayers, StagePlan
from runtime.parallel.tensor_parallel import SHM_ALL_REDUCE_ENV, TensorShard, WorldConfig, init_tensor_parallel
from runtime.parallel.world_config import layer_ranges
from tests.distributed import RankPool
from tests.factories import make_checkpoint, step_inputs
from tests.runtime import arch_factories

TOLERANCE = 1e-4
NUM_BLOCKS = 16


@pytest.fixture(scope="module")
def pool():
    ranks = RankPool(2)
    yield ranks
    ranks.close()


CHECKPOINTS = {   # case -> (factory, arch / case, overrides)
    "llama_gqa": (make_checkpoint, "llama", {}),               # 4 heads, 2 KV heads: one per rank
    "qwen2_one_kv_head": (make_checkpoint, "qwen2", {}),        # 1 KV head: replicated, tied head
    "gpt2_odd_vocab": (make_checkpoint, "gpt2", {"vocab_size": 129}),   # learned positions, vocab 65 + 64
    "bloom_alibi": (arch_factories.make_checkpoint, "bloom", {}),
    "falcon_7b": (arch_factories.make_checkpoint, "falcon_7b", {}),     # multi-query, parallel residual
    "gpt_neox": (arch_factories.make_checkpoint, "gpt_neox", {}),       # parallel residual, two norms
    "phi": (arch_factories.make_checkpoint, "phi", {}),                 # lm_head bias
    "gptj": (arch_factories.make_checkpoint, "gptj", {}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}
    for case, (factory, name, overrides) in CHECKPOINTS.items():
        paths[case] = str(tmp_path_factory.mktemp(case))
        factory(paths[case], name, seed=3, **overrides)
    return paths


def _steps(vocab: int) -> list[list[tuple[list[int], int, list[int]]]]:
    """Three packed steps over one pool: two fresh prompts; a chunk over the first one's cache plus
    the second one's generation token; generation for both."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, vocab, (11,), generator=g).tolist(), torch.randint(0, vocab, (6,), generator=g).tolist()
    return [[(a[:7], 0, [5, 2, 9]), (b, 0, [1, 7])],
            [(a[7:], 7, [5, 2, 9]), (b[:1], 6, [1, 7])],
            [(a[:1], 11, [5, 2, 9]), (b[1:2], 7, [1, 7])]]


def _forwards(runner: ModelRunner, vocab: int) -> list[dict[str, torch.Tensor]]:
    return [runner.forward(step_inputs(s, context_logits=True)) for s in _steps(vocab)]


def rank_forwards(checkpoint: str, gather_to_all: bool, sharded_load: bool = True,
                  shared_memory: bool = True) -> list[dict]:
    os.environ[SHM_ALL_REDUCE_ENV] = "1" if shared_memory else "0"
    tp = init_tensor_parallel(WorldConfig(tensor_parallelism=None), torch.device("cpu"))
    assert (tp.shared is not None) == (shared_memory and native_ops() is not None)
    engine = Engine.from_dir(checkpoint, (tp.rank, tp.size) if sharded_load else None)   # else sliced in memory
    runner = ModelRunner(engine, NUM_BLOCKS, tensor_parallel=tp, gather_logits_to_all=gather_to_all)
    return [{k: (v.clone() if v is not None else None) for k, v in out.items()}
            for out in _forwards(runner, engine.model_config.vocab_size)]


@pytest.mark.parametrize("case, sharded_load, shared_memory", [(case, True, True) for case in CHECKPOINTS]
                         + [("llama_gqa", False, True), ("llama_gqa", True, False), ("bloom_alibi", True, False)])
def test_two_ranks_match_one_process(pool, checkpoints, case, sharded_load, shared_memory):
    """Weights loaded sliced or sliced in memory; all-reduces through shared memory or gloo."""
    engine = Engine.from_dir(checkpoints[case])
    expected = _forwards(ModelRunner(engine, NUM_BLOCKS), engine.model_config.vocab_size)
    for outputs in pool.run(rank_forwards, checkpoints[case], True, sharded_load, shared_memory):
        for got, want in zip(outputs, expected):
            assert got["logits"].shape == want["logits"].shape
            torch.testing.assert_close(got["logits"], want["logits"], atol=TOLERANCE, rtol=0)
            torch.testing.assert_close(got["context_logits"], want["context_logits"], atol=TOLERANCE, rtol=0)


def test_logits_gathered_on_rank_zero_only(pool, checkpoints):
    leader, follower = pool.run(rank_forwards, checkpoints["llama_gqa"], False)
    engine = Engine.from_dir(checkpoints["llama_gqa"])
    expected = _forwards(ModelRunner(engine, NUM_BLOCKS), engine.model_config.vocab_size)
    for got, want in zip(leader, expected):
        torch.testing.assert_close(got["logits"], want["logits"], atol=TOLERANCE, rtol=0)
    assert all(out["logits"] is None for out in follower)


def rank_pool_shape(checkpoint: str) -> tuple[list[int], float]:
    tp = init_tensor_parallel(WorldConfig(tensor_parallelism=2), torch.device("cpu"))
    runner = ModelRunner(Engine.from_dir(checkpoint), NUM_BLOCKS, tensor_parallel=tp)
    return list(runner.kv_pool.shape), float(runner.model.alibi_slopes[0]) if runner.model.alibi_slopes is not None \
        else 0.0


def test_each_rank_holds_its_kv_heads_and_slopes(pool, checkpoints):
    (llama0, _), (llama1, _) = pool.run(rank_pool_shape, checkpoints["llama_gqa"])
    tpb = Engine.from_dir(checkpoints["llama_gqa"]).build_config.tokens_per_block
    assert llama0 == llama1 == [2, 2, NUM_BLOCKS, tpb, 1, 16]     # 2 KV heads over 2 ranks
    (qwen0, _), _ = pool.run(rank_pool_shape, checkpoints["qwen2_one_kv_head"])
    assert qwen0[4] == 1                                          # the one KV head, on both
    (_, slope0), (_, slope1) = pool.run(rank_pool_shape, checkpoints["bloom_alibi"])
    from runtime.models.alibi import alibi_slopes
    assert (slope0, slope1) == (float(alibi_slopes(4)[0]), float(alibi_slopes(4)[2]))


def test_shard_arithmetic():
    from runtime.config import ModelConfig
    from runtime.models import lookup
    cfg = ModelConfig(**{**lookup("llama").variant, "architecture": "llama", "vocab_size": 10, "hidden_size": 64,
                         "num_layers": 1, "num_heads": 8, "num_kv_heads": 2, "head_dim": 8, "intermediate_size": 12,
                         "max_position_embeddings": 16, "norm_eps": 1e-5, "activation": "silu", "rope": None,
                         "qkv_bias": False, "out_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
                         "sliding_window": None, "bos_token_id": None, "eos_token_id": None,
                         "pad_token_id": None})
    shard = TensorShard.of(cfg, 3, 4)   # 2 query heads per rank; 2 KV heads over 4 ranks: kv head 1
    assert (shard.first_head, shard.num_local_heads, shard.first_kv_head, shard.num_local_kv_heads) == (6, 2, 1, 1)
    assert shard.qkv_rows() == ((48, 64), (64 + 8, 64 + 16), (80 + 8, 80 + 16))
    assert shard.mlp_in_rows() == ((9, 12), (21, 24)) and shard.intermediate_columns() == ((9, 12),)
    assert shard.vocab_range == (9, 10) and shard.vocab_chunk == 3
    assert TensorShard.of(cfg, 3, 4).selection("layers.0.out.weight") == (1, ((48, 64),))
    assert shard.selection("layers.0.input_norm.weight") is None
    with pytest.raises(ValueError, match="num_heads 8"):
        TensorShard.of(cfg, 0, 3)


def test_world_config_needs_a_launcher(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert init_tensor_parallel(WorldConfig(), torch.device("cpu")) is None
    assert init_tensor_parallel(WorldConfig(tensor_parallelism=None), torch.device("cpu")) is None
    with pytest.raises(ValueError, match="torchrun"):
        init_tensor_parallel(WorldConfig(tensor_parallelism=2), torch.device("cpu"))
    with pytest.raises(ValueError, match="pipeline_parallelism 2 need processes started by torchrun"):
        init_tensor_parallel(WorldConfig(pipeline_parallelism=2), torch.device("cpu"))
    with pytest.raises(ValueError, match="WorldConfig.pipeline_parallelism: must be a positive integer, got 0"):
        WorldConfig(pipeline_parallelism=0)
    with pytest.raises(ValueError, match=r"WorldConfig.pipeline_split: expected 2 layer counts >= 1"):
        WorldConfig(pipeline_parallelism=2, pipeline_split=(3,))


def test_layer_ranges_split_evenly_with_the_extra_layers_first():
    assert layer_ranges(5, 2) == [(0, 3), (3, 5)]
    assert layer_ranges(6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert WorldConfig(pipeline_parallelism=2, pipeline_split=(1, 4)).layer_ranges(5) == [(0, 1), (1, 5)]
    with pytest.raises(ValueError, match=r"pipeline_split: \[1, 3\] adds up to 4 layers; the model has 5"):
        WorldConfig(pipeline_parallelism=2, pipeline_split=(1, 3)).layer_ranges(5)
    with pytest.raises(ValueError, match="3 stages for 2 layers"):
        layer_ranges(2, 3)


def test_a_stage_holds_its_layers_and_its_end_of_the_model():
    first, last = StageLayers(0, 2, 0, 3), StageLayers(1, 2, 3, 5)
    names = ["embed_tokens", "layers.0.qkv.weight", "layers.2.mlp_in.weight_scale", "layers.3.qkv.weight",
             "final_norm.weight", "lm_head", "position_embeddings", "embed_norm.weight"]
    assert [n for n in names if first.holds(n, tied_embeddings=False)] == \
        ["embed_tokens", "layers.0.qkv.weight", "layers.2.mlp_in.weight_scale", "position_embeddings",
         "embed_norm.weight"]
    assert [n for n in names if last.holds(n, tied_embeddings=False)] == ["layers.3.qkv.weight", "final_norm.weight",
                                                                         "lm_head"]
    assert last.holds("embed_tokens", tied_embeddings=True)   # the head's table


# -- GptSession ---------------------------------------------------------------------------------------

def _session_outputs(session: GptSession) -> list:
    prompts = [[5, 9, 14, 3, 7], [11, 2, 60]]
    results = []
    for sampling in (SamplingConfig(), SamplingConfig(beam_width=2),
                     SamplingConfig(top_k=5, random_seed=7)):
        inputs = GenerationInput(end_id=-1, pad_id=0, ids=torch.tensor([p + [0] * (5 - len(p)) for p in prompts]),
                                 lengths=torch.tensor([len(p) for p in prompts]), packed=False, max_new_tokens=6)
        output = GenerationOutput()
        session.generate(output, inputs, sampling)
        results.append(output.ids.clone())
    return results


def rank_session(checkpoint: str, sharded_load: bool) -> list:
    rank = int(os.environ["RANK"])
    engine = Engine.from_dir(checkpoint, (rank, 2) if sharded_load else None)
    return _session_outputs(GptSession(GptSession.Config(2, 2, 32), engine.model_config,
                                       WorldConfig(tensor_parallelism=2), engine))


@pytest.mark.parametrize("sharded_load", [True, False])
def test_gpt_session_under_world_config(pool, checkpoints, sharded_load):
    """Every rank calls generate with the same inputs and gets the one-process tokens (greedy,
    beams, seeded top-k), from an engine loaded sliced or whole."""
    engine = Engine.from_dir(checkpoints["llama_gqa"])
    expected = _session_outputs(GptSession(GptSession.Config(2, 2, 32), engine.model_config, WorldConfig(), engine))
    for outputs in pool.run(rank_session, checkpoints["llama_gqa"], sharded_load):
        for got, want in zip(outputs, expected):
            assert torch.equal(got, want)


def rank_pipeline_session(checkpoint: str, stage_load: bool) -> tuple[list, list[str]]:
    rank = int(os.environ["RANK"])
    engine = Engine.from_dir(checkpoint, None, StagePlan(rank, 2) if stage_load else None)
    session = GptSession(GptSession.Config(2, 2, 32), engine.model_config,
                         WorldConfig(tensor_parallelism=1, pipeline_parallelism=2), engine)
    return _session_outputs(session), sorted(session.runner.model.w)


@pytest.mark.parametrize("stage_load", [True, False])
def test_gpt_session_over_two_pipeline_stages(pool, checkpoints, stage_load):
    """Two stages (layers 0-1 and 2-3 of 4, activations sent between them): every rank gets the
    one-process tokens (greedy, beams, seeded top-k), from an engine loaded per stage or whole;
    each rank holds only its stage's weights."""
    engine = Engine.from_dir(checkpoints["llama_gqa"])
    expected = _session_outputs(GptSession(GptSession.Config(2, 2, 32), engine.model_config, WorldConfig(), engine))
    (first, first_names), (last, last_names) = pool.run(rank_pipeline_session, checkpoints["llama_gqa"], stage_load)
    for outputs in (first, last):
        for got, want in zip(outputs, expected):
            assert torch.equal(got, want)
    num_layers = engine.model_config.num_layers
    split = layer_ranges(num_layers, 2)[0][1]
    assert {int(n.split(".")[1]) for n in first_names if n.startswith("layers.")} == set(range(split))
    assert {int(n.split(".")[1]) for n in last_names if n.startswith("layers.")} == set(range(split, num_layers))
    assert "final_norm.weight" not in first_names and "final_norm.weight" in last_names


def rank_all_reduce(num_floats: int, shared_memory: bool) -> torch.Tensor:
    os.environ[SHM_ALL_REDUCE_ENV] = "1" if shared_memory else "0"
    tp = init_tensor_parallel(WorldConfig(tensor_parallelism=2), torch.device("cpu"))
    results = []
    for i in range(3):   # consecutive calls alternate the region's two phases
        x = torch.arange(num_floats, dtype=torch.float32) * (tp.rank + 1) + i
        results.append(tp.all_reduce(x))
    return torch.stack(results)


@pytest.mark.parametrize("num_floats", [1, 1000, 3 * (1 << 19) + 5])   # the last: four chunks
def test_all_reduce_sums_exactly_on_every_rank(pool, num_floats):
    shared, gloo = pool.run(rank_all_reduce, num_floats, True), pool.run(rank_all_reduce, num_floats, False)
    x = torch.arange(num_floats, dtype=torch.float32)
    want = torch.stack([x + i + 2 * x + i for i in range(3)])
    for got in (*shared, *gloo):
        assert torch.equal(got, want)


def rank_gather(rows: int, columns: int, shared_memory: bool, to_all: bool) -> list:
    os.environ[SHM_ALL_REDUCE_ENV] = "1" if shared_memory else "0"
    tp = init_tensor_parallel(WorldConfig(tensor_parallelism=2), torch.device("cpu"))
    results = []
    for i in range(3):
        x = torch.arange(rows * columns, dtype=torch.float32).view(rows, columns) + 1000 * tp.rank + i
        results.append(tp.gather_columns(x, to_all))
    return results


@pytest.mark.parametrize("rows, columns", [(1, 3), (64, 8192 + 1)])   # the second: chunks of the region
@pytest.mark.parametrize("to_all", [True, False])
@pytest.mark.parametrize("shared_memory", [True, False])
def test_gather_columns(pool, rows, columns, to_all, shared_memory):
    x = torch.arange(rows * columns, dtype=torch.float32).view(rows, columns)
    leader, follower = pool.run(rank_gather, rows, columns, shared_memory, to_all)
    for i in range(3):
        want = torch.cat([x + i, x + 1000 + i], dim=1)
        assert torch.equal(leader[i], want)
        assert torch.equal(follower[i], want) if to_all else follower[i] is None
