"""A KV-events PUB endpoint on libzmq's XPUB with ZMQ_XPUB_MANUAL, for samples.microbench.kv_events_flood
to hold against the project's own (batch_manager/kv_transport/zmtp_publisher.py) under the same floods.

Its own thread owns the socket: `send` (the worker) queues a message and wakes it; it reads every
subscription message and subscribes that peer to everything (b""; a SUB filters by topic itself),
ignoring unsubscriptions, so libzmq's trie holds one empty prefix per peer. Per subscriber at most
`send_hwm` messages (libzmq's SNDHWM; it has no byte bound and no bound on peers).
"""
from __future__ import annotations

import threading
from collections import deque

import zmq


class XpubManualPublisher:
    def __init__(self, endpoint: str, send_hwm: int = 10_000):
        self._context = zmq.Context()
        self._xpub = self._context.socket(zmq.XPUB)
        self._xpub.setsockopt(zmq.XPUB_MANUAL, 1)
        self._xpub.setsockopt(zmq.SNDHWM, send_hwm)
        self._xpub.setsockopt(zmq.LINGER, 0)
        self._xpub.bind(endpoint)
        self._wake_in = self._context.socket(zmq.PULL)
        self._wake_in.bind(f"inproc://wake-{id(self)}")
        self._wake_out = self._context.socket(zmq.PUSH)
        self._wake_out.connect(f"inproc://wake-{id(self)}")
        self._inbox: deque[list[bytes]] = deque()
        self._lock = threading.Lock()     # the PUSH socket: the worker's
        self._stopping = False
        self.num_subscriptions = 0
        self._thread = threading.Thread(target=self._serve, name="XpubManual", daemon=True)
        self._thread.start()

    def send(self, frames: list[bytes]) -> None:
        self._inbox.append(frames)
        with self._lock:
            self._wake_out.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        self._stopping = True
        with self._lock:
            self._wake_out.send(b"")
        self._thread.join()
        self._context.destroy(linger=0)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._xpub, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        while not self._stopping:
            ready = dict(poller.poll(1000))
            if self._wake_in in ready:
                while self._wake_in.poll(0):
                    self._wake_in.recv()
            while self._inbox:
                try:
                    self._xpub.send_multipart(self._inbox.popleft(), zmq.NOBLOCK)
                except zmq.Again:
                    pass
            for _ in range(1000):          # subscriptions: what arrived, in bounded turns
                try:
                    message = self._xpub.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if message[:1] == b"\x01":
                    self._xpub.setsockopt(zmq.SUBSCRIBE, b"")   # this peer: everything
                    self.num_subscriptions += 1
