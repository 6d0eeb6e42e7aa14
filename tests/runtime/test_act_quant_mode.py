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
