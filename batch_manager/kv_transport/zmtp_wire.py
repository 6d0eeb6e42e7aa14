"""ZMTP 3.0 on the wire, for the two KV-events endpoints (zmtp_endpoint.py serves them): frames,
the greeting and READY of a NULL-mechanism socket, a listening socket for "tcp" / "ipc"
addresses, and `ZmtpPeer`, one connection's handshake stage and its bounded, incremental parse.
"""
from __future__ import annotations

import os
import socket
import stat
import struct
import time
from collections import deque

GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
GREETING_BYTES = 64
MORE, LONG, COMMAND = 0x01, 0x02, 0x04
MAX_COMMAND_BYTES = 1024


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


def frame_header(size: int, more: bool) -> bytes:
    """The header of one data frame of `size` bytes (its body sent apart, unjoined)."""
    flags = MORE if more else 0
    return struct.pack(">BQ", flags | LONG, size) if size > 255 else struct.pack(">BB", flags, size)


def ready_command(socket_type: bytes) -> bytes:
    """Our READY: the NULL mechanism's metadata, Socket-Type only."""
    return encode_frames([b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type],
                         COMMAND)


def bind_listener(address: tuple[str, str | tuple[str, int]], backlog: int) -> socket.socket:
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
        listener.listen(backlog)
    except BaseException:
        listener.close()
        raise
    listener.setblocking(False)
    return listener


def metadata_property(data: bytes, wanted: bytes) -> bytes | None:
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


class ZmtpPeer:
    """One connection: its handshake stage, the bytes read and not yet parsed (at most a greeting,
    a frame header, a command or a frame's first `head_bytes`), the bytes queued for it (time
    stamps in time.monotonic() seconds)."""

    def __init__(self, sock: socket.socket, now: float, handshake_deadline_s: float):
        self.sock = sock
        self.stage = "greeting"        # -> "handshake" (their READY) -> "open"
        self.inbound = bytearray()
        self.skip = 0                  # bytes of a data frame still to discard
        self.accepted_at = now
        self.deadline = handshake_deadline_s
        self.read_paused_until = 0.0
        self.outbound: deque[memoryview] = deque()
        self.queued_bytes = 0
        self.last_write_at = now       # the last time the socket took bytes (or the queue was empty)
        self.events = 0                # what the selector watches for it

    def queue(self, data) -> None:
        if not self.outbound:
            self.last_write_at = time.monotonic()   # waiting for the socket starts now
        self.outbound.append(memoryview(data))
        self.queued_bytes += len(data)

    def parse(self, on_command, on_data_frame, head_bytes: int) -> bool:
        """Handle what `inbound` holds: on_command(name, data) for each command (the handshake's
        READY included), on_data_frame(head, size, more) once per data frame with up to its first
        `head_bytes` bytes (the rest is discarded unread). False (drop the peer) when the peer broke
        the protocol or a callback returned False."""
        buf, pos = self.inbound, 0
        if self.stage == "greeting":
            if len(buf) < GREETING_BYTES:
                return not buf or buf[0] == 0xFF
            if not (buf[0] == 0xFF and buf[9] & 1 and buf[10] >= 3 and bytes(buf[12:32]).rstrip(b"\0") == b"NULL"):
                return False
            self.stage, pos = "handshake", GREETING_BYTES
        while len(buf) - pos >= 2:
            flags = buf[pos]
            header = 9 if flags & LONG else 2
            if len(buf) - pos < header:
                break
            size = int.from_bytes(buf[pos + 1:pos + header], "big")
            if flags & COMMAND or self.stage == "handshake":
                if not flags & COMMAND or size > MAX_COMMAND_BYTES:
                    return False
                if len(buf) - pos - header < size:
                    break
                body = bytes(buf[pos + header:pos + header + size])
                name, data = (body[1:1 + body[0]], body[1 + body[0]:]) if body else (b"", b"")
                if not on_command(name, data):
                    return False
                pos += header + size
            else:
                head = min(size, head_bytes)
                if len(buf) - pos - header < head:
                    break
                if not on_data_frame(bytes(buf[pos + header:pos + header + head]), size, bool(flags & MORE)):
                    return False
                n = min(size, len(buf) - pos - header)
                pos += header + n
                self.skip = size - n
        del buf[:pos]
        return True

    def consume(self, data: bytes) -> bytes:
        """`data` less the part of a discarded frame still being skipped."""
        if self.skip:
            n = min(self.skip, len(data))
            self.skip, data = self.skip - n, data[n:]
        return data
