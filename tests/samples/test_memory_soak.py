"""samples.memory_soak on the tiny engine: a few rounds, every request answered, the report's shape
(RSS figures are reported, not asserted: they depend on the machine)."""
from __future__ import annotations

import json

import pytest

from samples.memory_soak import RoundFeed, Workload, levelled_off, main, run_soak, vocab_size_of


def test_rounds_answer_every_request_and_report_rss(tiny_model_dirs):
    engine_dir = tiny_model_dirs[1]
    seen = []
    workload = Workload(num_requests=12, max_prompt_len=40, max_new_tokens=12, max_arrivals=4, vocab_size=128)
    report = run_soak(engine_dir, 3, workload, seed=1, on_round=seen.append)
    assert [r["round"] for r in report["rounds"]] == [0, 1, 2] and seen == report["rounds"]
    for r in report["rounds"]:
        assert r["requests"] == r["answered"] == 12 and r["num_errors"] == 0
        assert 12 <= r["generated_tokens"] <= 12 * 12 and r["rss_mib"] > 0
    assert report["unanswered"] == 0 and report["num_errors"] == 0
    assert report["rss_per_round_mib"] == [r["rss_mib"] for r in report["rounds"]]
    assert report["growth_last_half_mib"] == round(report["rss_per_round_mib"][-1] - report["rss_per_round_mib"][1], 1)
    assert report["levelled_off"] == (report["growth_last_half_mib"] <= report["tolerance_mib"])


def test_level_off_compares_the_middle_round_with_the_last():
    assert levelled_off([300.0, 400.0, 410.0, 412.0], 16.0) == (True, 2.0)
    assert levelled_off([300.0, 310.0, 330.0, 350.0], 16.0) == (False, 20.0)
    with pytest.raises(ValueError, match="num_rounds: need at least 2 to see a trend, got 1"):
        run_soak("unused", 1, Workload(1, 1, 1, 1, 128), seed=0)


def test_cli_writes_the_report(tiny_model_dirs, tmp_path, capsys):
    hf_dir, engine_dir, _ = tiny_model_dirs
    assert vocab_size_of(hf_dir) == vocab_size_of(engine_dir) == 128
    out = tmp_path / "soak.json"
    assert main(["--engine-dir", engine_dir, "--rounds", "2", "--requests", "6", "--max-prompt-len", "40",
                 "--max-new-tokens", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["rss_per_round_mib"]) == 2 and report["unanswered"] == 0
    printed = capsys.readouterr().out
    assert "last half of the rounds" in printed and "unanswered: 0, errors: 0" in printed


def test_a_round_that_times_out_ends_the_soak_with_its_requests_unanswered(tiny_model_dirs):
    """Late answers of a timed-out round are counted, not routed to a finished round (they once raised)."""
    feed = RoundFeed()
    feed.send(7, [], True, "")
    assert feed.num_stray_responses == 1 and feed.get(8) == []
    workload = Workload(num_requests=20, max_prompt_len=40, max_new_tokens=12, max_arrivals=4, vocab_size=128)
    report = run_soak(tiny_model_dirs[1], 3, workload, seed=2, round_timeout_s=0.01)
    assert len(report["rounds"]) == 1 and report["levelled_off"] is False
    assert report["unanswered"] == 20 * 3 - report["rounds"][0]["answered"] > 20
