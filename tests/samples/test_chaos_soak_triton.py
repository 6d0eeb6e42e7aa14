"""The chaos soak's Triton round (samples.chaos_soak.triton_round) on its own: clients that stop
requests (also ones still waiting for a slot) and clients that disconnect mid-stream, then a
shutdown with requests live and queued; nothing is lost."""
from __future__ import annotations

from samples.chaos_soak.soak import POOL_TOKENS, make_engine
from samples.chaos_soak.triton_round import run_triton_round, triton_violations
from tests.samples.triton_support import skip_without_triton


def test_triton_round_answers_every_request_of_the_clients_that_stay(tmp_path):
    skip_without_triton()
    report = run_triton_round(make_engine(str(tmp_path)), POOL_TOKENS, 36, num_clients=4, seed=3)
    assert triton_violations(report) == [], report
    stayed = [c for c in report["clients"] if not c["disconnected"]]
    assert stayed and any(c["disconnected"] for c in report["clients"])   # client 1 disconnects
    assert sum(c["served"] for c in stayed) == sum(c["submitted"] for c in stayed)
    assert sum(c["stopped"] for c in stayed) > 0
    assert report["shutdown"]["not_started"] > 0 and report["shutdown"]["exit_code"] == 0
