"""`python -m samples.dynamo`: Dynamo's OpenAI frontend (`python -m dynamo.frontend`) and N workers
(`python -m samples.dynamo.worker`), each its own process, on loopback with file discovery (a
directory of this run's own), until SIGINT / SIGTERM; then every process is stopped (SIGTERM, then
SIGKILL after a grace period) and waited for. `Fleet` is the same, for tests and benchmarks."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from samples.dynamo.worker_args import free_port

logger = logging.getLogger(__name__)

STOP_GRACE_S = 20        # after SIGTERM, before SIGKILL (Dynamo's own drain is 5 s by default)


def loopback_env(discovery_dir: str) -> dict[str, str]:
    """The environment of every process of the set: file discovery in `discovery_dir`, request
    and event planes on loopback."""
    return dict(os.environ, DYN_FILE_KV=discovery_dir, DYN_TCP_RPC_HOST="127.0.0.1",
                DYN_EVENT_PLANE_HOST="127.0.0.1", DYN_HTTP_RPC_HOST="127.0.0.1",
                PYTHONPATH=os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH", "")] if p))


class Fleet:
    """The frontend and `num_workers` workers. `start` returns once the frontend lists the model
    with every worker registered (or raises, with the set stopped); `stop` ends them all."""

    def __init__(self, engine_dir: str, num_workers: int = 1, router_mode: str = "round-robin",
                 http_port: int = 8000, worker_args: list[str] | None = None, log_dir: str | None = None,
                 home: str | None = None, namespace: str = "dynamo", num_prefill_workers: int = 0):
        """num_prefill_workers: the first that many workers take Dynamo's prefill role, the others
        decode (0: every worker aggregated)."""
        self.engine_dir, self.num_workers, self.router_mode = engine_dir, num_workers, router_mode
        self.http_port = http_port or free_port()
        self.worker_args = list(worker_args or [])
        self._state_dir = tempfile.TemporaryDirectory(prefix="dynamo-fleet-")
        self.log_dir = log_dir or self._state_dir.name
        self.env = loopback_env(os.path.join(self._state_dir.name, "discovery"))
        # HOME of the frontend only (it copies model cards under $HOME/.cache/dynamo); the workers
        # keep theirs, where the engine's compiled kernels are cached
        self.home = home
        self.namespace = namespace
        if not 0 <= num_prefill_workers < max(num_workers, 1) or (num_prefill_workers and num_workers < 2):
            raise ValueError(f"num_prefill_workers: {num_prefill_workers} leaves no decode worker of {num_workers}")
        self.roles = ["agg"] * num_workers if not num_prefill_workers else \
            ["prefill"] * num_prefill_workers + ["decode"] * (num_workers - num_prefill_workers)
        self.processes: list[subprocess.Popen] = []
        self.kv_events_ports = [free_port() for _ in range(num_workers)]
        # each worker's /metrics and /health (Dynamo 1.6.1 reads DYN_SYSTEM_PORT as an i16)
        self.system_ports = [free_port(below=1 << 15) for _ in range(num_workers)]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log_path(self, name: str) -> str:
        return os.path.join(self.log_dir, f"{name}.log")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.log_path(name), "ab")
        try:
            process = subprocess.Popen([sys.executable, *argv], env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        finally:
            log.close()
        process.name = name
        self.processes.append(process)
        return process

    def start(self, timeout_s: float = 600) -> "Fleet":
        try:
            self._spawn("frontend", ["-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port",
                                     str(self.http_port), "--discovery-backend", "file", "--router-mode",
                                     self.router_mode, "--namespace", self.namespace],
                        self.env if self.home is None else dict(self.env, HOME=self.home))
            for i in range(self.num_workers):
                kv = ["--kv-events-port", str(self.kv_events_ports[i])] if self.router_mode == "kv" \
                    else ["--disable-kv-routing"]
                self._spawn(f"worker{i}", ["-m", "samples.dynamo.worker", "--engine-dir", self.engine_dir,
                                           "--discovery-backend", "file", "--namespace", self.namespace, *kv,
                                           "--disaggregation-mode", self.roles[i],
                                           *self.worker_args],
                            dict(self.env, DYN_SYSTEM_HOST="127.0.0.1", DYN_SYSTEM_PORT=str(self.system_ports[i])))
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for process in self.processes:
                if process.poll() is not None:
                    raise RuntimeError(f"{process.name} exited with {process.returncode} while starting "
                                       f"(log: {self.log_path(process.name)})")
            if self.num_ready_workers() >= self.num_workers:
                return
            time.sleep(1)
        raise TimeoutError(f"the frontend did not list {self.num_workers} workers within {timeout_s} s "
                           f"(logs in {self.log_dir})")

    def num_ready_workers(self) -> int:
        """Workers the frontend has registered: instances in the discovery directory's model entries
        once the model is listed at /v1/models."""
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as response:
                if b'"id"' not in response.read():
                    return 0
        except OSError:
            return 0
        return len(worker_instances(self.env["DYN_FILE_KV"], self.namespace))

    def describe(self) -> str:
        """What the set is: the frontend's URL, each process's pid, each worker's metrics and events."""
        lines = [f"serving {self.url}/v1 with {self.num_workers} worker(s), router {self.router_mode}; "
                 f"logs in {self.log_dir}", f"frontend pid {self.processes[0].pid}"]
        for i, process in enumerate(self.processes[1:]):
            events = f"tcp://127.0.0.1:{self.kv_events_ports[i]}" if self.router_mode == "kv" else "off"
            metrics = f"http://127.0.0.1:{self.system_ports[i]}/metrics"
            lines.append(f"worker{i} ({self.roles[i]}) pid {process.pid} metrics {metrics} "
                         f"kv events {events}")
        return "\n".join(lines)

    def stop(self, grace_s: float = STOP_GRACE_S) -> list[int]:
        """SIGTERM to every process (workers first), SIGKILL to what is left after `grace_s`;
        -> their exit codes. Idempotent."""
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %s s: killed", process.name, grace_s)
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        codes = [process.returncode for process in self.processes]
        self._state_dir.cleanup()
        return codes


def worker_instances(discovery_dir: str, namespace: str) -> list[str]:
    """The generate endpoints registered in a file-discovery directory (one file per worker under
    v1/instances, named namespace%2Fcomponent%2Fendpoint%2F<instance id>)."""
    directory = os.path.join(discovery_dir, "v1", "instances")
    prefix = f"{namespace}%2Fbackend%2Fgenerate%2F"
    try:
        return sorted(name for name in os.listdir(directory) if name.startswith(prefix))
    except FileNotFoundError:
        return []


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m samples.dynamo", description=__doc__.split("\n")[0])
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--router-mode", default="round-robin", choices=["kv", "round-robin", "random"])
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--prefill-workers", type=int, default=0,
                   help="that many of the workers take Dynamo's prefill role, the others decode (0: aggregated)")
    p.add_argument("--log-dir", help="where each process's log is written (default: a temporary directory)")
    p.add_argument("--frontend-home", help="HOME of the frontend (it copies model cards under $HOME/.cache/dynamo)")
    p.add_argument("worker_args", nargs=argparse.REMAINDER, help="after --: arguments for every worker")
    return p.parse_args(argv)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    worker_args = [a for a in args.worker_args if a != "--"]
    fleet = Fleet(args.engine_dir, args.workers, args.router_mode, args.http_port, worker_args, args.log_dir,
                  args.frontend_home, num_prefill_workers=args.prefill_workers)
    signal.signal(signal.SIGTERM, _interrupt)   # stops a start under way too
    try:
        fleet.start()
        print(fleet.describe(), flush=True)
        while True:
            dead = [p for p in fleet.processes if p.poll() is not None]
            if dead:
                logger.error("%s exited with %s: stopping the set", dead[0].name, dead[0].returncode)
                return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        fleet.stop()
    return 0
