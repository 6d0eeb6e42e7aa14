"""Tensor and pipeline parallelism across two network namespaces (two "hosts" on this machine,
each with its own hostname and address, joined by a veth pair): the ranks talk TCP between them,
the same-host shared-memory all-reduce switches itself off, and the tokens equal one process."""
from __future__ import annotations

import subprocess

import pytest

from samples import two_hosts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return two_hosts.write_checkpoint(str(tmp_path_factory.mktemp("two_hosts") / "model"))


@pytest.mark.parametrize("mode", ["tp", "pp"])
def test_two_ranks_on_two_hosts_match_one_process(checkpoint, mode):
    from runtime import WorldConfig
    try:
        reports = two_hosts.run_two_hosts(checkpoint, mode)
    except two_hosts.NamespacesUnavailable as e:
        pytest.skip(f"cannot make network namespaces here (needs root and iproute2): {e}")
    expected, _ = two_hosts.generate(checkpoint, WorldConfig())
    assert [r["results"] for r in reports] == [expected, expected]
    assert len({r["host"] for r in reports}) == 2            # two hostnames
    assert [r["shared_memory"] for r in reports] == [False, False]
    leftovers = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert two_hosts.TwoHosts().tag not in leftovers          # removed at the end
