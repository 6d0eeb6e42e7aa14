"""The chaos soak's KV-events round (samples.chaos_soak.kv_events_round) on its own: honest
requests served while hostile peers flood subscriptions and one never reads; every check holds."""
from __future__ import annotations

from samples.chaos_soak.kv_events_round import HOSTILE_MODES, kv_events_violations, run_kv_events_round
from samples.chaos_soak.soak import POOL_TOKENS, make_engine


def test_kv_events_round_serves_every_request_under_hostile_subscribers(tmp_path):
    report = run_kv_events_round(make_engine(str(tmp_path)), POOL_TOKENS, 24, seed=1)
    assert kv_events_violations(report) == [], report
    assert report["served"] == report["submitted"] >= 24 and report["errors"] == 0
    assert report["hostile_exit_codes"] == [0] * len(HOSTILE_MODES)
    assert report["received"] > 0 and report["missed_live"] == 0 and report["replay_complete"]
    assert report["published"] >= report["received"]
