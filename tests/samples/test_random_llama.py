"""The benchmarks' random-weight LLaMA GGUF: our loader reads it back as the shape it was written
with, each format holds the same draws, and a greedy step runs on the engine built from it."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from runtime import build_engine
from samples.microbench.llama_cpp_compare import our_rate
from samples.microbench.random_llama import LlamaShape, byte_pair_vocabulary, random_tensor, write_random_llama

TINY = LlamaShape(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
                  vocab_size=600)


def test_the_default_shape_is_the_1b_model():
    assert LlamaShape().num_parameters() == 1_104_218_112


@pytest.mark.parametrize("type_name", ["F32", "Q8_0", "Q4_0", "Q6_K"])
def test_each_format_holds_the_same_draws(tmp_path, type_name):
    reader = gguf.GGUFReader(write_random_llama(str(tmp_path / "m.gguf"), type_name, TINY, seed=3))
    tensors = {t.name: t for t in reader.tensors}
    assert list(tensors) == [name for name, _ in TINY.tensors()]
    down = tensors["blk.1.ffn_down.weight"]
    values = gguf.quants.dequantize(down.data, down.tensor_type)
    expected = random_tensor("blk.1.ffn_down.weight", (256, 256), seed=3)
    tolerance = {"F32": 0.0, "Q8_0": 1e-3, "Q4_0": 1e-2, "Q6_K": 5e-3}[type_name]
    np.testing.assert_allclose(values, expected, atol=tolerance)
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32


def test_vocabulary_is_exact_and_distinct():
    tokens, types, merges = byte_pair_vocabulary(600)
    assert len(tokens) == len(set(tokens)) == len(types) == 600
    assert len(merges) == 600 - 259
    with pytest.raises(ValueError, match="vocab_size"):
        byte_pair_vocabulary(100)


def test_engine_built_from_the_file_generates(tmp_path):
    path = write_random_llama(str(tmp_path / "m.gguf"), "F32", TINY)
    engine = build_engine(path, tmp_path / "engine", weight_only="int8")
    assert engine.model_config.hidden_size == 256 and engine.model_config.num_layers == 2
    assert our_rate(str(tmp_path / "engine"), list(range(300, 310)), 4) > 0
