"""samples.microbench.guided runs end to end on small vocabularies and reports its figures."""
from __future__ import annotations

from samples.microbench.guided import main


def test_guided_microbench_reports_both_vocabularies():
    results = main(["--batch", "4", "--steps", "2", "--vocab-sizes", "600,1200"])
    assert set(results) == {"vocab 600", "vocab 1200"}
    for row in results.values():
        assert row["plain_step_ms"] > 0 and row["guided_step_ms"] > 0 and row["schema_compile_ms"] > 0
