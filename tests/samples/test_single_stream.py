"""samples.microbench.single_stream runs end to end: its per-token figures come from the steps the
manager really runs (it once wrapped ModelRunner.forward after the executor had moved to launch,
and had no forward time to report)."""
from __future__ import annotations

from samples.microbench import single_stream


def test_the_stream_and_its_forward_are_timed(capsys):
    figures = single_stream.main(["--random-model", "--num-requests", "2", "--threads", "1"])
    assert figures["tokens_per_s"] > 0
    assert 0 < figures["forward_ms"] <= figures["execute_ms"]
    assert figures["gap_ms"] > 0
    assert "runtime alone" in capsys.readouterr().out
