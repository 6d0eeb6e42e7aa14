"""GGUF blocks kept at run time (weight_format "keep"): a tiny random LLaMA written as a GGUF file in
each block format and as a Q4_K / Q6_K mix (Q4_K_M's recipe: attn_v, ffn_down and the output in
Q6_K, the rest Q4_K), run with its blocks against the same file de-quantized to float32; engines
built with keep and reloaded (engine.json's weight_formats), older engine directories, the auto
rule, tensor-parallel slices by whole blocks and the refusal of a split that cuts one, the fused
step against the eager model, and hostile files (NaN / infinite scales, types we do not run, partial blocks).

Tolerances: on de-quantized tiles (the block kernels off) the kept weights are exact and multiplied in
float32: logits within 1e-3 of the de-quantized file's, greedy tokens equal. On the native block
kernels (runtime.kernels.cpu.blocks: inputs quantized to 8 bits, as llama.cpp's) against the same
arithmetic in torch (float64 sums): 2 % of the largest logit (a last-bit difference in an input can
move one of its 8-bit levels, and this widened random model amplifies that), greedy tokens equal;
against float32 only loosely (the 8-bit inputs' ~0.5 % per linear grows to several % here)."""
from __future__ import annotations

import json
import struct
from unittest import mock

import numpy as np
import pytest
import torch

from runtime import ConfigError, Engine, GenerationInput, GenerationOutput, GptSession, ModelRunner, SamplingConfig
from runtime import WeightError, WorldConfig
from runtime.engine import build_engine
from runtime.kernels.torch_kernels import block_linear
from runtime.kernels.torch_kernels.block_linear import BlockLinear, block_ops
from runtime.quantization.block_weights import block_bases, parse_segment, segments_of
from runtime.quantization.gguf_blocks import BLOCK_FORMATS
from tests import factories
from tests.runtime.gguf_factories import Q, ReferenceBlockOps, k_quant_blocks, random_blocks, write_gguf
from tests.runtime.kernels.test_decode_step import assert_runs_equal

NUM_NEW_TOKENS = 6
PROMPTS = ([5, 17, 99, 42, 7, 64, 3, 88], [120, 4, 33])
# 256 wide (the K formats' super-blocks), 4 heads of 64, 2 KV heads
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)
Q6_K_IN_Q4_K_M = ("attn_v", "ffn_down")   # and the output




def block_llama(path, choose, seed: int = 0, **overrides) -> str:
    """A tiny random LLaMA as a GGUF file, each 2-D tensor in the format `choose(gguf name)` names."""
    model = factories.hf_model("llama", seed, **{**SHAPE, **overrides})

    def stored(name: str, w: np.ndarray):
        fmt = BLOCK_FORMATS[choose(name)]
        return fmt.quantize(w), Q[fmt.type_name]

    return write_gguf(path, "llama", model, stored)


def q4_k_m(name: str) -> str:
    return "q6_k" if name == "output.weight" or any(part in name for part in Q6_K_IN_Q4_K_M) else "q4_k"


def context_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    inputs = factories.step_inputs([(prompt, 0, [0, 1])], context_logits=True)
    return ModelRunner(engine, 4).forward(inputs)["context_logits"]


def greedy(engine: Engine, prompt: list[int]) -> list[int]:
    session = GptSession(GptSession.Config(max_batch_size=1, max_beam_width=1, max_sequence_length=32),
                         engine.model_config, WorldConfig(), engine)
    output = GenerationOutput()
    session.generate(output, GenerationInput(end_id=-1, pad_id=0, ids=torch.tensor([prompt], dtype=torch.int32),
                                             lengths=torch.tensor([len(prompt)], dtype=torch.int32),
                                             max_new_tokens=NUM_NEW_TOKENS), SamplingConfig())
    return output.ids[0, 0].tolist()


def assert_runs_like_dequantized(kept: Engine, dequantized: Engine) -> None:
    """Tiles: logits within 1e-3 of the de-quantized engine's, the same greedy tokens. Native: the
    native kernels' logits within 2 % of the largest of the same model whose matmuls run their
    arithmetic in torch (ReferenceBlockOps with 8-bit inputs), the same greedy tokens."""
    native = any(isinstance(linear, BlockLinear) and linear.ops is not None
                 for linear in ModelRunner(kept, 4).model.linears.values())
    for prompt in PROMPTS:
        if not native:
            tokens = greedy(dequantized, prompt)
            torch.testing.assert_close(context_logits(kept, tokens), context_logits(dequantized, tokens),
                                       atol=1e-3, rtol=1e-3)
            assert greedy(kept, prompt) == tokens
            continue
        tokens = greedy(kept, prompt)
        got = context_logits(kept, tokens)
        with mock.patch.object(block_linear, "block_ops", lambda: ReferenceBlockOps(quantized_inputs=True)):
            expected = context_logits(kept, tokens)
            assert greedy(kept, prompt) == tokens
        torch.testing.assert_close(got, expected, atol=0.02 * float(expected.abs().max()), rtol=0)
        # and near the de-quantized model (8-bit inputs: each linear within ~0.5-0.8 % of its largest output)
        assert float((got - context_logits(dequantized, tokens)).abs().max()) < 0.2 * float(expected.abs().max())


@pytest.fixture(params=["tiles", "native"])
def matmul_path(request, monkeypatch):
    """The kept matmuls on de-quantized tiles (block kernels off) or on the native block kernels."""
    if request.param == "tiles":
        monkeypatch.setattr(block_linear, "block_ops", lambda: None)
    elif block_ops() is None:
        pytest.skip("the native block kernels do not run here")
    return request.param


def formats_of(engine: Engine) -> dict[str, list[str]]:
    return {base: [fmt.name for _, fmt in segments_of(engine.weights, base)] for base in block_bases(engine.weights)}


@pytest.fixture(scope="module")
def mix_path(tmp_path_factory) -> str:
    return block_llama(tmp_path_factory.mktemp("mix") / "mix.gguf", q4_k_m, seed=2)


@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_each_format_runs_kept_like_the_dequantized_file(tmp_path, name, matmul_path):
    path = block_llama(tmp_path / f"{name}.gguf", lambda _: name, seed=1, tie_word_embeddings=True)
    kept = Engine.from_dir(path, weight_format="keep", tokens_per_block=8)
    dequantized = Engine.from_dir(path, weight_format="dequantize", tokens_per_block=8)
    assert kept.build_config.weight_format == "keep"
    # every matmul weight and the tied table kept, one segment each; norms stay float32
    assert all(formats == [name] for formats in formats_of(kept).values())
    assert len(formats_of(kept)) == 2 * 4 + 1 and "embed_tokens" in formats_of(kept)
    assert kept.weights["layers.0.input_norm.weight"].dtype == torch.float32
    for base in formats_of(kept):   # the kept bytes are exactly the de-quantized engine's weights
        (segment, fmt), = segments_of(kept.weights, base)
        assert torch.equal(fmt.dequantize(kept.weights[segment]), dequantized.weights[base]), base
    assert_runs_like_dequantized(kept, dequantized)


def test_a_q4_k_m_mix_keeps_each_tensor_in_its_own_format(mix_path, matmul_path):
    kept = Engine.from_dir(mix_path, weight_format="keep", tokens_per_block=8)
    formats = formats_of(kept)
    assert formats["layers.0.qkv.weight"] == ["q4_k", "q6_k"]   # q and k in Q4_K, v in Q6_K
    assert formats["layers.1.mlp_out.weight"] == ["q6_k"] and formats["layers.1.mlp_in.weight"] == ["q4_k"]
    assert formats["lm_head"] == ["q6_k"] and formats["embed_tokens"] == ["q4_k"]
    cfg = kept.model_config
    assert kept.weights["layers.0.qkv.weight@0.q4_k"].shape == (cfg.q_size + cfg.kv_size, 256 // 256 * 144)
    assert kept.weights["layers.0.qkv.weight@1.q6_k"].shape == (cfg.kv_size, 210)
    assert_runs_like_dequantized(kept, Engine.from_dir(mix_path, weight_format="dequantize", tokens_per_block=8))


def fused_and_eager(path) -> tuple[ModelRunner, ModelRunner]:
    engine = Engine.from_dir(path, weight_format="keep", tokens_per_block=4)
    return ModelRunner(engine, 64), ModelRunner(engine, 64, fused_decode=False)


@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_the_fused_step_runs_kept_blocks_as_the_eager_model(tmp_path, name):
    """Each format, tied table: the fused step's logits, greedy tokens and KV cache equal the eager
    model's bit for bit (both run the format table's kernels on the same quantized inputs)."""
    if block_ops() is None:
        pytest.skip("the native block kernels do not run here")
    path = block_llama(tmp_path / f"{name}.gguf", lambda _: name, seed=3, tie_word_embeddings=True)
    fused, eager = fused_and_eager(path)
    assert fused.decode_step is not None
    assert_runs_equal(fused, eager)


def test_the_fused_step_runs_a_q4_k_m_mix_segment_by_segment(mix_path):
    if block_ops() is None:
        pytest.skip("the native block kernels do not run here")
    fused, eager = fused_and_eager(mix_path)
    assert fused.decode_step is not None
    assert all(isinstance(linear, BlockLinear) for linear in [fused.model.lm_head, *fused.model.linears.values()])
    assert_runs_equal(fused, eager)


def test_the_fused_step_declines_a_segment_off_its_thread_units(tmp_path):
    """32 query heads of 8 and 2 KV heads: v's Q6_K rows start at 272, inside a 32-output unit."""
    path = block_llama(tmp_path / "heads.gguf", q4_k_m, seed=4, num_attention_heads=32, num_key_value_heads=2)
    fused, eager = fused_and_eager(path)
    assert fused.decode_step is None
    assert fused.model.linears["layers.0.qkv"].segments[1][2] == 272


def test_a_kept_engine_is_built_recorded_and_reloaded(mix_path, tmp_path):
    built = build_engine(mix_path, tmp_path / "engine", weight_format="keep", tokens_per_block=8)
    record = json.loads((tmp_path / "engine" / "engine.json").read_text())
    assert record["build"]["weight_format"] == "keep"
    assert record["weight_formats"]["layers.0.qkv.weight"] == [["q4_k", 384], ["q6_k", 128]]
    assert record["weight_formats"]["layers.0.out.weight"] == "q4_k" and record["weight_formats"]["lm_head"] == "q6_k"
    loaded = Engine.from_dir(tmp_path / "engine")
    assert loaded.weights.keys() == built.weights.keys()
    assert all(torch.equal(loaded.weights[name], built.weights[name]) for name in built.weights)
    assert torch.equal(context_logits(loaded, PROMPTS[0]), context_logits(built, PROMPTS[0]))
    # loaded as other precisions: the kept blocks de-quantized (and quantized) as asked
    floats = Engine.from_dir(tmp_path / "engine", weight_format="dequantize")
    dequantized = Engine.from_dir(mix_path, weight_format="dequantize", tokens_per_block=8)
    assert floats.weights.keys() == dequantized.weights.keys() and not block_bases(floats.weights)
    assert all(torch.equal(floats.weights[name], dequantized.weights[name]) for name in floats.weights)
    int8 = Engine.from_dir(tmp_path / "engine", weight_only="int8")
    assert int8.build_config.weight_format == "dequantize" and int8.weights["lm_head"].dtype == torch.int8
    # an engine built de-quantized records no formats and loads as before
    build_engine(mix_path, tmp_path / "old", weight_format="dequantize", tokens_per_block=8)
    assert "weight_formats" not in json.loads((tmp_path / "old" / "engine.json").read_text())
    old = Engine.from_dir(tmp_path / "old")
    assert not block_bases(old.weights) and old.weights["layers.0.qkv.weight"].dtype == torch.float32


def test_the_build_command_keeps_blocks_when_asked(mix_path, tmp_path):
    from runtime.build import main
    assert main(["--checkpoint", mix_path, "--output", str(tmp_path / "kept"), "--weight-format", "keep"]) == 0
    assert "lm_head" in json.loads((tmp_path / "kept" / "engine.json").read_text())["weight_formats"]
    # rebuilt without the flag, an engine directory keeps its recorded choice
    assert main(["--checkpoint", str(tmp_path / "kept"), "--output", str(tmp_path / "again")]) == 0
    assert "weight_formats" in json.loads((tmp_path / "again" / "engine.json").read_text())
    assert main(["--checkpoint", mix_path, "--output", str(tmp_path / "bad"), "--weight-format", "keep",
                 "--weight-only", "int8"]) == 2


def test_weight_only_and_dtype_still_apply_to_a_gguf_file(mix_path):
    int8 = Engine.from_dir(mix_path, weight_only="int8")
    assert int8.build_config.weight_format == "dequantize" and int8.weights["layers.0.qkv.weight"].dtype == torch.int8
    with pytest.raises(ConfigError, match="weight_format"):
        Engine.from_dir(mix_path, weight_only="int8", weight_format="keep")
    bf16 = Engine.from_dir(mix_path, weight_format="keep", dtype="bfloat16")
    assert bf16.weights["final_norm.weight"].dtype == torch.bfloat16 and block_bases(bf16.weights)
    with pytest.raises(ConfigError, match="weight_format: unsupported value 'q4'"):
        Engine.from_dir(mix_path, weight_format="q4")


def test_auto_keeps_blocks_where_the_native_kernels_run(mix_path, monkeypatch):
    monkeypatch.setattr(block_linear, "block_ops", lambda: None)
    assert Engine.from_dir(mix_path).build_config.weight_format == "dequantize"
    monkeypatch.setattr(block_linear, "block_ops", lambda: object())
    engine = Engine.from_dir(mix_path)
    assert engine.build_config.weight_format == "keep" and block_bases(engine.weights)


# -- tensor parallelism --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["q4_1", "q8_0"])
def test_tensor_parallel_ranks_hold_whole_blocks(tmp_path, name):
    path = block_llama(tmp_path / "m.gguf", lambda _: name, seed=3)
    for rank in range(2):
        kept = Engine.from_dir(path, shard=(rank, 2), weight_format="keep")
        dequantized = Engine.from_dir(path, shard=(rank, 2), weight_format="dequantize")
        bases = block_bases(kept.weights)
        assert len(bases) == 2 * 4 + 2
        for base in bases:   # the rank's bytes de-quantize to exactly the rank's float slice
            rows = [fmt.dequantize(kept.weights[n]) for n, fmt in segments_of(kept.weights, base)]
            assert torch.equal(torch.cat(rows), dequantized.weights[base]), (rank, base)
        out = kept.weights[f"layers.0.out.weight@0.{name}"]   # row-parallel: half the columns, whole blocks
        assert out.shape[1] == BLOCK_FORMATS[name].row_bytes(kept.model_config.q_size // 2)


def test_a_tensor_parallel_split_that_cuts_a_block_is_refused_naming_the_tensor(mix_path):
    # q_size 256 over 2 ranks: 128 columns each, half a 256-value super-block
    with pytest.raises(ConfigError, match=r"'layers\.0\.out\.weight'.*q4_k blocks of 256"):
        Engine.from_dir(mix_path, shard=(0, 2), weight_format="keep")


# -- hostile files -------------------------------------------------------------------------------

def test_a_nan_or_infinite_scale_is_refused_naming_the_tensor(tmp_path):
    def poisoned(name: str, w: np.ndarray):
        blocks = BLOCK_FORMATS["q8_0"].quantize(w)
        if name == "blk.1.ffn_up.weight":
            blocks[3, 34:36] = np.array([np.inf], np.float16).view(np.uint8)   # row 3, block 1's d
        return blocks, Q.Q8_0

    model = factories.hf_model("llama", 0, **SHAPE)
    path = write_gguf(tmp_path / "nan.gguf", "llama", model, poisoned)
    with pytest.raises(WeightError, match=r"'blk\.1\.ffn_up\.weight'.*NaN or infinite"):
        Engine.from_dir(path, weight_format="keep")


@pytest.mark.parametrize("kind", [Q.Q2_K, Q.IQ2_XXS, Q.Q5_1])
def test_a_type_we_do_not_run_is_refused_naming_the_tensor(tmp_path, kind, monkeypatch):
    def stored(name: str, w: np.ndarray):
        if name == "blk.0.ffn_gate.weight":
            blocks = k_quant_blocks(kind, *w.shape) if kind == Q.Q2_K else random_blocks(kind, *w.shape)
            return blocks, kind
        return BLOCK_FORMATS["q4_k"].quantize(w), Q.Q4_K

    path = write_gguf(tmp_path / "odd.gguf", "llama", factories.hf_model("llama", 0, **SHAPE), stored)
    with pytest.raises(WeightError, match=rf"'blk\.0\.ffn_gate\.weight': type {kind.name} is not a block format"):
        Engine.from_dir(path, weight_format="keep")
    if kind == Q.Q2_K:   # asked for nothing (auto, where the kernels run): that weight alone de-quantized
        monkeypatch.setattr(block_linear, "block_ops", lambda: ReferenceBlockOps())
        engine = Engine.from_dir(path)
        assert engine.weights["layers.0.mlp_in.weight"].dtype == torch.float32
        assert "layers.0.qkv.weight" in formats_of(engine) and "layers.1.mlp_in.weight" in formats_of(engine)


def test_rows_of_partial_blocks_are_refused_naming_the_tensor(tmp_path, mix_path):
    data = open(mix_path, "rb").read()
    name = "blk.0.attn_output.weight"
    needle = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(needle) + len(needle) + 4   # ne0: the row length
    bad = tmp_path / "partial.gguf"
    bad.write_bytes(data[:at] + struct.pack("<Q", 128) + data[at + 8:])
    with pytest.raises(WeightError, match=rf"'{name}': rows of 128 elements are not whole Q4_K blocks"):
        Engine.from_dir(bad, weight_format="keep")


def test_a_hostile_engine_directory_is_refused_naming_the_tensor(mix_path, tmp_path):
    build_engine(mix_path, tmp_path / "e", weight_format="keep")
    config_path = tmp_path / "e" / "engine.json"
    record = json.loads(config_path.read_text())
    for formats, message in ((dict(record["weight_formats"], lm_head="q2_k"), r"'lm_head'.*unknown weight format"),
                             (dict(record["weight_formats"], **{"layers.0.qkv.weight": [["q4_k", 384], ["q6_k", 1]]}),
                              r"'layers\.0\.qkv\.weight'.*add up"),
                             (dict(record["weight_formats"], **{"layers.9.qkv.weight": "q4_k"}),
                              r"'layers\.9\.qkv\.weight' is not a matmul weight")):
        config_path.write_text(json.dumps(dict(record, weight_formats=formats)))
        with pytest.raises(ConfigError, match=message):
            Engine.from_dir(tmp_path / "e")
    config_path.write_text(json.dumps(record))
    from safetensors.torch import load_file, save_file
    weights_path = tmp_path / "e" / "weights.safetensors"
    tensors = load_file(weights_path)
    tensors["layers.1.out.weight@0.q4_k"][0, 0:2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)   # f16 NaN
    save_file(tensors, weights_path, metadata={"format": "batch-manager-engine"})
    with pytest.raises(WeightError, match=r"'layers\.1\.out\.weight@0\.q4_k'.*NaN or infinite"):
        Engine.from_dir(tmp_path / "e")


def test_segment_names_parse():
    assert parse_segment("layers.0.qkv.weight@1.q6_k")[:2] == ("layers.0.qkv.weight", 1)
    assert parse_segment("layers.0.qkv.weight") is None
    with pytest.raises(ConfigError, match="unknown weight format"):
        parse_segment("lm_head@0.iq2_xxs")


@pytest.mark.parametrize("name", ["q4_1", "q8_0", "q6_k"])
def test_the_model_holds_one_copy_of_kept_blocks(tmp_path, name):
    """Where a bound kernel repacks its blocks (cpu/blocks.py's x8 layout), the repacked tensor
    replaces the file's in the model; a tied table's lookup reads the head's rows."""
    if block_ops() is None:
        pytest.skip("the native block kernels do not run here")
    path = block_llama(tmp_path / f"{name}.gguf", lambda _: name, seed=1, tie_word_embeddings=True)
    kept = Engine.from_dir(path, weight_format="keep", tokens_per_block=8)
    model = ModelRunner(kept, 4).model
    # what the kernels read: a bound kernel's own tensor (repacked for q4_1 / q8_0 on AVX2 + F16C)
    held = {id(kernel.blocks) for linear in [*model.linears.values(), model.lm_head] for kernel in linear.kernels}
    segments = [n for base in block_bases(kept.weights) for n, _ in segments_of(kept.weights, base)]
    assert segments and all(id(model.w[n]) in held for n in segments)
    block_bytes = sum(kept.weights[n].numel() for n in segments)
    assert sum(t.numel() for t in model.weight_tensors() if t.dtype == torch.uint8) == block_bytes
    ids = torch.tensor([0, 7, 8, 63, 5])
    (table, fmt), = segments_of(kept.weights, "embed_tokens")
    assert torch.equal(model._embed(ids), fmt.dequantize(kept.weights[table])[ids])
