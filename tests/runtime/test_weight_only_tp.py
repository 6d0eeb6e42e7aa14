"""Weight-only weights under tensor parallelism: each rank holds its slices of the one quantized
model (int8 rows with their whole-row scales, int4 bytes with their groups' scales and mins), read
sliced from an engine directory or sliced after quantizing a checkpoint, and 2 gloo ranks give the
logits of one process with the same quantized weights; a tied quantized table is looked up by
vocabulary range, an odd vocabulary pads the quantized head; an int4 group that two ranks would
split is a ConfigError naming group_size."""
from __future__ import annotations

import pytest
import torch

from runtime import ConfigError, Engine, ModelRunner, build_engine
from runtime.parallel.tensor_parallel import TensorShard, WorldConfig, init_tensor_parallel
from tests.factories import make_checkpoint
from tests.runtime.test_tensor_parallel import NUM_BLOCKS, TOLERANCE, _forwards, pool  # noqa: F401 (fixture)

# case -> (arch, checkpoint overrides, build fields): every rank's row-parallel input columns
# (heads 2 x 16, intermediate 128 / 2) hold whole groups of 32.
CASES = {
    "llama_int8": ("llama", {}, dict(weight_only="int8")),
    "llama_int4": ("llama", {"intermediate_size": 128}, dict(weight_only="int4", group_size=32)),
    "qwen2_tied_int4": ("qwen2", {"intermediate_size": 128}, dict(weight_only="int4", group_size=32)),
    "gpt2_odd_vocab_int8": ("gpt2", {"vocab_size": 129}, dict(weight_only="int8")),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (checkpoint dir, engine dir built with the case's weight-only mode)."""
    out = {}
    for case, (arch, overrides, build) in CASES.items():
        root = tmp_path_factory.mktemp(case)
        make_checkpoint(root / "hf", arch, seed=3, **overrides)
        build_engine(root / "hf", root / "engine", **build)
        out[case] = (str(root / "hf"), str(root / "engine"))
    return out


def rank_forwards(path: str, build: dict, sharded_load: bool) -> list[dict]:
    tp = init_tensor_parallel(WorldConfig(tensor_parallelism=2), torch.device("cpu"))
    engine = Engine.from_dir(path, (tp.rank, tp.size) if sharded_load else None, **build)
    runner = ModelRunner(engine, NUM_BLOCKS, tensor_parallel=tp)
    return [{k: v.clone() for k, v in out.items()} for out in _forwards(runner, engine.model_config.vocab_size)]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("source, sharded_load", [("engine", True), ("checkpoint", True), ("engine", False)])
def test_two_ranks_match_one_process(pool, checkpoints, case, source, sharded_load):
    """An engine built quantized (read sliced, or whole and sliced in memory) and a checkpoint
    quantized at load give one process's logits."""
    checkpoint, engine_dir = checkpoints[case]
    path, build = (engine_dir, {}) if source == "engine" else (checkpoint, CASES[case][2])
    engine = Engine.from_dir(path, **build)
    assert engine.build_config.weight_only == CASES[case][2]["weight_only"]
    expected = _forwards(ModelRunner(engine, NUM_BLOCKS), engine.model_config.vocab_size)
    for outputs in pool.run(rank_forwards, path, build, sharded_load):
        for got, want in zip(outputs, expected):
            assert got["logits"].shape == want["logits"].shape
            torch.testing.assert_close(got["logits"], want["logits"], atol=TOLERANCE, rtol=0)
            torch.testing.assert_close(got["context_logits"], want["context_logits"], atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_reads_the_slices_of_the_whole_quantized_model(checkpoints, case):
    """Exact: the slices read from the engine and from the checkpoint quantized at load equal the
    whole quantized model's, cut in memory; an int8 row keeps its whole row's scale."""
    checkpoint, engine_dir = checkpoints[case]
    whole = Engine.from_dir(engine_dir)
    shapes = {name: tuple(t.shape) for name, t in whole.weights.items()}
    for rank in range(2):
        shard = TensorShard.of(whole.model_config, rank, 2)
        for ranked in (Engine.from_dir(engine_dir, (rank, 2)), Engine.from_dir(checkpoint, (rank, 2), **CASES[case][2])):
            assert set(ranked.weights) == set(whole.weights)
            for name, tensor in whole.weights.items():
                assert torch.equal(ranked.weights[name], shard.slice(name, tensor, shapes)), (rank, name)
        if CASES[case][2]["weight_only"] == "int8":
            assert torch.equal(Engine.from_dir(engine_dir, (rank, 2)).weights["layers.0.out.weight_scale"],
                               whole.weights["layers.0.out.weight_scale"])


def test_quantized_selections(checkpoints):
    """TensorShard.selection of the quantized parts: rows as their float weight's; a row-parallel
    int8 weight's columns with whole scales, an int4 one's bytes and groups."""
    cfg = Engine.from_dir(checkpoints["llama_int4"][1]).model_config   # hidden 64, intermediate 128
    shard = TensorShard.of(cfg, 1, 2)
    int8 = {"layers.0.out.weight": (64, 64), "layers.0.out.weight_scale": (64,)}
    int4 = {"layers.0.mlp_out.weight": (64, 64), "layers.0.mlp_out.weight_scale": (64, 4),
            "layers.0.mlp_out.weight_min": (64, 4)}
    assert shard.selection("layers.0.out.weight", int8) == (1, ((32, 64),))
    assert shard.selection("layers.0.out.weight_scale", int8) is None
    assert shard.selection("layers.0.mlp_out.weight", int4) == (1, ((32, 64),))   # bytes of columns 64..128
    assert shard.selection("layers.0.mlp_out.weight_scale", int4) == (1, ((2, 4),))
    assert shard.selection("layers.0.mlp_out.weight_min", int4) == (1, ((2, 4),))
    assert shard.selection("layers.0.qkv.weight_scale", int4) == shard.selection("layers.0.qkv.weight")
    assert shard.selection("embed_tokens_scale", int4) == (0, ((64, 128),))


def test_an_int4_group_split_by_two_ranks_is_refused(checkpoints, tmp_path):
    """The tiny llama's 96 intermediate columns give each of 2 ranks 48: groups of 32 would straddle."""
    path = tmp_path / "hf"
    make_checkpoint(path, "llama", seed=3)
    with pytest.raises(ConfigError, match="group_size: 32 .* MLP down projection"):
        Engine.from_dir(path, (0, 2), weight_only="int4", group_size=32)
    build_engine(path, tmp_path / "engine", weight_only="int4", group_size=32)
    with pytest.raises(ConfigError, match="group_size: 32"):
        Engine.from_dir(tmp_path / "engine", (1, 2))
    whole = Engine.from_dir(tmp_path / "engine")
    shapes = {name: tuple(t.shape) for name, t in whole.weights.items()}
    with pytest.raises(ConfigError, match="group_size: 32"):
        TensorShard.of(whole.model_config, 0, 2).slice("layers.0.mlp_out.weight", whole.weights["layers.0.mlp_out.weight"],
                                                       shapes)
    Engine.from_dir(tmp_path / "engine", (0, 1))   # one rank holds every group
