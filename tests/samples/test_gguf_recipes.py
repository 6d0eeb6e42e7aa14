"""The benchmarks' per-tensor type recipes: llama.cpp's Q4_K_M choice (Q6_K for the output and for
attn_v / ffn_down of the layers use_more_bits picks, Q4_K elsewhere) and its fallbacks where a row is
not a multiple of 256 values; a random LLaMA written with the recipe holds those types."""
from __future__ import annotations

import collections

import gguf
import pytest

from samples.microbench.gguf_recipes import file_type_name, tensor_type, use_more_bits
from samples.microbench.random_llama import LlamaShape, write_random_llama


def test_use_more_bits_picks_llama_cpps_layers():
    # 16 layers: the first two, the last two, and every third between (llama.cpp's rule)
    assert [i for i in range(16) if use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]


def test_q4_k_m_types_and_fallbacks():
    assert tensor_type("output.weight", 2048, "Q4_K_M", 16, has_output=True) == "Q6_K"
    assert tensor_type("token_embd.weight", 2048, "Q4_K_M", 16, has_output=True) == "Q4_K"
    assert tensor_type("token_embd.weight", 2048, "Q4_K_M", 16, has_output=False) == "Q6_K"   # tied: the output
    assert tensor_type("blk.0.attn_v.weight", 2048, "Q4_K_M", 16, has_output=True) == "Q6_K"
    assert tensor_type("blk.2.attn_v.weight", 2048, "Q4_K_M", 16, has_output=True) == "Q4_K"
    assert tensor_type("blk.4.ffn_down.weight", 8192, "Q4_K_M", 16, has_output=True) == "Q6_K"
    assert tensor_type("blk.4.attn_q.weight", 2048, "Q4_K_M", 16, has_output=True) == "Q4_K"
    # SmolLM2's 576 columns: llama.cpp's fallbacks; its 1536-column ffn_down keeps the K type
    assert tensor_type("blk.2.attn_q.weight", 576, "Q4_K_M", 30, has_output=False) == "Q5_0"
    assert tensor_type("token_embd.weight", 576, "Q4_K_M", 30, has_output=False) == "Q8_0"
    assert tensor_type("blk.4.ffn_down.weight", 1536, "Q4_K_M", 30, has_output=False) == "Q4_K"
    assert tensor_type("blk.2.attn_q.weight", 576, "Q6_K", 30, has_output=False) == "Q8_0"
    assert tensor_type("blk.2.attn_q.weight", 576, "Q4_1", 30, has_output=False) == "Q4_1"
    assert file_type_name("Q4_K_M") == "MOSTLY_Q4_K_M" and file_type_name("Q4_K") == "MOSTLY_Q4_K_S"
    with pytest.raises(ValueError, match="recipe"):
        tensor_type("output.weight", 2048, "Q9_K_M", 16, has_output=True)


def test_random_llama_written_with_the_recipe(tmp_path):
    shape = LlamaShape(hidden_size=256, num_layers=8, num_heads=4, num_kv_heads=2, intermediate_size=512,
                       vocab_size=600)
    reader = gguf.GGUFReader(write_random_llama(str(tmp_path / "m.gguf"), "Q4_K_M", shape))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert collections.Counter(types.values()) == {"Q4_K": 49, "Q6_K": 9, "F32": 17}
    assert types["output.weight"] == types["blk.7.ffn_down.weight"] == types["blk.3.attn_v.weight"] == "Q6_K"
    assert types["blk.1.attn_v.weight"] == types["blk.1.ffn_gate.weight"] == "Q4_K"
    assert int(reader.fields["general.file_type"].contents()) == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
