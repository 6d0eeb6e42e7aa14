"""samples.benchmark on a tiny model: datasets, arrivals, streaming, reports, plot, hf baseline."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from samples.benchmark import cli as benchmark
from samples.benchmark.dataset import LengthDistribution, Sample, arrival_delays_s, load_dataset, save_dataset
from samples.benchmark.plot import have_matplotlib
from samples.benchmark.report import RequestTiming, RunResult, metrics, percentile

SMALL = ["--num-samples", "10", "--prompt-len", "uniform:3:30", "--output-len", "uniform:2:8", "--warm-up", "1",
         "--no-progress", "--no-roofline"]
LEGACY_KEYS = ["num_samples", "num_error_samples", "total_latency(ms)", "seq_throughput(seq/sec)",
               "token_throughput(token/sec)"] + [f"{s}_sequence_latency(ms)" for s in
                                                ("avg", "max", "min", "p99", "p90", "p50")]
STREAMING_KEYS = [f"{s}_{name}(ms)" for name in ("time_to_first_token", "inter_token_latency")
                  for s in ("avg", "max", "min", "p99", "p90", "p50")]


def test_percentile_is_the_legacy_index():
    values = list(range(1, 101))
    assert [percentile(values, p) for p in (50, 90, 99)] == [50, 90, 99]
    assert percentile([7.0], 99) == 7.0 and percentile([1, 2, 3], 50) == 2


def test_metrics_and_inter_token_latency():
    result = RunResult("ours", [RequestTiming(0.0, 5, 0.1, 0.5), RequestTiming(0.2, 3, 0.4, 0.6),
                                RequestTiming(0.3, error="bad")], total_s=1.0, is_streaming=True)
    m = metrics(result)
    assert m["num_samples"] == 3 and m["num_error_samples"] == 1
    assert m["token_throughput(token/sec)"] == 8.0 and m["seq_throughput(seq/sec)"] == 2.0
    assert m["max_inter_token_latency(ms)"] == pytest.approx(100.0)   # (0.5 - 0.1) / 4
    assert m["min_time_to_first_token(ms)"] == pytest.approx(100.0)


def test_synthetic_lengths_and_poisson_arrivals_are_seeded():
    dist = LengthDistribution.parse("--prompt-len", "uniform:16:256")
    rng = random.Random(0)
    draws = [dist.draw(rng, 2047) for _ in range(2000)]
    assert min(draws) >= 16 and max(draws) <= 256
    samples = [Sample([5], 4)] * 2000
    gaps = arrival_delays_s(samples, 20.0, seed=3)
    assert gaps == arrival_delays_s(samples, 20.0, seed=3)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20.0, rel=0.1)
    assert arrival_delays_s([Sample([5], 4, 0.25)], None, 0) == [0.25]
    with pytest.raises(ValueError, match="--prompt-len"):
        LengthDistribution.parse("--prompt-len", "zipf:2")


def test_ours_synthetic_offline_json(tiny_model_dirs, tmp_path):
    out = tmp_path / "out.json"
    report = benchmark.main(["--engine-dir", tiny_model_dirs[1], "--backend", "ours", *SMALL,
                             "--output-json", str(out), "--save-dataset", str(tmp_path / "w.json")])
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(report))
    ours = written["ours"]
    assert all(k in ours for k in LEGACY_KEYS) and not any(k in ours for k in STREAMING_KEYS)
    assert ours["num_samples"] == 10 and ours["num_error_samples"] == 0
    dataset = load_dataset(tmp_path / "w.json")
    assert ours["num_output_tokens"] == sum(s.output_len for s in dataset)
    assert ours["num_iterations"] >= max(s.output_len for s in dataset)


def test_ours_legacy_dataset_streaming_with_delays(tiny_model_dirs, tmp_path, capsys):
    path = tmp_path / "legacy.json"
    save_dataset([Sample([5 + i, 6, 7], 3 + i % 4, 0.01) for i in range(6)], path)
    report = benchmark.main(["--engine-dir", tiny_model_dirs[1], "--backend", "ours", "--dataset", str(path),
                             "--streaming", "--warm-up", "0", "--no-progress", "--roofline-reps", "1"])
    ours = report["ours"]
    assert all(k in ours for k in LEGACY_KEYS + STREAMING_KEYS)
    assert ours["num_samples"] == 6 and ours["num_output_tokens"] == sum(3 + i % 4 for i in range(6))
    assert ours["total_latency(ms)"] >= 50          # five 10 ms gaps between arrivals
    assert 0 < ours["token_throughput_of_roofline"] < 1 and ours["roofline_gflops"] > 0
    text = capsys.readouterr().out
    assert "[BENCHMARK] p99_time_to_first_token(ms)" in text and "dataset's delays" in text


def test_poisson_arrivals(tiny_model_dirs):
    report = benchmark.main(["--engine-dir", tiny_model_dirs[1], "--backend", "ours", *SMALL,
                             "--request-rate", "200", "--seed", "1", "--streaming"])
    assert report["ours"]["num_error_samples"] == 0 and "p90_inter_token_latency(ms)" in report["ours"]


def test_both_backends_ratio_and_plot(tiny_model_dirs, tmp_path, capsys):
    png = tmp_path / "bench.png"
    report = benchmark.main(["--engine-dir", tiny_model_dirs[0], "--backend", "both", *SMALL, "--streaming",
                             "--hf-batch-size", "4", "--plot", str(png)])
    assert report["hf"]["num_samples"] == 10 and report["hf"]["num_error_samples"] == 0
    assert report["hf"]["num_output_tokens"] == report["ours"]["num_output_tokens"]  # same useful tokens
    assert report["hf"]["padded_token_throughput(token/sec)"] >= report["hf"]["token_throughput(token/sec)"]
    assert report["ratio_ours_to_hf"] == pytest.approx(
        report["ours"]["token_throughput(token/sec)"] / report["hf"]["token_throughput(token/sec)"])
    assert "x\n" in capsys.readouterr().out
    if have_matplotlib():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hf_backend_refuses_an_engine_dir(tiny_model_dirs):
    with pytest.raises(ValueError, match="Hugging Face checkpoint"):
        benchmark.main(["--engine-dir", tiny_model_dirs[1], "--backend", "hf", *SMALL])


def test_bad_dataset_names_the_field(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"samples": [{"input_ids": [1, 2], "output_len": 0}]}))
    with pytest.raises(ValueError, match=r"samples\[0\].output_len"):
        load_dataset(path)


def test_both_apis_in_one_run(tiny_model_dirs):
    report = benchmark.main(["--engine-dir", tiny_model_dirs[1], "--backend", "ours", "--api", "both",
                             "--streaming", *SMALL])
    for key in ("ours", "executor"):
        assert all(k in report[key] for k in LEGACY_KEYS + STREAMING_KEYS)
        assert report[key]["num_samples"] == 10 and report[key]["num_error_samples"] == 0
        assert report[key]["num_iterations"] > 0
    assert report["ratio_executor_to_gpt_manager"] == pytest.approx(
        report["executor"]["token_throughput(token/sec)"] / report["ours"]["token_throughput(token/sec)"])


def test_executor_quickstart(tiny_model_dirs):
    from samples import executor_quickstart
    out = executor_quickstart.main(["--model", tiny_model_dirs[1], "--requests", "3", "--max-tokens", "4",
                                    "--ttft-repeats", "2"])
    assert [len(t) for t in out["tokens"].values()] == [4, 4, 4]
    assert len(out["idle_ttft_s"]) == 2 and all(0 < t < 10 for t in out["idle_ttft_s"])


def test_dtype_builds_a_bf16_engine_with_the_tokenizer_files(tiny_model_dirs, tmp_path):
    engine_dir = tmp_path / "engine"
    shutil.copytree(tiny_model_dirs[1], engine_dir)
    (engine_dir / "tokenizer.json").write_text("{}")
    converted = Path(benchmark.with_dtype(str(engine_dir), "bfloat16"))
    assert json.loads((converted / "engine.json").read_text())["model"]["dtype"] == "bfloat16"
    assert (converted / "tokenizer.json").read_text() == "{}"
    report = benchmark.main(["--engine-dir", tiny_model_dirs[1], "--backend", "ours", *SMALL, "--dtype", "bfloat16"])
    assert report["ours"]["num_error_samples"] == 0


def test_the_default_models_dtype_follows_the_measured_rule():
    from samples.default_model import preferred_dtype
    assert preferred_dtype(frozenset({"avx512f", "amx_bf16", "avx512_bf16"}), "GenuineIntel")[0] == "bfloat16"
    assert preferred_dtype(frozenset({"avx512f", "avx512_bf16"}), "AuthenticAMD")[0] == "bfloat16"
    assert preferred_dtype(frozenset({"avx512f", "avx512_bf16"}), "GenuineIntel")[0] == "float32"
    assert preferred_dtype(frozenset({"avx2", "fma"}), "AuthenticAMD")[0] == "float32"
