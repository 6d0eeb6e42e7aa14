"""Hostile context instances for the disaggregated tests: a proxy that rewrites the answer header of
a real KV transfer server, a peer that drips one byte at a time, and params pointed at either."""
from __future__ import annotations

import socket
import threading
import time
from typing import Callable

import msgpack

from batch_manager.executor import ContextPhaseParams


def _recv_exact(sock: socket.socket, num_bytes: int) -> bytes:
    data = b""
    while len(data) < num_bytes:
        chunk = sock.recv(num_bytes - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def _recv_frame(sock: socket.socket):
    """A frame of the transfer's wire (4-byte big-endian length, msgpack), read on its own terms."""
    return msgpack.unpackb(_recv_exact(sock, int.from_bytes(_recv_exact(sock, 4), "big")), raw=False)


def _send_frame(sock: socket.socket, value) -> None:
    body = msgpack.packb(value, use_bin_type=True)
    sock.sendall(len(body).to_bytes(4, "big") + body)


def params_to(params: bytes | ContextPhaseParams, address: tuple[str, int], **state) -> ContextPhaseParams:
    """`params` with its opaque_state's host and port set to `address` (and any other fields in `state`)."""
    params = params if isinstance(params, ContextPhaseParams) else ContextPhaseParams.from_bytes(params)
    fields = msgpack.unpackb(params.opaque_state)
    fields.update(host=address[0], port=address[1], **state)
    return ContextPhaseParams(params.first_gen_tokens, params.req_id, msgpack.packb(fields, use_bin_type=True))


class _Peer:
    """A listening socket on 127.0.0.1 with a thread per connection running `self.handle`."""

    def __init__(self):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()[:2]
        self._closed = threading.Event()
        self.num_connections = 0
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            self.num_connections += 1
            threading.Thread(target=self._handle_closing, args=(connection,), daemon=True).start()

    def _handle_closing(self, connection: socket.socket) -> None:
        with connection:
            try:
                self.handle(connection)
            except OSError:
                pass

    def handle(self, connection: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TamperingProxy(_Peer):
    """Forwards a fetch to the real server at `target`, rewriting its answer header with `edit`."""

    def __init__(self, target: tuple[str, int], edit: Callable[[dict], dict]):
        self.target, self.edit = target, edit
        super().__init__()

    def handle(self, connection: socket.socket) -> None:
        with socket.create_connection(self.target, timeout=30) as upstream:
            _send_frame(upstream, _recv_frame(connection))
            header = _recv_frame(upstream)
            _send_frame(connection, self.edit(dict(header)) if header.get("error") is None else header)
            while data := upstream.recv(1 << 16):
                connection.sendall(data)


class DrippingPeer(_Peer):
    """Reads the ask, then sends an answer frame of 1000 bytes (within any request's header limit)
    one byte every `interval_s` until the other side goes: minutes for the whole."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        super().__init__()

    def handle(self, connection: socket.socket) -> None:
        connection.recv(1 << 16)
        frame = (1000).to_bytes(4, "big") + b"\xc0" * 1000
        for i in range(len(frame)):
            if self._closed.is_set():
                return
            connection.sendall(frame[i:i + 1])
            time.sleep(self.interval_s)


class PoisoningProxy(TamperingProxy):
    """Forwards a fetch to the real server at `target` with its header intact and every byte of the
    KV that follows replaced by 0xFF: the right shape, every element NaN (float pools, scales)."""

    def __init__(self, target: tuple[str, int]):
        super().__init__(target, lambda header: header)

    def handle(self, connection: socket.socket) -> None:
        with socket.create_connection(self.target, timeout=30) as upstream:
            _send_frame(upstream, _recv_frame(connection))
            _send_frame(connection, _recv_frame(upstream))
            while data := upstream.recv(1 << 16):
                connection.sendall(b"\xff" * len(data))


def nested(depth: int, leaf=0):
    """A list `depth` levels deep around `leaf`."""
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


class DeepHeaderPeer(_Peer):
    """Reads the ask and answers a header with one field nested `depth` levels deep."""

    def __init__(self, field: str, depth: int):
        self.field, self.depth = field, depth
        super().__init__()

    def handle(self, connection: socket.socket) -> None:
        _recv_frame(connection)
        header = {"error": None, "num_tokens": 18, "block_indexes": [0], "shape": [1], "num_value_bytes": 1,
                  "num_scale_bytes": 0}
        _send_frame(connection, dict(header, **{self.field: nested(self.depth)}))
        connection.recv(1)
