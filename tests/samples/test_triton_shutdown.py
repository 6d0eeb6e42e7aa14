"""`python -m samples.triton` stopping: SIGTERM with more requests than slots and the client's
gRPC stream still open (every request gets exactly one final response, none starts after the
drain, the server exits in bounded time, exit code 0), and the launcher's exit code for a server
that dies or hangs while it stops. Tiny random-weight engine with 4 slots."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from runtime import build_engine
from tests.factories import make_checkpoint
from tests.samples.triton_support import skip_without_triton

LONG = 900
PROMPT = [3, 10, 17, 24, 31]
EXIT_TIMEOUT_S = 5
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    skip_without_triton()
    root = tmp_path_factory.mktemp("triton-shutdown-engine")
    make_checkpoint(root / "hf", "llama", max_position_embeddings=1024)
    build_engine(root / "hf", root / "engine", tokens_per_block=4, max_batch_size=4, max_input_len=16,
                 max_seq_len=1024, max_num_tokens=64)
    return str(root / "engine")


class Launcher:
    """The command in a child process, read until it says it serves."""

    def __init__(self, engine_dir: str, repository: str):
        from samples.triton.testing import free_ports
        http_port, self.grpc_port, metrics_port = free_ports(3)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "samples.triton", "--engine-dir", engine_dir, "--model-repository", repository,
             "--http-port", str(http_port), "--grpc-port", str(self.grpc_port), "--metrics-port", str(metrics_port),
             "--exit-timeout-s", str(EXIT_TIMEOUT_S)],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        watchdog = threading.Timer(300, self.process.kill)   # never serving: a failure, not a hung run
        watchdog.start()
        try:
            for line in self.process.stdout:
                if line.startswith("serving:"):
                    break
        finally:
            watchdog.cancel()
        assert self.process.poll() is None, "the launcher exited before serving"
        self.server_pid = self._child_pid()

    def _child_pid(self) -> int:
        with open(f"/proc/{self.process.pid}/task/{self.process.pid}/children") as f:
            return int(f.read().split()[0])

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def close(self) -> None:
        for kill in (lambda: os.killpg(self.server_pid, signal.SIGKILL), lambda: os.kill(self.server_pid, signal.SIGKILL),
                     self.process.kill):
            try:
                kill()
            except ProcessLookupError:
                pass
        self.process.wait()


@pytest.fixture
def launcher(engine_dir, tmp_path):
    running = Launcher(engine_dir, str(tmp_path))
    yield running
    running.close()


def llm_inputs(*args, **kwargs):
    from samples.triton.client import llm_inputs
    return llm_inputs(*args, **kwargs)


def test_sigterm_answers_every_request_once_and_exits_with_the_stream_open(launcher):
    from samples.triton.client import StreamClient
    stream = StreamClient(launcher.grpc_url)
    ids = [str(i) for i in range(12)]
    for request_id in ids:
        stream.submit(request_id, llm_inputs(PROMPT, LONG, True))
    deadline_s = time.monotonic() + 60
    while sum(bool(stream.result(i).tokens) for i in ids) < 4:
        assert time.monotonic() < deadline_s, "four requests never started"
        time.sleep(0.01)
    time.sleep(0.2)
    launcher.process.send_signal(signal.SIGTERM)
    results = {request_id: stream.wait(request_id, 60) for request_id in ids}
    started = [i for i in ids if results[i].tokens]
    assert len(started) == 4, {i: (len(r.tokens), r.error) for i, r in results.items()}   # none after the drain
    for request_id, result in results.items():
        if request_id in started:
            assert result.error is None and len(result.tokens) < LONG
        else:
            assert "shutting down: the request was not started" in result.error, result.error
    assert stream.num_finals == {i: 1 for i in ids}
    try:   # the stream is still open while the server exits
        assert launcher.process.wait(EXIT_TIMEOUT_S + 60) == 0
    finally:
        stream.close()


def test_a_server_that_dies_while_stopping_is_a_failed_exit(launcher):
    launcher.process.send_signal(signal.SIGTERM)
    os.kill(launcher.server_pid, signal.SIGKILL)
    assert launcher.process.wait(60) == 128 + signal.SIGKILL


def test_a_server_that_hangs_while_stopping_is_killed_in_bounded_time(launcher):
    from samples.triton.server import KILL_MARGIN_S, KILLED_AFTER_TIMEOUT
    os.killpg(launcher.server_pid, signal.SIGSTOP)   # tritonserver and the model's stub: nothing drains
    launcher.process.send_signal(signal.SIGINT)
    assert launcher.process.wait(EXIT_TIMEOUT_S + KILL_MARGIN_S + 60) == KILLED_AFTER_TIMEOUT


# A stand-in for tritonserver: on SIGTERM it writes whether the model's drained file was there, then exits 0.
FAKE_SERVER = """
import os, signal, sys, time
def on_term(signum, frame):
    with open(sys.argv[2], "w") as f:
        f.write(str(os.path.exists(sys.argv[1])))
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("drains", [True, False])
def test_the_launcher_sends_sigterm_only_once_the_model_drained(tmp_path, drains):
    """request_stop writes the drain file; wait() sends SIGTERM once the model's drained file is
    there (every final response handed to Triton before it starts shutting down), or after
    drain_wait_s when it never comes. Needs no tritonserver."""
    from samples.triton.repository import drain_file, drained_file
    from samples.triton.server import TritonServer
    (tmp_path / "tensorrt_llm").mkdir()
    seen = tmp_path / "drained-at-sigterm"
    server = object.__new__(TritonServer)
    server.repository, server.exit_timeout_s = str(tmp_path), 5
    server.process = subprocess.Popen([sys.executable, "-c", FAKE_SERVER, drained_file(str(tmp_path)), str(seen)],
                                      stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert server.process.stdout.readline().strip() == "ready"
    server._stop_deadline_s, server._drain_since_s, server._is_terminated = None, None, False
    server.drain_wait_s = 1.0
    try:
        server.request_stop()
        assert os.path.exists(drain_file(str(tmp_path)))
        codes = []
        waiter = threading.Thread(target=lambda: codes.append(server.wait(poll_s=0.01)))
        waiter.start()
        time.sleep(0.3)
        assert server.process.poll() is None and not seen.exists()   # no SIGTERM while the model drains
        if drains:
            open(drained_file(str(tmp_path)), "w").close()
        waiter.join(10)
        assert codes == [0] and seen.read_text() == str(drains)
    finally:
        if server.process.poll() is None:
            server.process.kill()
        server.process.wait()
