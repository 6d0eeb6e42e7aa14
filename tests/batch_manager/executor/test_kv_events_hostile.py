"""What a peer of the KV-events endpoint cannot do: stall `publish` or grow the engine with a
subscription flood (subscribe / unsubscribe churn, unique long prefixes, from another process),
fill memory by never reading, hold the endpoint with a half-done handshake or garbage; while an
honest pyzmq subscriber (heartbeats on) keeps receiving every message."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import zmq

from batch_manager.executor import KvEventsConfig
from batch_manager.kv_transport import kv_events_replay, zmtp_endpoint, zmtp_publisher, zmtp_wire
from batch_manager.kv_transport.kv_events_publisher import KvEventPublisher
from samples.chaos_soak import hostile_subscriber
from samples.chaos_soak.kv_events_round import PROJECT_ROOT

FLOOD_S = 6.0
# A hostile peer in its own process: an XSUB writing subscription frames as fast as it can.
FLOOD = """
import sys, time, zmq
endpoint, mode, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
socket = zmq.Context().socket(zmq.XSUB)
socket.setsockopt(zmq.SNDHWM, 100000)
socket.connect(endpoint)
end, i = time.monotonic() + seconds, 0
while time.monotonic() < end:
    if mode == "churn":
        frame = (b"\\x01" if i % 2 == 0 else b"\\x00") + b"kv"
    else:
        frame = b"\\x01" + i.to_bytes(8, "big") * 25    # a new 200-byte prefix each time
    try:
        socket.send(frame, zmq.NOBLOCK)
    except zmq.Again:
        time.sleep(0.0001)
    i += 1
"""


class _Stub:
    def __init__(self):
        self.events: list[dict] = []

    def take(self) -> list[dict]:
        events, self.events = self.events, []
        return events


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def free_tcp_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def removed(i: int, size: int = 16) -> dict:
    return {"type": "BlockRemoved", "block_hashes": [i.to_bytes(4, "big") * (size // 4)], "medium": "CPU"}


def honest_subscriber(context: zmq.Context, endpoint: str, topic: bytes = b"") -> zmq.Socket:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.HEARTBEAT_IVL, 100)        # a peer that does not answer PINGs is cut off
    sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 500)
    sub.connect(endpoint)
    return sub


def wait_joined(publisher: KvEventPublisher, stub: _Stub, sub: zmq.Socket) -> int:
    """Publishes until `sub` gets a message; -> the next sequence number."""
    deadline = time.monotonic() + 30
    while not sub.poll(20):
        assert time.monotonic() < deadline, "the subscriber never got a message"
        stub.events = [removed(0)]
        publisher.publish()
    while sub.poll(200):
        *_, last = sub.recv_multipart()
    return publisher.num_published


def received_sequences(sub: zmq.Socket, until: int, timeout_s: float = 30.0) -> list[int]:
    got, deadline = [], time.monotonic() + timeout_s
    while (not got or got[-1] < until) and time.monotonic() < deadline:
        if sub.poll(100):
            topic, sequence, _ = sub.recv_multipart()
            got.append(int.from_bytes(sequence, "big"))
    return got


@pytest.mark.parametrize("mode", ["churn", "unique"])
def test_a_subscription_flood_neither_stalls_publish_nor_grows_memory(mode):
    """Before: publish drained the subscriptions on the worker thread (50 publishes took as long
    as the flood: 11 s for a 5 s flood) and the XPUB socket kept every prefix (+170 MiB churn,
    +1.2 GiB unique prefixes in 5 s, never given back)."""
    endpoint = free_tcp_endpoint()
    stub = _Stub()
    publisher = KvEventPublisher(KvEventsConfig(endpoint, topic="kv"), stub)
    context = zmq.Context()
    sub = honest_subscriber(context, endpoint, b"kv")
    flood = None
    try:
        first = wait_joined(publisher, stub, sub)
        flood = subprocess.Popen([sys.executable, "-c", FLOOD, endpoint, mode, str(FLOOD_S)])
        time.sleep(1.0)                               # the flood is on
        rss_before = rss_mib()
        for i in range(50):
            stub.events = [removed(i)]
            publisher.publish()
            time.sleep(0.001)
        # Structural, not a time bound: the 50 publishes are done while the flood still runs.
        assert flood.poll() is None, "the publishes took as long as the flood"
        got = received_sequences(sub, first + 49)
        growth = rss_mib() - rss_before
        assert flood.wait(60) == 0
    finally:
        if flood is not None and flood.poll() is None:
            flood.kill()
        context.destroy(linger=0)
        publisher.close()
    assert got == list(range(first, first + 50)), "the honest subscriber missed messages"
    assert growth < 32, f"RSS grew {growth:.0f} MiB during the flood"
    assert publisher.num_dropped == 0


def test_a_subscriber_that_never_reads_holds_a_bounded_queue():
    """300 messages of 1 MiB to a subscriber that reads nothing: what it cannot take is dropped
    and counted, and the engine holds at most MAX_QUEUED_BYTES for it (before: the XPUB queued all
    of them, up to SEND_HWM = 10,000 messages)."""
    endpoint = free_tcp_endpoint()
    stub = _Stub()
    publisher = KvEventPublisher(KvEventsConfig(endpoint, buffer_steps=1), stub)
    context = zmq.Context()
    stuck = context.socket(zmq.SUB)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 4096)
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    stuck.connect(endpoint)
    try:
        wait_joined(publisher, stub, stuck)
        rss_before = rss_mib()
        for i in range(300):
            stub.events = [removed(i, 1 << 20)]
            publisher.publish()
            time.sleep(0.002)
        time.sleep(0.5)
        growth = rss_mib() - rss_before
    finally:
        context.destroy(linger=0)
        publisher.close()
    assert publisher.num_dropped > 0
    assert growth < zmtp_publisher.MAX_QUEUED_BYTES / (1 << 20) + 48, f"RSS grew {growth:.0f} MiB"


def test_garbage_and_half_done_handshakes_are_cut_off_and_honest_subscribers_served(monkeypatch):
    monkeypatch.setattr(zmtp_endpoint, "HANDSHAKE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(zmtp_publisher.ZmtpPublisher, "max_peers", 4)
    endpoint = free_tcp_endpoint()
    host, port = endpoint[len("tcp://"):].split(":")
    stub = _Stub()
    publisher = KvEventPublisher(KvEventsConfig(endpoint), stub)
    context = zmq.Context()
    raw = [socket.create_connection((host, int(port))) for _ in range(6)]   # 4 slots: 2 evicted at once
    try:
        raw[0].sendall(b"GET / HTTP/1.1\r\n\r\n")                            # not ZMTP: closed
        raw[1].sendall(zmtp_wire.GREETING + zmtp_wire.ready_command(b"PUB"))   # a PUB is no subscriber
        for s in raw:
            s.settimeout(10)
        for s in raw:                                   # every one is closed: by protocol, eviction or timeout
            try:
                while s.recv(4096):
                    pass
            except ConnectionResetError:                # closed with what it sent unread
                pass
        sub = honest_subscriber(context, endpoint)
        disconnects = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        first = wait_joined(publisher, stub, sub)
        time.sleep(1.5)                                 # idle: the subscriber's PINGs must be answered
        stub.events = [removed(1)]
        publisher.publish()
        assert received_sequences(sub, first) == [first]
        assert not disconnects.poll(0), "the subscriber timed out its heartbeat"
    finally:
        for s in raw:
            s.close()
        context.destroy(linger=0)
        publisher.close()


def replay_all(context: zmq.Context, replay_endpoint: str, timeout_s: float = 60.0) -> list[int]:
    """An honest replay client: the sequences of a replay from 0 (a DEALER, as vllm-router asks)."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    got, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if dealer.poll(100):
            _, _, sequence, _ = dealer.recv_multipart()
            if sequence == kv_events_replay.END_OF_REPLAY:
                break
            got.append(int.from_bytes(sequence, "big"))
    dealer.close()
    return got


def test_replay_clients_that_never_read_hold_bounded_memory_and_an_honest_replay_completes():
    """300 clients ask for the whole replay (1,000 messages of ~3 KiB) and never read. Before: a
    libzmq ROUTER queued every reply whole per client with no cap on clients (+126 MiB in 8 s,
    kept after they left); now at most 16 clients, each with at most 256 KiB queued."""
    endpoint, replay_endpoint = free_tcp_endpoint(), free_tcp_endpoint()
    stub = _Stub()
    publisher = KvEventPublisher(KvEventsConfig(endpoint, replay_endpoint), stub)
    for i in range(1000):
        stub.events = [dict(removed(i), token_ids=list(range(1024)))]
        publisher.publish()
    context = zmq.Context()
    flood = None
    try:
        rss_before = rss_mib()
        flood = hostile_subscriber.start(replay_endpoint, "replay", 60, PROJECT_ROOT)
        time.sleep(1.0)
        assert publisher.replay_server.num_clients <= kv_events_replay.MAX_REPLAY_CLIENTS
        honest = replay_all(context, replay_endpoint)
        assert flood.poll() is None, "the honest replay was served only once the attack ended"
        peak = rss_mib() - rss_before
        flood.kill()
        flood.wait(60)
        time.sleep(1.0)                # the attackers' connections are closed
        left = rss_mib() - rss_before
    finally:
        if flood is not None and flood.poll() is None:
            flood.kill()
        context.destroy(linger=0)
        publisher.close()
    assert honest == list(range(1001)), "the honest replay is incomplete"
    assert peak < 32, f"RSS grew {peak:.0f} MiB under the replay flood"
    assert left < 16, f"RSS {left:.0f} MiB above its start after the flood"


def _slow_greeters(endpoint: str, count: int) -> list[socket.socket]:
    """Connections that send the greeting's first byte and nothing more."""
    host, port = endpoint[len("tcp://"):].split(":")
    peers = [socket.create_connection((host, int(port))) for _ in range(count)]
    for peer in peers:
        peer.sendall(zmtp_wire.GREETING[:1])
    return peers


def _is_open(peer: socket.socket) -> bool:
    """Whether the endpoint has kept `peer` open (what it sent read and discarded)."""
    peer.setblocking(False)
    try:
        while peer.recv(4096):
            pass
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False


@pytest.mark.parametrize("squatters", ["handshaken, never subscribing", "greeting slowly"])
def test_connections_that_never_subscribe_cannot_lock_a_subscriber_out(squatters):
    """80 connections take every one of the 64 subscriber slots first. Before: the 65th connection
    was closed at once for as long as they stayed, so a real subscriber got nothing; now it evicts
    one of them."""
    endpoint = free_tcp_endpoint()
    stub = _Stub()
    publisher = KvEventPublisher(KvEventsConfig(endpoint), stub)
    context = zmq.Context()
    flood, raw = None, []
    try:
        if squatters == "greeting slowly":
            raw = _slow_greeters(endpoint, hostile_subscriber.NUM_IDLE)
        else:
            flood = hostile_subscriber.start(endpoint, "idle", FLOOD_S, PROJECT_ROOT)
        time.sleep(1.0)                  # the slots are taken
        sub = honest_subscriber(context, endpoint)
        first = wait_joined(publisher, stub, sub)
        stub.events = [removed(1)]
        publisher.publish()
        got = received_sequences(sub, first)
        # Not joined by waiting them out: they are still there (less the one evicted).
        assert flood is None or flood.poll() is None, "the subscriber joined only after the squatters left"
        assert sum(map(_is_open, raw)) >= (zmtp_publisher.MAX_SUBSCRIBERS - 1 if raw else 0), \
            "the subscriber joined only after the squatters' handshakes timed out"
    finally:
        for peer in raw:
            peer.close()
        if flood is not None:
            flood.kill()
        context.destroy(linger=0)
        publisher.close()
    assert got == [first]
