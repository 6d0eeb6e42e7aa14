"""samples.microbench.kv_events_flood's harness on its quiet path (no attack): both PUB endpoints it
compares, ours and the libzmq XPUB with ZMQ_XPUB_MANUAL, deliver every message to an honest
subscriber, so the figures it prints under attack compare like with like."""
from __future__ import annotations

import pytest

from samples.microbench import kv_events_flood


@pytest.mark.parametrize("make", [kv_events_flood._ours, kv_events_flood._xpub_manual], ids=["ours", "xpub-manual"])
def test_the_quiet_path_delivers_every_message(make):
    endpoint = kv_events_flood._endpoint()
    send, close = make(endpoint)
    try:
        total_s, worst_ms, received, _ = kv_events_flood._pub_attack(send, endpoint, None, 0.0)
    finally:
        close()
    assert received == 50 and worst_ms <= total_s * 1000
