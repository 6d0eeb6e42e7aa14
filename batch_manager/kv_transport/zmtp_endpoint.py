"""A ZMTP 3.0 endpoint serving its peers on its own thread (zmtp_publisher's PUB endpoint and
kv_events_replay's replay socket are two): it accepts at most `max_peers` connections (a newcomer
evicts the least useful peer, or is closed when none may go), ends handshakes at a deadline, reads
each peer at a bounded rate and writes without ever waiting. Subclasses say what a peer's frames
mean, what it is sent and which peer a newcomer evicts.
"""
from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time

from .zmtp_wire import COMMAND, GREETING, ZmtpPeer, bind_listener, encode_frames, metadata_property, ready_command

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
READ_CHUNK_BYTES = 4096
READ_PAUSE_S = 0.25               # a peer that filled a chunk is not read for this long: <= 16 KiB/s each
EVICTION_GRACE_S = 1.0            # a peer is never evicted this soon after its accept (a storm of newcomers
                                  # would otherwise evict each other, an honest one among them, mid-handshake)


class ZmtpEndpoint:
    """Binds `address` (zmtp_wire.bind_listener) and serves it on a thread named `name` until `close`."""

    socket_type = b""                           # ours, in READY
    peer_socket_types: tuple[bytes, ...] = ()   # the peers served
    max_peers = 64
    head_bytes = 0                              # of each data frame, handed to _on_data_frame
    peer_class = ZmtpPeer                       # a subclass's, with its own per-peer state

    def __init__(self, address, name: str):
        self._listener = bind_listener(address, self.max_peers)
        self._path = address[1] if address[0] == "ipc" else None
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, "listener")
        self._selector.register(self._wake_reader, selectors.EVENT_READ, "wake")
        self._greeting = GREETING + ready_command(self.socket_type)
        self.peers: list[ZmtpPeer] = []
        self.num_evicted = self.num_refused = 0     # newcomers that took a peer's slot / found none
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Hand out what is queued (what a socket takes without waiting), then close everything."""
        self._stopping = True
        self.wake()
        self._thread.join()

    def wake(self) -> None:
        try:
            self._wake_writer.send(b"\x00")
        except OSError:
            pass   # a wake-up is pending already (or the thread is gone)

    # -- what subclasses say ----------------------------------------------------------------------

    def _on_data_frame(self, peer: ZmtpPeer, head: bytes, size: int, more: bool) -> bool:
        """A data frame from an open peer (its first head_bytes bytes); False drops the peer."""
        return True

    def _eviction_rank(self, peer: ZmtpPeer, now: float) -> tuple | None:
        """Lower ranks are evicted first for a newcomer (of the peers accepted EVICTION_GRACE_S ago
        or more); None: this peer keeps its slot."""
        return (0, peer.accepted_at) if peer.stage != "open" else None

    def _on_turn(self, now: float) -> None:
        """After each wake-up of the thread: queue what is due, drop who must go."""

    # -- the endpoint's thread --------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while True:
                for key, mask in self._selector.select(self._select_timeout_s()):
                    if key.data == "listener":
                        self._accept()
                    elif key.data == "wake":
                        self._drain_wake()
                    elif key.data in self.peers:
                        self._on_ready(key.data, mask)
                self._on_turn(time.monotonic())
                self._flush_all()
                if self._stopping:
                    return
                self._check_timers()
        except Exception:
            logger.exception("%s thread failed; the endpoint no longer serves", self._thread.name)
        finally:
            for peer in list(self.peers):
                self.drop(peer)
            self._selector.close()
            self._listener.close()
            self._wake_reader.close()
            self._wake_writer.close()
            if self._path is not None and os.path.exists(self._path):
                os.unlink(self._path)

    def _select_timeout_s(self) -> float:
        now, timeout = time.monotonic(), 1.0
        for peer in self.peers:
            if peer.stage != "open":
                timeout = min(timeout, peer.deadline - now)
            if peer.read_paused_until:
                timeout = min(timeout, peer.read_paused_until - now)
        return max(timeout, 0.0)

    def _accept(self) -> None:
        for _ in range(16):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:   # out of file descriptors, say: the next turn tries again
                logger.warning("%s: accept failed: %s", self._thread.name, e)
                return
            now = time.monotonic()
            if len(self.peers) >= self.max_peers and not self._evict_one(now):
                self.num_refused += 1
                sock.close()
                continue
            sock.setblocking(False)
            peer = self.peer_class(sock, now, now + HANDSHAKE_TIMEOUT_S)
            self.peers.append(peer)
            peer.queue(self._greeting)   # ours need not wait for theirs
            self._update_events(peer)

    def _evict_one(self, now: float) -> bool:
        ranked = [(rank, i) for i, peer in enumerate(self.peers) if now - peer.accepted_at > EVICTION_GRACE_S
                  and (rank := self._eviction_rank(peer, now)) is not None]
        if not ranked:
            return False
        self.drop(self.peers[min(ranked)[1]])
        self.num_evicted += 1
        return True

    def _drain_wake(self) -> None:
        try:
            while self._wake_reader.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _on_ready(self, peer: ZmtpPeer, mask: int) -> None:
        ok = not mask & selectors.EVENT_READ or self._read(peer)
        if ok and mask & selectors.EVENT_WRITE:
            ok = self._flush(peer)
        if ok:
            self._update_events(peer)
        else:
            self.drop(peer)

    def _read(self, peer: ZmtpPeer) -> bool:
        """One chunk at most; False when the peer is gone or broke the protocol."""
        try:
            data = peer.sock.recv(READ_CHUNK_BYTES)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        if not data:
            return False
        if len(data) == READ_CHUNK_BYTES:
            peer.read_paused_until = time.monotonic() + READ_PAUSE_S
        peer.inbound += peer.consume(data)
        return peer.parse(lambda name, body: self._command(peer, name, body),
                          lambda head, size, more: self._on_data_frame(peer, head, size, more), self.head_bytes)

    def _command(self, peer: ZmtpPeer, name: bytes, data: bytes) -> bool:
        if peer.stage == "handshake":
            if name != b"READY" or metadata_property(data, b"Socket-Type") not in self.peer_socket_types:
                return False
            peer.stage = "open"
        elif name == b"PING" and len(data) >= 2:
            peer.queue(encode_frames([b"\x04PONG" + data[2:18]], COMMAND))
        return True

    def _flush_all(self) -> None:
        for peer in list(self.peers):
            if peer.outbound and not peer.events & selectors.EVENT_WRITE:
                if self._flush(peer):
                    self._update_events(peer)
                else:
                    self.drop(peer)

    def _check_timers(self) -> None:
        now = time.monotonic()
        for peer in list(self.peers):
            if peer.stage != "open" and now > peer.deadline:
                self.drop(peer)
                continue
            if peer.read_paused_until and now >= peer.read_paused_until:
                peer.read_paused_until = 0.0
                self._update_events(peer)

    def _flush(self, peer: ZmtpPeer) -> bool:
        """Writes what the socket takes now; False when the peer is gone."""
        while peer.outbound:
            head = peer.outbound[0]
            try:
                n = peer.sock.send(head)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            peer.queued_bytes -= n
            peer.last_write_at = time.monotonic()
            if n == len(head):
                peer.outbound.popleft()
            else:
                peer.outbound[0] = head[n:]
        return True

    def _update_events(self, peer: ZmtpPeer) -> None:
        events = (0 if peer.read_paused_until else selectors.EVENT_READ) | \
            (selectors.EVENT_WRITE if peer.outbound else 0)
        if events == peer.events:
            return
        if not peer.events:
            self._selector.register(peer.sock, events, peer)
        elif not events:
            self._selector.unregister(peer.sock)
        else:
            self._selector.modify(peer.sock, events, peer)
        peer.events = events

    def drop(self, peer: ZmtpPeer) -> None:
        if peer.events:
            self._selector.unregister(peer.sock)
        peer.sock.close()
        self.peers.remove(peer)
