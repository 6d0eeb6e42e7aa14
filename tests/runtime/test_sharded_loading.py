"""Loading one tensor-parallel rank's slices (Engine.from_dir(path, shard)): for every architecture,
from HF checkpoints and built engine directories, in float32 / float16 / bfloat16 builds, each
rank's weights equal the whole engine's weights sliced in memory (TensorShard.slice), and a rank
reads exactly its slices' bytes (plus the replicated tensors) from the files, by offsets."""
from __future__ import annotations

import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime import Engine, WeightError, build_engine
from runtime.parallel.tensor_parallel import TensorShard
from runtime.loading.weights import TensorSource
from tests.factories import make_checkpoint as make_factory_checkpoint
from tests.runtime.arch_factories import CASES, make_checkpoint

BUILD_DTYPES = ("float32", "float16", "bfloat16")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
# case -> (factory arch, overrides) for tests.factories' checkpoints: GQA, and vocabularies the
# sizes do not divide (gpt2 50: 13 rows a rank at size 4, the last 11; llama 9: the last rank empty).
FACTORY_CASES = {
    "gpt2_vocab_50": ("gpt2", dict(vocab_size=50)),
    "llama_gqa": ("llama", dict(num_key_value_heads=2)),
    "llama_vocab_129": ("llama", dict(vocab_size=129)),
    "llama_vocab_9": ("llama", dict(vocab_size=9)),
}
ALL_CASES = (*CASES, *FACTORY_CASES)
# (case, size) pairs the model's head counts do not allow; every other pair is tested.
UNSPLITTABLE = {("bloom_6_heads", 4)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> HF checkpoint dir (float32 tensors)."""
    out = {}
    for seed, case in enumerate(ALL_CASES):
        out[case] = tmp_path_factory.mktemp(case)
        if case in CASES:
            make_checkpoint(out[case], case, seed=seed)
        else:
            arch, overrides = FACTORY_CASES[case]
            make_factory_checkpoint(out[case], arch, seed=seed, **overrides)
    return out


def shards(engine: Engine, size: int) -> list[TensorShard]:
    return [TensorShard.of(engine.model_config, rank, size) for rank in range(size)]


def slice_bytes(engine: Engine, shard: TensorShard, itemsize: int) -> int:
    """Bytes of the rank's slices of every canonical weight (whole ones for the replicated)."""
    return itemsize * sum(math.prod(shard.local_shape(name, tuple(t.shape))) for name, t in engine.weights.items())


def assert_rank_weights(whole: Engine, path, size: int, file_itemsize: int, **build) -> None:
    for shard in shards(whole, size):
        ranked = Engine.from_dir(path, shard=shard, **build)
        assert ranked.shard == shard and set(ranked.weights) == set(whole.weights)
        for name, tensor in whole.weights.items():
            expected = shard.slice(name, tensor)
            got = ranked.weights[name]
            assert got.dtype == expected.dtype and got.shape == expected.shape, name
            assert torch.equal(got, expected), name
        assert ranked.num_bytes_read == slice_bytes(whole, shard, file_itemsize)


def test_every_case_splits_where_its_heads_allow(checkpoints):
    unsplittable = set()
    for case in ALL_CASES:
        cfg = Engine.from_dir(checkpoints[case]).model_config
        for size in (2, 4):
            try:
                TensorShard.of(cfg, 0, size)
            except ValueError:
                unsplittable.add((case, size))
    assert unsplittable == UNSPLITTABLE


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("case", ALL_CASES)
def test_each_rank_loads_its_slices_of_an_hf_checkpoint(checkpoints, case, size):
    if (case, size) in UNSPLITTABLE:
        pytest.skip("the head counts do not split over this size")
    for dtype in BUILD_DTYPES:
        whole = Engine.from_dir(checkpoints[case], dtype=dtype)
        assert whole.shard is None and whole.num_bytes_read == slice_bytes(whole, shards(whole, 1)[0], 4)
        assert_rank_weights(whole, checkpoints[case], size, file_itemsize=4, dtype=dtype)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("case", ALL_CASES)
def test_each_rank_loads_its_slices_of_an_engine_dir(checkpoints, tmp_path, case, size):
    if (case, size) in UNSPLITTABLE:
        pytest.skip("the head counts do not split over this size")
    for dtype in BUILD_DTYPES:
        whole = build_engine(checkpoints[case], tmp_path / dtype, dtype=dtype, max_seq_len=64)
        assert_rank_weights(whole, tmp_path / dtype, size, file_itemsize=ITEMSIZE[dtype])


@pytest.mark.parametrize("file_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["gpt_neox", "falcon_new_decoder", "phi3"])
def test_half_precision_checkpoints(tmp_path, case, file_dtype):
    make_checkpoint(tmp_path, case, seed=3, dtype=file_dtype)
    for dtype in BUILD_DTYPES:
        whole = Engine.from_dir(tmp_path, dtype=dtype)
        assert_rank_weights(whole, tmp_path, 2, file_itemsize=2, dtype=dtype)


def test_a_rank_reads_about_its_share_of_a_large_model(tmp_path):
    make_factory_checkpoint(tmp_path, "llama", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                            num_key_value_heads=4, vocab_size=128)
    whole = Engine.from_dir(tmp_path)
    tensors = load_file(os.fspath(tmp_path / "model.safetensors"))
    file_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert whole.num_bytes_read == file_bytes
    for shard in shards(whole, 2):
        ranked = Engine.from_dir(tmp_path, shard=shard)
        assert ranked.num_bytes_read == slice_bytes(whole, shard, 4)
        assert ranked.num_bytes_read < 0.52 * file_bytes


def test_a_rank_reads_only_its_bytes_from_the_files(checkpoints, monkeypatch):
    """The bytes pread from the files, plus the whole tensors mapped, add up to the count."""
    read = []
    preadv = os.preadv

    def counting_preadv(fd, buffers, offset):
        n = preadv(fd, buffers, offset)
        read.append(n)
        return n

    monkeypatch.setattr(os, "preadv", counting_preadv)
    # Whole: the tensors stored whole are mapped (no copy), the fused ones read.
    whole = Engine.from_dir(checkpoints["llama_gqa"])
    fused = sum(t.numel() * 4 for name, t in whole.weights.items() if name.endswith(("qkv.weight", "mlp_in.weight")))
    assert sum(read) == fused and whole.num_bytes_read == slice_bytes(whole, shards(whole, 1)[0], 4)
    for case in ("llama_gqa", "gpt2_vocab_50"):   # GPT-2: column spans of its [in, out] Conv1D weights
        whole = Engine.from_dir(checkpoints[case])
        for shard in shards(whole, 2):
            read.clear()
            ranked = Engine.from_dir(checkpoints[case], shard=shard)
            replicated = sum(t.numel() * 4 for name, t in whole.weights.items() if shard.selection(name) is None)
            assert sum(read) == ranked.num_bytes_read - replicated == slice_bytes(whole, shard, 4) - replicated


def test_a_multi_file_checkpoint(tmp_path):
    make_factory_checkpoint(tmp_path, "llama", seed=1, max_shard_size="100KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    whole = Engine.from_dir(tmp_path)
    assert_rank_weights(whole, tmp_path, 2, file_itemsize=4)


def test_reads_by_offsets_equal_slicing_in_memory(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(6, 10, generator=gen), "b": torch.randn(4, 10, generator=gen).to(torch.bfloat16),
               "c": torch.randn(5, generator=gen).half()}
    save_file(tensors, os.fspath(tmp_path / "t.safetensors"))
    with TensorSource(os.fspath(tmp_path)) as src:
        a, b = src.get("a"), src.get("b")
        assert torch.equal(src.read(a), tensors["a"])
        assert torch.equal(src.read(a, (0, ((1, 3), (4, 6)))), tensors["a"][[1, 2, 4, 5]])
        assert torch.equal(src.read(a, (1, ((0, 2), (7, 10)))), tensors["a"][:, [0, 1, 7, 8, 9]])
        assert torch.equal(src.read(a.t(), (0, ((2, 5),))), tensors["a"].t()[2:5])
        assert torch.equal(src.read(a.t(), (1, ((1, 4),))), tensors["a"].t()[:, 1:4])
        assert torch.equal(src.read(a.take_rows([(4, 6), (0, 2)])), tensors["a"][[4, 5, 0, 1]])
        assert torch.equal(src.read(b, (1, ((3, 5),))), tensors["b"][:, 3:5])
        assert torch.equal(src.read(src.get("c"), (0, ((1, 4),))), tensors["c"][1:4])
        assert src.read(a, (0, ())).shape == (0, 10)
        mixed = type(a).cat_rows([a, b])   # torch.cat's promotion: bfloat16 rows read as float32
        assert mixed.dtype == torch.float32
        assert torch.equal(src.read(mixed, (0, ((5, 8),))), torch.cat([tensors["a"][5:], tensors["b"][:2].float()]))


def test_errors_name_the_tensor_with_a_shard(checkpoints, tmp_path):
    path = tmp_path / "llama"
    path.mkdir()
    for file in os.listdir(checkpoints["llama_gqa"]):
        (path / file).write_bytes((checkpoints["llama_gqa"] / file).read_bytes())
    shard = shards(Engine.from_dir(path), 2)[1]
    tensors = load_file(os.fspath(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 60)
    save_file(tensors, os.fspath(path / "model.safetensors"))
    with pytest.raises(WeightError, match=r"'layers.0.out.weight' has shape \[64, 60\]"):
        Engine.from_dir(path, shard=shard)


def test_a_shard_of_another_model_is_refused_and_a_rank_engine_is_not_saved(checkpoints, tmp_path):
    other = Engine.from_dir(checkpoints["falcon_7b"]).model_config
    with pytest.raises(ValueError, match="shard"):
        Engine.from_dir(checkpoints["llama_gqa"], shard=TensorShard.of(other, 0, 2))
    llama = Engine.from_dir(checkpoints["llama_gqa"])
    ranked = Engine.from_dir(checkpoints["llama_gqa"], shard=shards(llama, 2)[0])
    with pytest.raises(ValueError, match="slices"):
        ranked.save(tmp_path / "engine")
