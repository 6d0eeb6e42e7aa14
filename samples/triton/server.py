"""Runs Triton Inference Server (the nvidia-pytriton wheel's binary) over a model repository, on
loopback ports, as a child process: start, wait until the models are ready, stop."""
from __future__ import annotations

import dataclasses
import logging
import signal
import subprocess
import time
import urllib.error
import urllib.request

from samples.triton.environment import ServerEnvironment
from samples.triton.repository import drain_file

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002


def server_command(env: ServerEnvironment, repository: str, ports: Ports, log_verbose: int = 0) -> list[str]:
    return [env.server_binary, f"--model-repository={repository}", f"--backend-directory={env.backend_dir}",
            f"--http-address={HOST}", f"--http-port={ports.http}", f"--grpc-address={HOST}",
            f"--grpc-port={ports.grpc}", "--allow-metrics=true", f"--metrics-address={HOST}",
            f"--metrics-port={ports.metrics}", "--allow-gpu-metrics=false", "--allow-cpu-metrics=false",
            f"--log-verbose={log_verbose}", "--exit-timeout-secs=20", "--disable-auto-complete-config"]


class TritonServer:
    def __init__(self, env: ServerEnvironment, repository: str, ports: Ports = Ports(), log_file=None):
        self.ports = ports
        self.repository = repository
        self.process = subprocess.Popen(server_command(env, repository, ports), env=env.process_env(),
                                        stdout=log_file, stderr=subprocess.STDOUT if log_file else None)

    @property
    def http_url(self) -> str:
        return f"{HOST}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{HOST}:{self.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://{HOST}:{self.ports.metrics}/metrics"

    def wait_ready(self, models: list[str], timeout_s: float = 300.0) -> None:
        """Until every model answers ready; a server that exits first is a RuntimeError."""
        deadline_s = time.monotonic() + timeout_s
        pending = list(models)
        while pending:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.process.returncode} before its models were ready")
            if time.monotonic() > deadline_s:
                raise TimeoutError(f"models not ready after {timeout_s:.0f} s: {pending}")
            try:
                with urllib.request.urlopen(f"http://{self.http_url}/v2/models/{pending[0]}/ready", timeout=2):
                    pending.pop(0)
                    continue
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)

    def request_stop(self) -> None:
        """The drain file first (the tensorrt_llm model ends its live requests with a final
        response within a check period), then SIGTERM: Triton waits for the requests in flight,
        unloads the models (each GptManager shuts down) and exits. Without the drain, requests
        still in flight at Triton's exit timeout crash the server's exit."""
        if self.process.poll() is None:
            with open(drain_file(self.repository), "w"):
                pass
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 60.0) -> int:
        """request_stop, then SIGKILL after the timeout."""
        if self.process.poll() is None:
            self.request_stop()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("tritonserver did not stop within %.0f s: killed", timeout_s)
                self.process.kill()
                self.process.wait()
        return self.process.returncode
