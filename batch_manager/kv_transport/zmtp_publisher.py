"""A ZMTP 3.0 PUB endpoint (what ZMQ SUB sockets connect to) that keeps no subscription state.

Owned by kv_events_publisher.KvEventPublisher: `send` (the worker thread) queues a message and
returns; the endpoint's own thread accepts subscribers, does the handshake and writes to them.

NOTE: libzmq's PUB and XPUB keep a trie of every distinct prefix each peer subscribes to and
update it inside `send`: one peer flooding unique prefixes stalled the sender for seconds and
grew the process by gigabytes. Here every subscriber gets every message (a SUB socket filters by
topic itself) and what a peer sends after its handshake is read at a bounded rate and discarded,
PINGs answered. State per subscriber: its socket and at most `send_hwm` queued messages.
"""
from __future__ import annotations

import logging
import os
import selectors
import socket
import stat
import struct
import threading
import time
from collections import deque

logger = logging.getLogger(__name__)

MAX_SUBSCRIBERS = 64              # connections beyond this are closed at once
MAX_QUEUED_BYTES = 64 << 20       # per subscriber, beside the send_hwm message count
HANDSHAKE_TIMEOUT_S = 10.0
READ_CHUNK_BYTES = 4096
READ_PAUSE_S = 0.25               # a peer that filled a chunk is not read for this long: <= 16 KiB/s each
MAX_COMMAND_BYTES = 1024
GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
GREETING_BYTES = 64
MORE, LONG, COMMAND = 0x01, 0x02, 0x04
PEER_SOCKET_TYPES = (b"SUB", b"XSUB")


def encode_frames(frames: list[bytes], flags: int = 0) -> bytes:
    """ZMTP 3.0 frames of one message: flags, size (1 byte, or 8 big-endian with LONG), body."""
    parts = []
    for i, body in enumerate(frames):
        more = MORE if i + 1 < len(frames) else 0
        if len(body) > 255:
            parts.append(struct.pack(">BQ", flags | more | LONG, len(body)))
        else:
            parts.append(struct.pack(">BB", flags | more, len(body)))
        parts.append(body)
    return b"".join(parts)


READY = encode_frames([b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 3) + b"PUB"], COMMAND)


def bind_listener(address: tuple[str, str | tuple[str, int]]) -> socket.socket:
    """A listening, non-blocking socket for ("tcp", (host, port)) or ("ipc", path); OSError if not."""
    kind, where = address
    if kind == "ipc":
        if os.path.exists(where) and stat.S_ISSOCK(os.stat(where).st_mode):
            os.unlink(where)   # as libzmq: a bind takes a left-over socket path over
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        family, _, _, _, where = socket.getaddrinfo(where[0] or None, where[1], type=socket.SOCK_STREAM,
                                                    flags=socket.AI_PASSIVE)[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(where)
        listener.listen(MAX_SUBSCRIBERS)
    except BaseException:
        listener.close()
        raise
    listener.setblocking(False)
    return listener


class _Peer:
    """One connection: its handshake stage, the bytes read and not yet parsed (bounded), the
    messages queued for it."""

    def __init__(self, sock: socket.socket, now: float):
        self.sock = sock
        self.stage = "greeting"        # -> "handshake" (their READY) -> "open" (it gets messages)
        self.inbound = bytearray()     # at most a greeting, a frame header and a command
        self.skip = 0                  # bytes of a data frame still to discard
        self.deadline = now + HANDSHAKE_TIMEOUT_S   # for the handshake
        self.read_paused_until = 0.0
        self.outbound: deque[memoryview] = deque()
        self.queued_bytes = 0
        self.events = 0                # what the selector watches for it


class ZmtpPublisher:
    """Binds `address` (see bind_listener) and serves it on its own thread until `close`."""

    def __init__(self, address, send_hwm: int):
        self._send_hwm = send_hwm
        self._inbox: deque[bytes] = deque()   # worker -> thread; at most send_hwm messages
        self.num_inbox_dropped = 0            # written by the worker thread only
        self.num_peer_dropped = 0             # written by the endpoint's thread only
        self._listener = bind_listener(address)
        self._path = address[1] if address[0] == "ipc" else None
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, "listener")
        self._selector.register(self._wake_reader, selectors.EVENT_READ, "wake")
        self._peers: list[_Peer] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="KvEventsPublisher", daemon=True)
        self._thread.start()

    @property
    def num_dropped(self) -> int:
        """Messages some subscriber did not get for lack of room (or that the thread fell behind on)."""
        return self.num_inbox_dropped + self.num_peer_dropped

    @property
    def num_subscribers(self) -> int:
        return sum(1 for peer in self._peers if peer.stage == "open")

    def send(self, frames: list[bytes]) -> None:
        """Queue one message for every subscriber; never waits."""
        if len(self._inbox) >= self._send_hwm:
            self.num_inbox_dropped += 1
            return
        self._inbox.append(encode_frames(frames))
        self._wake()

    def close(self) -> None:
        """Hand out what is queued (what a socket takes without waiting), then close everything."""
        self._stopping = True
        self._wake()
        self._thread.join()

    def _wake(self) -> None:
        try:
            self._wake_writer.send(b"\x00")
        except OSError:
            pass   # a wake-up is pending already (or the thread is gone)

    # -- the endpoint's thread ------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while True:
                for key, mask in self._selector.select(self._select_timeout_s()):
                    if key.data == "listener":
                        self._accept()
                    elif key.data == "wake":
                        self._drain_wake()
                    elif key.data in self._peers:
                        self._on_ready(key.data, mask)
                self._distribute()
                if self._stopping:
                    return
                self._check_timers()
        except Exception:
            logger.exception("KV events publisher thread failed; events are no longer published")
        finally:
            for peer in list(self._peers):
                self._drop_peer(peer)
            self._selector.close()
            self._listener.close()
            self._wake_reader.close()
            self._wake_writer.close()
            if self._path is not None and os.path.exists(self._path):
                os.unlink(self._path)

    def _select_timeout_s(self) -> float:
        now, timeout = time.monotonic(), 1.0
        for peer in self._peers:
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
                logger.warning("KV events publisher: accept failed: %s", e)
                return
            if len(self._peers) >= MAX_SUBSCRIBERS:
                sock.close()
                continue
            sock.setblocking(False)
            peer = _Peer(sock, time.monotonic())
            self._peers.append(peer)
            self._queue(peer, GREETING + READY)   # ours need not wait for theirs
            self._update_events(peer)

    def _drain_wake(self) -> None:
        try:
            while self._wake_reader.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _on_ready(self, peer: _Peer, mask: int) -> None:
        ok = not mask & selectors.EVENT_READ or self._read(peer)
        if ok and mask & selectors.EVENT_WRITE:
            ok = self._flush(peer)
        if ok:
            self._update_events(peer)
        else:
            self._drop_peer(peer)

    def _read(self, peer: _Peer) -> bool:
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
        if peer.skip:
            n = min(peer.skip, len(data))
            peer.skip, data = peer.skip - n, data[n:]
        peer.inbound += data
        return self._parse(peer)

    def _parse(self, peer: _Peer) -> bool:
        buf, pos = peer.inbound, 0
        if peer.stage == "greeting":
            if len(buf) < GREETING_BYTES:
                return not buf or buf[0] == 0xFF
            if not (buf[0] == 0xFF and buf[9] & 1 and buf[10] >= 3 and bytes(buf[12:32]).rstrip(b"\0") == b"NULL"):
                return False
            peer.stage, pos = "handshake", GREETING_BYTES
        while len(buf) - pos >= 2:
            flags = buf[pos]
            header = 9 if flags & LONG else 2
            if len(buf) - pos < header:
                break
            size = int.from_bytes(buf[pos + 1:pos + header], "big")
            if flags & COMMAND or peer.stage == "handshake":
                if not flags & COMMAND or size > MAX_COMMAND_BYTES:
                    return False
                if len(buf) - pos - header < size:
                    break
                if not self._command(peer, bytes(buf[pos + header:pos + header + size])):
                    return False
                pos += header + size
            else:   # a subscription (or anything else a peer sends): skipped unread
                n = min(size, len(buf) - pos - header)
                pos += header + n
                peer.skip = size - n
        del buf[:pos]
        return True

    def _command(self, peer: _Peer, body: bytes) -> bool:
        name, data = body[1:1 + body[0]] if body else b"", body[1 + body[0]:] if body else b""
        if peer.stage == "handshake":
            if name != b"READY" or _property(data, b"Socket-Type") not in PEER_SOCKET_TYPES:
                return False
            peer.stage = "open"
        elif name == b"PING" and len(data) >= 2:
            self._queue(peer, encode_frames([b"\x04PONG" + data[2:18]], COMMAND))
        return True

    def _distribute(self) -> None:
        while self._inbox:
            message = memoryview(self._inbox.popleft())
            dropped = False
            for peer in self._peers:
                if peer.stage != "open":
                    continue
                if len(peer.outbound) >= self._send_hwm or peer.queued_bytes + len(message) > MAX_QUEUED_BYTES:
                    dropped = True
                else:
                    self._queue(peer, message)
            self.num_peer_dropped += dropped
        for peer in list(self._peers):
            if peer.outbound and not peer.events & selectors.EVENT_WRITE:
                if self._flush(peer):
                    self._update_events(peer)
                else:
                    self._drop_peer(peer)

    def _check_timers(self) -> None:
        now = time.monotonic()
        for peer in list(self._peers):
            if peer.stage != "open" and now > peer.deadline:
                self._drop_peer(peer)
                continue
            if peer.read_paused_until and now >= peer.read_paused_until:
                peer.read_paused_until = 0.0
                self._update_events(peer)

    def _queue(self, peer: _Peer, data) -> None:
        peer.outbound.append(memoryview(data))
        peer.queued_bytes += len(data)

    def _flush(self, peer: _Peer) -> bool:
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
            if n == len(head):
                peer.outbound.popleft()
            else:
                peer.outbound[0] = head[n:]
        return True

    def _update_events(self, peer: _Peer) -> None:
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

    def _drop_peer(self, peer: _Peer) -> None:
        if peer.events:
            self._selector.unregister(peer.sock)
        peer.sock.close()
        self._peers.remove(peer)


def _property(data: bytes, wanted: bytes) -> bytes | None:
    """The value of one ZMTP metadata property: name length (1 byte), name, value length (4), value."""
    pos = 0
    while pos < len(data):
        n = data[pos]
        name, pos = data[pos + 1:pos + 1 + n], pos + 1 + n
        size = int.from_bytes(data[pos:pos + 4], "big")
        value, pos = data[pos + 4:pos + 4 + size], pos + 4 + size
        if name.lower() == wanted.lower():
            return value
    return None
