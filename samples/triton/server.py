"""Runs Triton Inference Server (the nvidia-pytriton wheel's binary) over a model repository, on
loopback ports, as a child process: start, wait until the models are ready, stop (drain, SIGTERM,
and SIGKILL past a bound), and what its exit status means."""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request

from samples.triton.environment import ServerEnvironment
from samples.triton.repository import drain_file, drained_file

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
EXIT_TIMEOUT_S = 20     # Triton's own: how long it waits for requests in flight once it is asked to exit
KILL_MARGIN_S = 30      # a server still running this long after its exit timeout is killed
KILLED_AFTER_TIMEOUT = 124   # the launcher's exit code then (as timeout(1) says it)
MAX_DRAINED_GRACE_S = 10     # after the model drained: how long Triton may take to exit on its own
DRAIN_WAIT_S = 10       # after the drain file: how long SIGTERM waits for the model's drained file


@dataclasses.dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002


def server_command(env: ServerEnvironment, repository: str, ports: Ports, log_verbose: int = 0,
                   exit_timeout_s: int = EXIT_TIMEOUT_S) -> list[str]:
    return [env.server_binary, f"--model-repository={repository}", f"--backend-directory={env.backend_dir}",
            f"--http-address={HOST}", f"--http-port={ports.http}", f"--grpc-address={HOST}",
            f"--grpc-port={ports.grpc}", "--allow-metrics=true", f"--metrics-address={HOST}",
            f"--metrics-port={ports.metrics}", "--allow-gpu-metrics=false", "--allow-cpu-metrics=false",
            f"--log-verbose={log_verbose}", f"--exit-timeout-secs={exit_timeout_s}", "--disable-auto-complete-config"]


def exit_code(return_code: int) -> int:
    """A child's return code as a shell exit code: a death by signal N is 128 + N."""
    return 128 - return_code if return_code < 0 else return_code


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launcher dies (it is in a session of its own,
    so a terminal's Ctrl-C reaches the launcher only, which drains first)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


class TritonServer:
    def __init__(self, env: ServerEnvironment, repository: str, ports: Ports = Ports(), log_file=None,
                 exit_timeout_s: int = EXIT_TIMEOUT_S):
        self.ports = ports
        self.repository = repository
        self.exit_timeout_s = exit_timeout_s
        self.process = subprocess.Popen(server_command(env, repository, ports, exit_timeout_s=exit_timeout_s),
                                        env=env.process_env(), stdout=log_file,
                                        stderr=subprocess.STDOUT if log_file else None,
                                        start_new_session=True, preexec_fn=_die_with_parent)
        self._stop_deadline_s: float | None = None
        self.drain_wait_s = DRAIN_WAIT_S
        self._drain_since_s: float | None = None   # when the drain file was written
        self._is_terminated = False                # SIGTERM sent

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

    @property
    def is_stopping(self) -> bool:
        return self._stop_deadline_s is not None

    def request_stop(self) -> None:
        """The drain file: the tensorrt_llm model ends its live requests with a final response
        within a check period, answers the waiting ones with an error, and writes its drained file.
        wait() then sends SIGTERM (once the drained file is there, at most drain_wait_s on): Triton
        unloads the models (each GptManager shuts down) and exits. Every final response is handed
        to Triton before it starts shutting down: with SIGTERM sent at once, a stream could break
        with a final response still on its way (seen once under load). Once: a second call only
        logs. Async-signal-safe enough for a signal handler (a file and a few attributes); the
        caller is in wait(), or calls it next."""
        if self._stop_deadline_s is not None:
            logger.info("tritonserver is stopping already (killed %.0f s from now if still running)",
                        self._stop_deadline_s - time.monotonic())
            return
        now_s = time.monotonic()
        self._stop_deadline_s = now_s + self.drain_wait_s + self.exit_timeout_s + KILL_MARGIN_S
        if self.process.poll() is None:
            with open(drain_file(self.repository), "w"):
                pass
            self._drain_since_s = now_s

    def _terminate_once_drained(self, now_s: float) -> None:
        if self._drain_since_s is None or self._is_terminated:
            return
        if os.path.exists(drained_file(self.repository)) or now_s - self._drain_since_s > self.drain_wait_s:
            self._is_terminated = True
            self.process.send_signal(signal.SIGTERM)

    def wait(self, poll_s: float = 0.1) -> int:
        """Until the server exits. Once a stop was requested: SIGTERM once the model drained (see
        request_stop); when the model has answered every request (its drained file) and Triton
        has not exited within a grace, the server is
        stopped with SIGKILL (see the NOTE) and that is a clean stop; without the drained file,
        at most the exit timeout plus a margin, then SIGKILL. -> the launcher's exit code: 0 for
        a clean stop, the server's own status (128 + N for signal N) when it failed,
        KILLED_AFTER_TIMEOUT when it had to be killed before everything was answered."""
        # NOTE: Triton 2.51 unloads a model only once no client stream that sent it a request is
        # open, and closes its endpoints only after the unload; past its exit timeout it calls
        # exit() with its threads running, which hangs or corrupts the heap. So with a client's
        # stream open a clean exit never comes; once every request is answered nothing is lost
        # by ending the server's processes (the backend stub too: it is in the server's group).
        grace_s = min(MAX_DRAINED_GRACE_S, self.exit_timeout_s / 2)
        drained_since_s = None
        while self.process.poll() is None:
            now_s = time.monotonic()
            self._terminate_once_drained(now_s)
            if drained_since_s is None and self.is_stopping and os.path.exists(drained_file(self.repository)):
                drained_since_s = now_s
            if drained_since_s is not None and now_s - drained_since_s > grace_s:
                logger.warning("every request was answered but tritonserver did not exit within %.0f s (a client's "
                               "stream or connection still open can hold its models): stopped with SIGKILL", grace_s)
                self._kill()
                return 0
            if self.is_stopping and now_s > self._stop_deadline_s:
                logger.error("tritonserver still running %d s after its exit timeout: killed", KILL_MARGIN_S)
                self._kill()
                return KILLED_AFTER_TIMEOUT
            time.sleep(poll_s)
        if self.process.returncode != 0:
            logger.error("tritonserver exited with status %d", exit_code(self.process.returncode))
        return exit_code(self.process.returncode)

    def _kill(self) -> None:
        """SIGKILL to the server's process group: tritonserver and its backend stubs."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def stop(self) -> int:
        """request_stop, then wait (bounded). -> wait's exit code."""
        self.request_stop()
        return self.wait()
