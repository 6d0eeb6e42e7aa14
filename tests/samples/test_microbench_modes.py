"""The precision modes the step and memory microbenchmarks build (samples.microbench.decode_step.MODES):
from a GGUF file, "fp32" and "bf16" are de-quantized weights of that dtype and "blocks" the file's
own blocks (BuildConfig.weight_format "auto" would keep the blocks for all three)."""
from __future__ import annotations

import torch

from runtime import Engine
from runtime.engine import build_engine
from runtime.quantization.block_weights import block_bases
from samples.microbench.decode_step import MODES, modes_for
from tests.runtime.test_gguf_blocks import block_llama


def test_fp32_and_bf16_are_dequantized_weights_and_blocks_the_files_own(tmp_path):
    path = block_llama(tmp_path / "q8_0.gguf", lambda _: "q8_0", seed=1, tie_word_embeddings=True)
    built = {}
    for mode in ("fp32", "bf16", "blocks"):
        build_engine(path, tmp_path / mode, **MODES[mode])
        built[mode] = Engine.from_dir(tmp_path / mode)
    for mode, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        weights = built[mode].weights
        assert not block_bases(weights), mode
        assert weights["layers.0.mlp_in.weight"].dtype == dtype, mode
    assert "layers.0.mlp_in.weight" in block_bases(built["blocks"].weights)


def test_blocks_is_offered_for_gguf_sources_only():
    assert modes_for("model.gguf", ["fp32", "blocks"]) == ["fp32", "blocks"]
    assert modes_for("checkpoint_dir", ["fp32", "blocks", "int8"]) == ["fp32", "int8"]
