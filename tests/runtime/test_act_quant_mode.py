"""The int8-activation mode as a build option (BuildConfig.act_quant, `--act-quant`): checked,
recorded in engine.json with QuantMode.ACTIVATIONS, older engine directories still loading, and the
model's weight-only matmuls running act_quant.py's arithmetic (the native kernels equal to its torch
reference at every row count)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from runtime import BuildConfig, ConfigError, Engine, ModelRunner, build_engine
from runtime.build import main as build_main
from runtime.kernels.cpu import act_quant as aq, isa as isa_tiers
from runtime.kernels.torch_kernels.weight_only_linear import QuantizedLinear
from runtime.quantization.int4 import quantize_int4
from runtime.quantization.int8 import quantize_int8
from runtime.precision import QuantMode
from tests.factories import make_checkpoint, step_inputs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_checkpoint(path, "llama")
    return path


def test_act_quant_needs_weight_only_and_a_known_value():
    with pytest.raises(ConfigError, match="act_quant: 'int8' quantizes the activations of weight-only"):
        BuildConfig(act_quant="int8").validated()
    with pytest.raises(ConfigError, match="act_quant: unsupported value 'int4'"):
        BuildConfig(weight_only="int8", act_quant="int4").validated()
    assert BuildConfig(weight_only="int4", act_quant="int8").validated().act_quant == "int8"


def test_the_build_command_refuses_act_quant_without_weight_only(checkpoint, tmp_path, capsys):
    assert build_main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "e"), "--act-quant", "int8"]) == 2
    assert "act_quant" in capsys.readouterr().err


def test_the_build_refuses_widths_that_are_not_whole_blocks(tmp_path, capsys):
    """An intermediate size of 80 (not a multiple of 32): refused when the engine is built, naming the
    field, instead of writing an engine whose every load fails (int4 refuses it too, naming group_size)."""
    make_checkpoint(tmp_path / "ckpt", "llama", intermediate_size=80)
    argv = ["--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "e"), "--weight-only", "int8"]
    assert build_main(argv + ["--act-quant", "int8"]) == 2
    assert "act_quant: 'int8' quantizes activations per block of 32 columns; the model's intermediate_size 80" \
        in capsys.readouterr().err
    assert not (tmp_path / "e" / "engine.json").exists()
    assert build_main(argv) == 0   # exact activations: the same model builds


def test_recorded_in_engine_json_and_older_engines_load(checkpoint, tmp_path):
    build_engine(checkpoint, tmp_path / "act", weight_only="int4", act_quant="int8")
    engine = Engine.from_dir(tmp_path / "act")
    assert engine.build_config.act_quant == "int8"
    assert QuantMode(engine.model_config.quant_mode) & QuantMode.ACTIVATIONS
    with open(tmp_path / "act" / "engine.json") as f:
        recorded = json.load(f)
    assert recorded["build"]["act_quant"] == "int8"
    # an engine directory written before the field existed: weight-only, exact activations
    del recorded["build"]["act_quant"]
    with open(tmp_path / "act" / "engine.json", "w") as f:
        json.dump(recorded, f)
    older = Engine.from_dir(tmp_path / "act")
    assert older.build_config.act_quant is None
    assert not QuantMode(older.model_config.quant_mode) & QuantMode.ACTIVATIONS


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 9, 40])
def test_quantized_linear_runs_the_reference_arithmetic(fmt, rows):
    if aq.act_quant_ops() is None:
        pytest.skip("the act-quant kernels cannot run here")
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(72, 96, generator=gen)
    parts = quantize_int8(weight) + (None,) if fmt == "int8" else quantize_int4(weight, 32)
    bias = torch.randn(72, generator=gen)
    linear = QuantizedLinear(*parts, bias, act_quant="int8")
    assert linear.act_kernel is not None
    x = torch.randn(rows, 96, generator=gen)
    expected = aq.int8_act_linear_reference(x, *parts, bias)
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-4)
    residual = torch.randn(rows, 72, generator=gen)
    torch.testing.assert_close(linear.add_to(x, residual.clone()), residual + expected, rtol=1e-5, atol=1e-4)


def test_logits_stay_near_the_exact_weight_only_model(checkpoint):
    """Activations rounded to 8 bits per block move the logits a little, not the model."""
    tokens = [3, 9, 27, 81 % 128, 5, 7]
    logits = {}
    for act_quant in (None, "int8"):
        engine = Engine.from_dir(checkpoint, tokens_per_block=4, weight_only="int8", act_quant=act_quant)
        runner = ModelRunner(engine, 4)
        logits[act_quant] = runner.forward(step_inputs([(tokens, 0, [0, 1])], True))["context_logits"]
    error = (logits["int8"] - logits[None]).abs().max() / logits[None].abs().max()
    assert 0 < error < 0.05


def test_a_tier_the_environment_names_but_cannot_run_is_a_config_error(checkpoint, monkeypatch):
    if aq.act_quant_ops() is None:
        pytest.skip("the act-quant kernels cannot run here")
    engine = Engine.from_dir(checkpoint, weight_only="int8", act_quant="int8")
    monkeypatch.setenv(isa_tiers.ENV_VAR, "avx1024")
    with pytest.raises(ConfigError, match=f"^{isa_tiers.ENV_VAR}: unknown ISA tier 'avx1024'"):
        ModelRunner(engine, 4)


@pytest.mark.parametrize("fmt,group_size", [("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128)])
def test_packed_rows_equal_the_stored_rows(fmt, group_size):
    """A tied table's lookup reads the repacked copy: the same float32 rows as the stored one."""
    gen = torch.Generator().manual_seed(group_size)
    weight = torch.randn(37, 256, generator=gen)   # 37: a last unit of 16 rows partly padding
    parts = quantize_int8(weight) + (None,) if fmt == "int8" else quantize_int4(weight, group_size)
    stored = QuantizedLinear(*parts, None).format.dequantize(*(p for p in parts if p is not None))
    ids = torch.tensor([0, 36, 15, 16, 5, 5, 31, 32])
    assert torch.equal(aq.packed_rows(aq.pack(*parts), ids), stored[ids])


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_repacked_weight_replaces_the_stored_one(tmp_path, fmt):
    """act_quant: the model holds the repacked weights only; the tied table's lookup reads the
    head's copy and gives the stored table's rows."""
    if aq.act_quant_ops() is None:
        pytest.skip("the act-quant kernels cannot run here")
    make_checkpoint(tmp_path, "qwen2")  # ties lm_head to the embeddings
    engine = Engine.from_dir(tmp_path, tokens_per_block=4, weight_only=fmt, group_size=32, act_quant="int8")
    runner = ModelRunner(engine, 4)
    model = runner.model
    stored = {t.data_ptr() for name, t in engine.weights.items() if name.startswith(("embed_tokens", "layers."))
              and t.dim() == 2}
    held = model.weight_tensors()
    assert not stored & {t.data_ptr() for t in held}
    packed = [model.lm_head.packed, *(linear.packed for linear in model.linears.values())]
    packed_bytes = sum(t.numel() * t.element_size() for p in packed for t in (p.packed, p.scale, p.minimum)
                       if t is not None)
    other_bytes = sum(t.numel() * t.element_size() for name, t in model.w.items() if "norm" in name or "bias" in name)
    assert sum(t.numel() * t.element_size() for t in held) == packed_bytes + other_bytes
    ids = torch.tensor([0, 3, 17, engine.model_config.vocab_size - 1])
    weight_format = model.embed_format
    expected = weight_format.dequantize(*(engine.weights[n][ids] for n in
                                          ["embed_tokens", *("embed_tokens" + s for s in weight_format.suffixes)]))
    assert torch.equal(model._embed(ids).float(), expected.to(model.dtype).float())
