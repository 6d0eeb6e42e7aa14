"""`python -m samples.microbench.kv_events_flood [--seconds 5] [--with-xpub-manual] [--with-libzmq-pub]`:
the KV-events endpoints under attacks from another process (samples.chaos_soak.hostile_subscriber).
On the PUB endpoint: 50 publishes (1 ms apart) with an honest subscriber listening, quiet and under
each attack (churn, unique prefixes, a stuck subscriber, 80 idle connections taking the slots
first: the honest subscriber joins after them); then 300 publishes of 1 MiB to a subscriber that
never reads. On the replay socket: 300 clients ask for a 1,000-message replay and never read, and
an honest client replays meanwhile. Printed: the time of the publishes (worst one), messages the
honest subscriber got, this process's RSS growth. --with-xpub-manual: the same PUB attacks on a
libzmq XPUB with ZMQ_XPUB_MANUAL (samples/microbench/xpub_manual.py); --with-libzmq-pub: churn
and unique prefixes through a plain libzmq PUB. Figures: README, "Replicas behind vllm-router".
"""
from __future__ import annotations

import argparse
import os
import socket
import time

import zmq

from batch_manager.executor import KvEventsConfig
from batch_manager.kv_transport.kv_events_publisher import KvEventPublisher
from batch_manager.kv_transport.kv_events_replay import END_OF_REPLAY
from samples.chaos_soak import hostile_subscriber
from samples.chaos_soak.kv_events_round import PROJECT_ROOT
from samples.microbench.xpub_manual import XpubManualPublisher

PUB_MODES = (None, "churn", "unique", "stuck", "idle")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def _endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _message(i: int, size: int = 100) -> list[bytes]:
    return [b"", i.to_bytes(8, "big"), b"x" * size]


def _joined(send, sub: zmq.Socket) -> bool:
    """Sends until `sub` gets a message (10 s at most); drains what came."""
    deadline = time.monotonic() + 10
    while not sub.poll(20):
        if time.monotonic() > deadline:
            return False
        send(_message(0))
    while sub.poll(200):
        sub.recv_multipart()
    return True


def _pub_attack(send, endpoint: str, mode: str | None, seconds: float) -> tuple[float, float, int, float]:
    """-> (seconds for 50 sends, worst single send in ms, messages the honest subscriber got, RSS MiB)."""
    context, flood = zmq.Context(), None
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    if mode != "idle":
        sub.connect(endpoint)
        _joined(send, sub)
    if mode is not None:
        flood = hostile_subscriber.start(endpoint, mode, seconds, PROJECT_ROOT)
        time.sleep(0.5)
    if mode == "idle":
        sub.connect(endpoint)
        _joined(send, sub)
    rss, start, worst = _rss_mib(), time.monotonic(), 0.0
    for i in range(50):
        t = time.monotonic()
        send(_message(i))
        worst = max(worst, time.monotonic() - t)
        time.sleep(0.001)
    total = time.monotonic() - start
    received = 0
    while sub.poll(1000) and received < 50:
        sub.recv_multipart()
        received += 1
    if flood is not None:
        flood.wait()
    context.destroy(linger=0)
    return total, worst * 1000, received, _rss_mib() - rss


def _stuck_big(send, endpoint: str) -> float:
    """300 messages of 1 MiB to a subscriber that never reads: -> RSS growth, MiB."""
    context = zmq.Context()
    stuck = context.socket(zmq.SUB)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 4096)
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    stuck.connect(endpoint)
    _joined(send, stuck)
    rss = _rss_mib()
    for i in range(300):
        send(_message(i, 1 << 20))
        time.sleep(0.002)
    time.sleep(0.5)
    growth = _rss_mib() - rss
    context.destroy(linger=0)
    return growth


def _replay_flood(seconds: float) -> tuple[float, int, float, float]:
    """-> (seconds for an honest replay under the flood, messages it got, RSS growth during, after), MiB."""
    endpoint, replay_endpoint = _endpoint(), _endpoint()
    publisher = KvEventPublisher(KvEventsConfig(endpoint, replay_endpoint), _Stub())
    for i in range(1000):
        publisher.collector.events = [{"type": "BlockRemoved", "block_hashes": [i.to_bytes(16, "big")],
                                       "token_ids": list(range(1024)), "medium": "CPU"}]
        publisher.publish()
    rss, context = _rss_mib(), zmq.Context()
    flood = hostile_subscriber.start(replay_endpoint, "replay", seconds, PROJECT_ROOT)
    time.sleep(1.0)
    dealer = context.socket(zmq.DEALER)
    dealer.connect(replay_endpoint)
    start, got = time.monotonic(), 0
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    while dealer.poll(30_000) and dealer.recv_multipart()[2] != END_OF_REPLAY:
        got += 1
    took, during = time.monotonic() - start, _rss_mib() - rss
    flood.wait()
    time.sleep(1.0)
    context.destroy(linger=0)
    after = _rss_mib() - rss
    publisher.close()
    return took, got, during, after


class _Stub:
    events: list[dict] = []

    def take(self) -> list[dict]:
        events, self.events = self.events, []
        return events


def _ours(endpoint: str):
    publisher = KvEventPublisher(KvEventsConfig(endpoint), _Stub())
    return publisher._pub.send, publisher.close


def _xpub_manual(endpoint: str):
    publisher = XpubManualPublisher(endpoint)
    return publisher.send, publisher.close


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=5.0, help="length of each flood")
    p.add_argument("--with-xpub-manual", action="store_true")
    p.add_argument("--with-libzmq-pub", action="store_true")
    args = p.parse_args(argv)
    print(f"50 publishes, 1 ms apart; floods of {args.seconds:g} s from another process")
    kinds = [("ours", _ours)] + ([("xpub-manual", _xpub_manual)] if args.with_xpub_manual else [])
    for name, make in kinds:
        for mode in PUB_MODES:
            endpoint = _endpoint()
            send, close = make(endpoint)
            total, worst, received, growth = _pub_attack(send, endpoint, mode, args.seconds)
            close()
            print(f"{name:12s} {mode or 'quiet':7s} 50 publishes {total:6.2f} s  worst {worst:7.1f} ms  "
                  f"honest got {received:2d}/50  RSS {growth:+8.1f} MiB")
        endpoint = _endpoint()
        send, close = make(endpoint)
        print(f"{name:12s} stuck subscriber, 300 x 1 MiB: RSS {_stuck_big(send, endpoint):+8.1f} MiB")
        close()
    took, got, during, after = _replay_flood(args.seconds)
    print(f"replay: 300 clients never reading; an honest replay of {got} messages in {took:.2f} s; "
          f"RSS {during:+.1f} MiB during, {after:+.1f} MiB after")
    if args.with_libzmq_pub:
        for mode in ("churn", "unique"):
            context, endpoint = zmq.Context(), _endpoint()
            pub = context.socket(zmq.PUB)
            pub.bind(endpoint)
            total, worst, received, growth = _pub_attack(lambda frames: pub.send_multipart(frames, zmq.NOBLOCK),
                                                         endpoint, mode, args.seconds)
            context.destroy(linger=0)
            print(f"libzmq PUB   {mode:7s} 50 sends     {total:6.2f} s  worst {worst:7.1f} ms  "
                  f"honest got {received:2d}/50  RSS {growth:+8.1f} MiB")


if __name__ == "__main__":
    main()
