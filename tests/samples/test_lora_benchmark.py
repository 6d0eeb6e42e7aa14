"""samples.benchmark.lora on a tiny engine: both passes serve every request; the report's figures."""
from __future__ import annotations

import json

from samples.benchmark.lora import main


def test_lora_benchmark_runs_both_passes(tiny_model_dirs, tmp_path):
    engine_dir = tiny_model_dirs[1]
    out = tmp_path / "lora.json"
    report = main(["--engine-dir", str(engine_dir), "--num-samples", "6", "--prompt-len", "uniform:4:12",
                   "--output-len", "uniform:2:6", "--num-adapters", "3", "--rank", "4", "--rounds", "1",
                   "--output-json", str(out)])
    assert json.loads(out.read_text()) == report
    assert len(report["base_s"]) == len(report["lora_s"]) == 1
    assert report["generated_tokens"] > 6 and report["lora_overhead_ratio"] > 0
