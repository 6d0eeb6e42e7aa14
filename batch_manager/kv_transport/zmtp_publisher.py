"""The KV-events PUB endpoint (what ZMQ SUB sockets connect to), keeping no subscription state.

Owned by kv_events_publisher.KvEventPublisher: `send` (the worker thread) queues a message and
returns; the endpoint's own thread (zmtp_endpoint) accepts subscribers and writes to them.

NOTE: libzmq's PUB and XPUB keep a trie of every distinct prefix each peer subscribes to and
update it inside `send`: one peer flooding unique prefixes stalled the sender for seconds and
grew the process by gigabytes. An XPUB with ZMQ_XPUB_MANUAL keeps no trie, but queues every
subscription message without bound before the application reads it (+300 MiB in 5 s of unique
prefixes) and caps neither peers nor the bytes queued for one (samples/microbench/xpub_manual.py;
README, "Replicas behind vllm-router"). Here a peer that
has subscribed once gets every message (a SUB socket filters by topic itself) and what a peer
sends after its handshake is read at a bounded rate and discarded, PINGs answered. State per
subscriber: its socket and at most `send_hwm` queued messages (MAX_QUEUED_BYTES).
"""
from __future__ import annotations

from collections import deque

from .zmtp_endpoint import ZmtpEndpoint
from .zmtp_wire import ZmtpPeer, encode_frames

MAX_SUBSCRIBERS = 64              # connections at once (a newcomer evicts a peer that is no subscriber)
MAX_QUEUED_BYTES = 64 << 20       # per subscriber, beside the send_hwm message count
STUCK_S = 1.0                     # a subscriber whose socket took nothing for this long may be evicted
SUBSCRIBE = 0x01                  # the first byte of a ZMTP 3.0 subscription frame


class _Subscriber(ZmtpPeer):
    """A peer, and whether it has subscribed (to anything: it gets every message from then on)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.has_subscribed = False


class ZmtpPublisher(ZmtpEndpoint):
    """Binds `address` (zmtp_wire.bind_listener) and serves it on its own thread until `close`.

    Slots: a newcomer past max_peers evicts, in this order, the oldest peer still in its
    handshake, the oldest open peer that never subscribed, the subscriber whose socket has taken
    nothing for longest (STUCK_S at least); when every peer is a subscriber keeping up, the
    newcomer is closed (a ZMQ SUB reconnects by itself)."""

    socket_type = b"PUB"
    peer_socket_types = (b"SUB", b"XSUB")
    max_peers = MAX_SUBSCRIBERS
    head_bytes = 1
    peer_class = _Subscriber

    def __init__(self, address, send_hwm: int):
        self._send_hwm = send_hwm
        self._inbox: deque[bytes] = deque()   # worker -> thread; at most send_hwm messages
        self.num_inbox_dropped = 0            # written by the worker thread only
        self.num_peer_dropped = 0             # written by the endpoint's thread only
        super().__init__(address, "KvEventsPublisher")

    @property
    def num_dropped(self) -> int:
        """Messages some subscriber did not get for lack of room (or that the thread fell behind on)."""
        return self.num_inbox_dropped + self.num_peer_dropped

    @property
    def num_subscribers(self) -> int:
        return sum(1 for peer in self.peers if peer.has_subscribed)

    def send(self, frames: list[bytes]) -> None:
        """Queue one message for every subscriber; never waits."""
        if len(self._inbox) >= self._send_hwm:
            self.num_inbox_dropped += 1
            return
        self._inbox.append(encode_frames(frames))
        self.wake()

    # -- the endpoint's thread ------------------------------------------------------------------

    def _on_data_frame(self, peer: _Subscriber, head: bytes, size: int, more: bool) -> bool:
        if head == bytes([SUBSCRIBE]):
            peer.has_subscribed = True
        return True

    def _eviction_rank(self, peer: _Subscriber, now: float) -> tuple | None:
        if peer.stage != "open":
            return 0, peer.accepted_at
        if not peer.has_subscribed:
            return 1, peer.accepted_at
        if peer.outbound and now - peer.last_write_at > STUCK_S:
            return 2, peer.last_write_at
        return None

    def _command(self, peer: _Subscriber, name: bytes, data: bytes) -> bool:
        if peer.stage == "open" and name == b"SUBSCRIBE":   # ZMTP 3.1's spelling
            peer.has_subscribed = True
        return super()._command(peer, name, data)

    def _on_turn(self, now: float) -> None:
        while self._inbox:
            message = memoryview(self._inbox.popleft())
            dropped = False
            for peer in self.peers:
                if not peer.has_subscribed:
                    continue
                if len(peer.outbound) >= self._send_hwm or peer.queued_bytes + len(message) > MAX_QUEUED_BYTES:
                    dropped = True
                else:
                    peer.queue(message)
            self.num_peer_dropped += dropped
