"""A Triton server for the benchmark, the chaos soak and the tests: the repository written, the
server started on free loopback ports with its log in the repository directory, stopped on
leaving; and its `nv_trt_llm_*` gauges read back."""
from __future__ import annotations

import contextlib
import os
import socket
import urllib.request

from samples.triton.environment import prepare
from samples.triton.repository import RepositoryOptions, write_repository
from samples.triton.server import HOST, Ports, TritonServer


def free_ports(num: int) -> list[int]:
    sockets = [socket.socket() for _ in range(num)]
    try:
        for s in sockets:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@contextlib.contextmanager
def running_server(repository: str, engine_dir: str, options: RepositoryOptions = RepositoryOptions(),
                   timeout_s: float = 300.0):
    env = prepare()
    models = write_repository(repository, engine_dir, env.python_path, options)
    log_path = os.path.join(repository, "tritonserver.log")
    with open(log_path, "wb") as log_file:
        server = TritonServer(env, repository, Ports(*free_ports(3)), log_file=log_file)
        try:
            try:
                server.wait_ready(models, timeout_s)
            except (RuntimeError, TimeoutError) as e:
                with open(log_path, errors="replace") as f:
                    raise RuntimeError(f"{e}; server log:\n{f.read()[-4000:]}") from None
            server.log_path = log_path
            yield server
        finally:
            server.stop()


def metric_values(metrics_url: str, family: str) -> dict[str, float]:
    """type label value -> value of one `nv_trt_llm_*` family on the metrics port."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith(family + "{"):
            labels, value = line[len(family) + 1:].rsplit("} ", 1)
            label_map = dict(part.split("=", 1) for part in labels.split(","))
            type_value = [v.strip('"') for k, v in label_map.items() if k not in ("model", "version")][0]
            values[type_value] = float(value)
    return values
