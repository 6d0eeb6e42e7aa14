"""N replicas of the serving sample behind vLLM's router (the vllm-router package), on one host.

    python -m samples.serve.replicas --engine-dir DIR --replicas N --port P
        [--policy kv_aware|cache_aware|round_robin|power_of_two] [--tokenizer DIR] [samples.serve arguments...]

Each replica is its own process (`python -m samples.serve`, its own engine) on a free port and
publishes its KV-cache events on its own endpoint (--kv-events-endpoint, which turns block reuse
on). vllm-router listens on P with the policy given; for kv_aware it subscribes to every replica's
events (--kv-event-source, with the replay socket, the served model's name and the engine's
tokens_per_block). Arguments not named above go to every replica. The router makes every routing
decision: this script only starts, prints and stops. A replica that dies stays dead (the router
routes around it); Ctrl-C or SIGTERM stops them all.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

POLICIES = ("kv_aware", "cache_aware", "round_robin", "power_of_two")
START_TIMEOUT_S = 600.0        # a replica builds its engine before it listens
BIND_ATTEMPTS = 3              # starts of a replica whose KV-event port another process took first
# NOTE: vllm-router's settings, not routing decisions. A failed request opens the worker's circuit
# breaker at once: by default cache_aware retried on the same dead replica until health checks
# caught up, and lost requests. Health checks every 2 s (not 60) notice a dead replica sooner.
ROUTER_ARGS = ("--health-check-interval-secs", "2", "--worker-startup-check-interval", "1",
               "--cb-failure-threshold", "1")
# NOTE: vllm-router credits blocks on the "CPU" medium as a host tier (0.8 of a device block: the
# cost of moving them back). This engine computes on the pool it reports, whatever the device:
# full credit.
KV_AWARE_ARGS = ("--kv-penalty-host", "1.0")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Replica:
    index: int
    url: str                   # http://127.0.0.1:PORT
    events_endpoint: str       # tcp://127.0.0.1:PORT (ZMQ PUB)
    replay_endpoint: str       # tcp://127.0.0.1:PORT (ZMQ ROUTER)
    process: subprocess.Popen
    log_path: str


def router_executable() -> str | None:
    """vllm-router beside this interpreter (its wheel's script), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    return beside if os.access(beside, os.X_OK) else shutil.which("vllm-router")


def tokens_per_block(model_dir: str) -> int:
    """The engine's (engine.json), or what a checkpoint directory would be built with."""
    from runtime.config import default_build_config
    from samples.benchmark.cli import model_limits
    engine_json = os.path.join(model_dir, "engine.json")
    if os.path.exists(engine_json):
        with open(engine_json) as f:
            return int(json.load(f)["build"]["tokens_per_block"])
    return default_build_config(model_limits(model_dir)[0]).tokens_per_block


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Replicas:
    """The replicas and the router, started by `start` (or `with`), stopped by `stop`."""

    def __init__(self, engine_dir: str, num_replicas: int, port: int, policy: str = "kv_aware",
                 tokenizer: str | None = None, serve_args: list[str] | tuple = (), log_dir: str | None = None,
                 served_model_name: str | None = None, router_args: list[str] | tuple = ()):
        if policy not in POLICIES:
            raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
        if num_replicas < 1:
            raise ValueError(f"replicas: expected at least 1, got {num_replicas}")
        self.engine_dir, self.num_replicas, self.port, self.policy = engine_dir, num_replicas, port, policy
        self.tokenizer, self.serve_args, self.router_args = tokenizer, list(serve_args), list(router_args)
        self.model_name = served_model_name or os.path.basename(os.path.normpath(engine_dir))
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="replicas-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.router_url = f"http://127.0.0.1:{port}"
        self.replicas: list[Replica] = []
        self.router: subprocess.Popen | None = None
        self.router_log_path = os.path.join(self.log_dir, "router.log")

    def __enter__(self) -> "Replicas":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        router = router_executable()
        if router is None:
            raise RuntimeError("vllm-router not found: pip install vllm-router (the project's samples extra has it)")
        try:
            ports = free_ports(2 * self.num_replicas + 1)
            for i in range(self.num_replicas):
                self.replicas.append(self._start_replica(i, ports[2 * i], ports[2 * i + 1]))
            for replica in list(self.replicas):
                self._wait_listening_or_rebind(replica)
            self.router = self._start_router(router, ports[-1])
            self._wait_router()
        except BaseException:
            self.stop()
            raise

    def _start_replica(self, index: int, events_port: int, replay_port: int) -> Replica:
        events, replay = f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{replay_port}"
        command = [sys.executable, "-m", "samples.serve", "--engine-dir", self.engine_dir, "--port", "0",
                   "--served-model-name", self.model_name, "--kv-events-endpoint", events,
                   "--kv-events-replay-endpoint", replay, *self.serve_args]
        if self.tokenizer is not None:
            command += ["--tokenizer", self.tokenizer]
        # NOTE: the replicas share the host's cores; each gets its share of torch's threads
        # (unless set), or they would all spin up every core and slow each other down.
        threads = str(max(1, (os.cpu_count() or 1) // self.num_replicas))
        env = {"OMP_NUM_THREADS": threads, **os.environ,
               "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
        log_path = os.path.join(self.log_dir, f"replica{index}.log")
        with open(log_path, "w") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
        return Replica(index, "", events, replay, process, log_path)

    def _wait_listening_or_rebind(self, replica: Replica) -> None:
        """_wait_listening, starting the replica again on fresh ports (up to BIND_ATTEMPTS times) when
        it exited because another process took one of its KV-event ports: free_ports releases the
        ports it found, so on a busy host one can be taken before the replica binds it."""
        for attempt in range(BIND_ATTEMPTS):
            try:
                return self._wait_listening(replica)
            except RuntimeError:
                with open(replica.log_path) as f:
                    taken = "Address already in use" in f.read()
                if not taken or attempt + 1 == BIND_ATTEMPTS:
                    raise
                events_port, replay_port = free_ports(2)
                replica = self._start_replica(replica.index, events_port, replay_port)
                self.replicas[replica.index] = replica

    def _wait_listening(self, replica: Replica) -> None:
        """Fill in the replica's URL from the line it prints once it listens."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with open(replica.log_path) as f:
                urls = [line.split()[-1] for line in f if line.startswith("listening on http://")]
            if urls:
                self.replicas[replica.index] = Replica(replica.index, urls[0], replica.events_endpoint,
                                                       replica.replay_endpoint, replica.process, replica.log_path)
                return
            if replica.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"replica {replica.index} did not start (exit code {replica.process.poll()}); "
                                   f"its log: {replica.log_path}")
            time.sleep(0.1)

    def router_command(self, executable: str, prometheus_port: int) -> list[str]:
        urls = [r.url for r in self.replicas]
        command = [executable, "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *urls,
                   "--policy", self.policy, "--prometheus-host", "127.0.0.1", "--prometheus-port",
                   str(prometheus_port), *ROUTER_ARGS]
        if self.policy == "kv_aware":
            for r in self.replicas:
                command += ["--kv-event-source", f"{r.url}={r.events_endpoint}",
                            "--kv-event-replay-source", f"{r.url}={r.replay_endpoint}"]
            command += ["--kv-event-model", self.model_name, "--kv-event-block-size",
                        str(tokens_per_block(self.engine_dir)), *KV_AWARE_ARGS]
        return command + self.router_args

    def _start_router(self, executable: str, prometheus_port: int) -> subprocess.Popen:
        with open(self.router_log_path, "w") as log:
            return subprocess.Popen(self.router_command(executable, prometheus_port), stdout=log,
                                    stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"})

    def _wait_router(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.router_url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.router.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router did not start (exit code {self.router.poll()}); its log: "
                                   f"{self.router_log_path}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM to the router and every replica, then SIGKILL to what is left after 30 s."""
        processes = ([self.router] if self.router is not None else []) + [r.process for r in self.replicas]
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for process in processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-dir", required=True, help="the engine (or checkpoint) directory every replica serves")
    p.add_argument("--replicas", type=int, default=2, help="serving processes (default: 2)")
    p.add_argument("--port", type=int, default=8000, help="the router's port")
    p.add_argument("--policy", default="kv_aware", choices=POLICIES, help="vllm-router's routing policy")
    p.add_argument("--tokenizer", help="passed to every replica (the OpenAI endpoints need one)")
    p.add_argument("--served-model-name", help="the `model` of the OpenAI endpoints (default: the directory's name)")
    p.add_argument("--log-dir", help="where the replicas' and the router's logs go (default: a new temporary one)")
    return p.parse_known_args(argv)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    args, serve_args = parse_args(argv)
    replicas = Replicas(args.engine_dir, args.replicas, args.port, args.policy, args.tokenizer, serve_args,
                        args.log_dir, args.served_model_name)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        replicas.start()
        for r in replicas.replicas:
            print(f"replica {r.index}: {r.url}  KV events {r.events_endpoint} (replay {r.replay_endpoint})  "
                  f"log {r.log_path}", flush=True)
        print(f"vllm-router ({args.policy}) on {replicas.router_url}  log {replicas.router_log_path}", flush=True)
        reported: set[int] = set()
        while replicas.router.poll() is None:
            for r in replicas.replicas:
                if r.index not in reported and r.process.poll() is not None:
                    reported.add(r.index)
                    print(f"replica {r.index} ({r.url}) exited with code {r.process.returncode}; the router "
                          f"routes around it", flush=True)
            time.sleep(1)
        print(f"vllm-router exited with code {replicas.router.returncode}; stopping", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        replicas.stop()


if __name__ == "__main__":
    main()
