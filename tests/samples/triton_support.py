"""What the Triton tests share: skip where the nvidia-pytriton wheel cannot run or be prepared,
and the server started once per module."""
from __future__ import annotations

import contextlib

import pytest


def skip_without_triton() -> None:
    """Skips the calling module where Triton cannot run: another OS or CPU architecture, no
    client library, or a side environment that could not be installed (no network)."""
    pytest.importorskip("tritonclient.grpc", reason="tritonclient is not installed (the test extra has it)")
    from samples.triton.environment import TritonUnavailableError, prepare, unsupported_reason
    reason = unsupported_reason()
    if reason:
        pytest.skip(reason)
    try:
        prepare()
    except TritonUnavailableError as e:
        pytest.skip(f"Triton cannot run here: {e}")


@contextlib.contextmanager
def module_server(tmp_path_factory, engine_dir: str, options=None):
    from samples.triton.repository import RepositoryOptions
    from samples.triton.testing import running_server
    repository = str(tmp_path_factory.mktemp("triton-repository"))
    with running_server(repository, engine_dir, options or RepositoryOptions()) as server:
        yield server


def metric_values(server, family: str) -> dict[str, float]:
    """type label value -> value of one `nv_trt_llm_*` family on the server's metrics port."""
    from samples.triton.testing import metric_values as read
    return read(server.metrics_url, family)
