"""Replicas of the serving sample behind the real vllm-router (samples.serve.replicas): each
replica its own process and engine. kv_aware (fed by the replicas' KV events) and cache_aware send
the requests sharing a prefix to the replica that cached it (each replica's reused-block counter);
round_robin spreads them; a killed replica is routed around and no request is lost; the router's
log has no complaint about the events; it fills a gap in a replica's events from its replay
socket; the command line prints the replicas and stops them all."""
from __future__ import annotations

import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from batch_manager import KvEventsConfig
from batch_manager.kv_transport.kv_events_publisher import KvEventPublisher, WireEventCollector
from samples.serve.replicas import Replicas, free_ports, router_executable
from tests.samples.scripted_model import REPLY

MODEL = "scripted"
PREFIX = "Hello world, the batch manager serves every client. " * 2   # 8 full blocks of 8 tokens

pytestmark = pytest.mark.skipif(router_executable() is None, reason="vllm-router is not installed (pip install "
                                "vllm-router; the test extra has it): no router to test the replicas behind")


def post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def counter(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.split()[-1])
    raise AssertionError(f"{name} not in {url}/metrics")


def reused(replicas: Replicas) -> list[float]:
    return [counter(r.url, "nv_trt_llm_kv_cache_reused_blocks_total") for r in replicas.replicas]


def completion(url: str, suffix: str) -> str:
    out = post(url, "/v1/completions", {"model": MODEL, "prompt": PREFIX + suffix, "max_tokens": 40,
                                        "temperature": 0})
    return out["choices"][0]["text"]


def router_complaints(replicas: Replicas) -> list[str]:
    """WARN / ERROR lines of the router's log but the ones about the killed replica's refusals."""
    with open(replicas.router_log_path, errors="replace") as f:
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in f]
    return [line for line in lines if re.search(r"\b(WARN|ERROR)\b", line)
            and "Failed to send typed request" not in line and "queue processor shutting down" not in line]


def run_shared_prefix_then_kill(replicas: Replicas) -> None:
    """Five requests sharing PREFIX: the four later ones on the replica that cached it (8 blocks
    reused each); then that replica dies and six more come."""
    assert completion(replicas.router_url, " 0").startswith(REPLY)
    time.sleep(0.5)    # the events of the first request reach the router
    for k in range(1, 5):
        assert completion(replicas.router_url, f" {k}").startswith(REPLY)
    counts = reused(replicas)
    assert sorted(counts) == [0, 8 * 4], counts
    holder = replicas.replicas[max(range(2), key=lambda i: counts[i])]
    holder.process.kill()
    holder.process.wait()
    survivor = next(r for r in replicas.replicas if r is not holder)
    before = counter(survivor.url, "nv_trt_llm_prompt_tokens_total")
    texts = [completion(replicas.router_url, f" {k}") for k in range(5, 11)]
    assert all(text.startswith(REPLY) for text in texts)                   # nothing lost
    assert counter(survivor.url, "nv_trt_llm_prompt_tokens_total") > before


@pytest.mark.parametrize("policy", ["kv_aware", "cache_aware"])
def test_a_shared_prefix_lands_where_it_is_cached_and_a_dead_replica_is_routed_around(scripted, tmp_path, policy):
    tokenizer, _, engine_dir = scripted
    [port] = free_ports(1)
    with Replicas(engine_dir, 2, port, policy, tokenizer.name_or_path, log_dir=str(tmp_path),
                  served_model_name=MODEL) as replicas:
        chat = post(replicas.router_url, "/v1/chat/completions", {   # rendered for the router, then served
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0})
        assert chat["choices"][0]["message"]["content"].startswith(REPLY)
        run_shared_prefix_then_kill(replicas)
        assert router_complaints(replicas) == []


def test_the_command_line_round_robin_and_stop(scripted, tmp_path):
    """round_robin (no events): the requests alternate; SIGTERM (as Ctrl-C) stops every process."""
    tokenizer, _, engine_dir = scripted
    [port] = free_ports(1)
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    process = subprocess.Popen([sys.executable, "-m", "samples.serve.replicas", "--engine-dir", engine_dir,
                                "--replicas", "2", "--port", str(port), "--policy", "round_robin", "--tokenizer",
                                tokenizer.name_or_path, "--served-model-name", MODEL, "--log-dir", str(tmp_path),
                                "--max-batch-size", "4"],   # a samples.serve argument: passed to each replica
                               stdout=subprocess.PIPE, text=True, cwd=repo_root,
                               env={**os.environ, "PYTHONPATH": repo_root})
    try:
        lines = [process.stdout.readline() for _ in range(3)]
        assert lines[0].startswith("replica 0: http://127.0.0.1:") and "KV events tcp://127.0.0.1:" in lines[0]
        assert lines[2].startswith(f"vllm-router (round_robin) on http://127.0.0.1:{port}"), lines
        urls = [line.split()[2] for line in lines[:2]]
        for k in range(4):
            assert completion(f"http://127.0.0.1:{port}", f" {k}").startswith(REPLY)
        counts = [counter(url, "nv_trt_llm_prompt_tokens_total") for url in urls]
        assert counts[0] == counts[1] > 0                                 # two requests each, same lengths
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        for url in urls:                                                  # the replicas are gone too
            with pytest.raises(OSError):
                urllib.request.urlopen(url + "/health", timeout=2)
    finally:
        if process.poll() is None:
            process.kill()


class _Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self):   # noqa: N802 - the handler's name
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def _full_queue(endpoint):
    """A send as the PUB endpoint makes it with its queue full: the message is lost, counted."""
    def send(frames):
        endpoint.num_inbox_dropped += 1
    return send


def test_the_router_fills_a_gap_from_the_replay_socket(tmp_path):
    """The router reads the replay socket as this publisher answers it: at start it catches up
    from message 0, and a message lost on the way (a full subscriber queue) comes by replay."""
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthy) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    urls = [f"http://127.0.0.1:{server.server_address[1]}" for server in servers]
    port, events_port, replay_port, other_port, prometheus_port = free_ports(5)
    collector = WireEventCollector(4, "CPU", lambda holder: None)
    publisher = KvEventPublisher(KvEventsConfig(f"tcp://127.0.0.1:{events_port}",
                                                f"tcp://127.0.0.1:{replay_port}"), collector)
    log_path = tmp_path / "router.log"

    def store(i: int) -> None:   # block i, its parent block i - 1
        collector.stored(bytes([i - 1]) * 16 if i else b"", [(bytes([i]) * 16, [4 * i + t for t in range(4)])])
        publisher.publish()

    with open(log_path, "w") as log:
        router = subprocess.Popen([router_executable(), "--port", str(port), "--worker-urls", *urls, "--policy",
                                   "kv_aware", "--kv-event-source", f"{urls[0]}=tcp://127.0.0.1:{events_port}",
                                   "--kv-event-replay-source", f"{urls[0]}=tcp://127.0.0.1:{replay_port}",
                                   "--kv-event-source", f"{urls[1]}=tcp://127.0.0.1:{other_port}",
                                   "--kv-event-model", "m", "--kv-event-block-size", "4", "--prometheus-port",
                                   str(prometheus_port), "--log-level", "debug"], stdout=log,
                                  stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"})
    try:
        store(0)                 # message 1, before the router: it catches up by replay
        deadline = time.monotonic() + 60
        while publisher._pub.num_subscribers == 0:   # the router has started and subscribed (seconds)
            assert time.monotonic() < deadline and router.poll() is None, "the router never subscribed"
            time.sleep(0.1)
        store(1)                 # message 2
        send = publisher._pub.send
        publisher._pub.send = _full_queue(publisher._pub)
        store(2)                 # message 3: lost on the wire (counted), kept for replay
        publisher._pub.send = send
        store(3)                 # message 4: the router sees the gap
        assert publisher.num_dropped == 1
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            text = re.sub(r"\x1b\[[0-9;]*m", "", log_path.read_text(errors="replace"))
            if re.search(r"replay sequence advanced .*seq=3\b", text):
                break
            time.sleep(0.2)
        assert re.search(r"replay sequence advanced .*seq=3\b", text), text[-3000:]
        assert "unknown parent" not in text and not re.search(r"\b(WARN|ERROR)\b.*kv_index", text)
    finally:
        router.terminate()
        router.wait(30)
        publisher.close()
        for server in servers:
            server.shutdown()


def test_a_replica_whose_event_port_was_taken_starts_again_on_fresh_ports(scripted, tmp_path, monkeypatch):
    """free_ports releases what it finds: here another process holds replica 0's replay port when it
    binds (Errno 98); the replicas start it again on fresh ports and serve."""
    import samples.serve.replicas as replicas_module
    tokenizer, _, engine_dir = scripted
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    real_free_ports, calls = replicas_module.free_ports, []

    def first_replay_port_taken(count: int) -> list[int]:
        ports = real_free_ports(count)
        calls.append(count)
        if len(calls) == 1:
            ports[1] = taken   # replica 0's replay endpoint
        return ports

    monkeypatch.setattr(replicas_module, "free_ports", first_replay_port_taken)
    [port] = real_free_ports(1)
    try:
        with Replicas(engine_dir, 2, port, "round_robin", tokenizer.name_or_path, log_dir=str(tmp_path),
                      served_model_name=MODEL) as replicas:
            assert calls == [5, 2]   # the first layout, then fresh ports for replica 0 alone
            assert replicas.replicas[0].replay_endpoint != f"tcp://127.0.0.1:{taken}"
            assert completion(replicas.router_url, " 0").startswith(REPLY)
    finally:
        holder.close()
