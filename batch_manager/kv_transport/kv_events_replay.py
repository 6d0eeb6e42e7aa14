"""The KV-events replay: `ReplayBuffer`, the newest messages kept for it (appended by the worker
thread), and `ZmtpReplayServer`, the replay socket: a ZMTP ROUTER endpoint (what vLLM's replay
clients, ZMQ DEALER or REQ sockets, connect to) on its own thread (zmtp_endpoint) answering
[b"", start sequence (8 bytes, big-endian)] with [b"", topic, sequence, payload] per buffered
message from `start` on, then [b"", b"", -1 (8 signed bytes), b""]. Owned by KvEventPublisher.

NOTE: the topic frame is current vLLM's reply and what vllm-router 0.1.17 reads: it takes the
sequence from the second-last frame and drops, silently, a reply of fewer frames.
NOTE: not a libzmq ROUTER: that queued each reply whole per client (its high-water mark was the
buffer) with no cap on clients, so clients that asked and never read grew the engine by hundreds
of MiB, kept after they left. Here at most MAX_REPLAY_CLIENTS clients, each a cursor into the
buffer and at most REPLAY_CHUNK_BYTES queued (payloads shared with the buffer, not copied); a
client whose socket takes nothing for REPLAY_STALL_S is dropped.
"""
from __future__ import annotations

import logging
import threading
from collections import deque

from .zmtp_endpoint import ZmtpEndpoint
from .zmtp_wire import ZmtpPeer, encode_frames, frame_header

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
MAX_REPLAY_CLIENTS = 16           # connections at once (a newcomer evicts an idle or stalled one)
REPLAY_CHUNK_BYTES = 256 << 10    # queued for one client at a time, refilled as its socket takes it
REPLAY_STALL_S = 5.0              # a client whose socket takes nothing of its replay for this long is dropped
MAX_PENDING_REQUESTS = 4          # per client, beside the one being answered
MAX_REQUEST_FRAMES = 4
STALLED_S = 1.0                   # a replay whose socket took nothing for this long may be evicted


class ReplayBuffer:
    """The newest `max_messages` messages as (sequence, payload), sequences consecutive;
    `append` on the worker thread, `read` on the replay thread."""

    def __init__(self, max_messages: int):
        self._messages: deque[tuple[int, bytes]] = deque(maxlen=max_messages)
        self._lock = threading.Lock()
        self.next_sequence = 0

    def append(self, sequence: int, payload: bytes) -> None:
        with self._lock:
            self._messages.append((sequence, payload))
            self.next_sequence = sequence + 1

    def read(self, start: int, end: int, max_bytes: int) -> list[tuple[int, bytes]]:
        """The kept messages with start <= sequence < end, oldest first, until their payloads
        reach `max_bytes` (one at least); from the oldest kept when `start` is gone."""
        with self._lock:
            if not self._messages:
                return []
            i, out, num_bytes = max(start - self._messages[0][0], 0), [], 0
            while i < len(self._messages) and num_bytes < max_bytes:
                sequence, payload = self._messages[i]
                if sequence >= end:
                    break
                out.append((sequence, payload))
                num_bytes, i = num_bytes + len(payload), i + 1
            return out


class _Client(ZmtpPeer):
    """A peer, the request it is sending, the ones it is owed and the replay under way."""

    def __init__(self, *args):
        super().__init__(*args)
        self.frames: list[tuple[bytes, int]] = []   # the message being read: (first bytes, size) per frame
        self.pending: deque[int] = deque()           # start sequences asked for, not yet answered
        self.cursor: int | None = None               # the replay under way: next sequence to send
        self.end = 0                                 # ... and the one it stops before


class ZmtpReplayServer(ZmtpEndpoint):
    """Binds `address` (zmtp_wire.bind_listener) and answers replays from `buffer` until `close`.
    A newcomer past max_peers evicts the oldest peer in its handshake, else the oldest idle client,
    else the replay whose socket has taken nothing for longest (STALLED_S at least), else it is
    closed (a ZMQ DEALER reconnects by itself and sends its request then)."""

    socket_type = b"ROUTER"
    peer_socket_types = (b"DEALER", b"REQ")
    max_peers = MAX_REPLAY_CLIENTS
    head_bytes = 8
    peer_class = _Client

    def __init__(self, address, topic: bytes, buffer: ReplayBuffer):
        self._topic, self._buffer = topic, buffer
        self.num_stalled = 0          # clients dropped for taking nothing of their replay
        self._warned_malformed = False
        super().__init__(address, "KvEventsReplay")

    @property
    def num_clients(self) -> int:
        return len(self.peers)

    def _on_data_frame(self, peer: _Client, head: bytes, size: int, more: bool) -> bool:
        if len(peer.frames) < MAX_REQUEST_FRAMES:
            peer.frames.append((head, size))
        if more:
            return True
        frames, peer.frames = peer.frames, []
        if [size for _, size in frames] != [0, 8]:
            if not self._warned_malformed:
                logger.warning("KV events replay: ignored a request of frames of %s bytes (expected [b\"\", 8-byte "
                               "start sequence]; later ones are not logged)", [size for _, size in frames])
                self._warned_malformed = True
        elif len(peer.pending) < MAX_PENDING_REQUESTS:
            peer.pending.append(int.from_bytes(frames[1][0], "big"))
        return True

    def _eviction_rank(self, peer: _Client, now: float) -> tuple | None:
        if peer.stage != "open":
            return 0, peer.accepted_at
        if peer.cursor is None and not peer.pending and not peer.outbound:
            return 1, peer.last_write_at
        if peer.outbound and now - peer.last_write_at > STALLED_S:
            return 2, peer.last_write_at
        return None

    def _on_turn(self, now: float) -> None:
        for peer in list(self.peers):
            if peer.outbound and now - peer.last_write_at > REPLAY_STALL_S:
                self.num_stalled += 1
                self.drop(peer)
                continue
            if peer.cursor is None and peer.pending:
                peer.cursor, peer.end = peer.pending.popleft(), self._buffer.next_sequence
            if peer.cursor is not None and peer.queued_bytes < REPLAY_CHUNK_BYTES:
                self._refill(peer)

    def _refill(self, peer: _Client) -> None:
        messages = self._buffer.read(peer.cursor, peer.end, REPLAY_CHUNK_BYTES - peer.queued_bytes)
        for sequence, payload in messages:
            envelope = b"".join(frame_header(len(f), True) + f for f in (b"", self._topic, sequence.to_bytes(8, "big")))
            peer.queue(envelope + frame_header(len(payload), False))
            peer.queue(payload)   # shared with the buffer
            peer.cursor = sequence + 1
        if not messages:
            peer.queue(encode_frames([b"", b"", END_OF_REPLAY, b""]))
            peer.cursor = None
