"""KV blocks over TCP between two instances (disaggregated context and generation): the context
side's `KvTransferServer` (a listening thread; one short connection per fetch) reads the blocks a
`kv_handoff.KvExports` keeps; the generation side's `fetch_blocks` receives them into host memory
and the model executor writes them (ModelRunner.read_blocks / write_blocks). The frames, the raw
bytes and `KvLayout` (what both pools must share for the bytes to mean the same) are kv_wire.py's.

Wire (one connection per fetch): the client sends a frame {"version", "handle", "layout"}; the
server answers a frame {"error"} or {"num_tokens", "block_indexes", "shape", "num_value_bytes",
"num_scale_bytes"} followed by the raw bytes of the values [L, 2, n, tpb, H, D] (the pool's dtype)
and, for a quantized pool, of the float32 scales [L, 2, n, tpb, H]. A frame: 4-byte big-endian
length, msgpack.

Limits (a peer is checked in size and time): `timeout_s` is a deadline from connect (accept) to the
last byte, on both sides; the ask frame is at most MAX_ASK_BYTES and the answer's header at most
what the request's blocks need; the server serves at most MAX_CONNECTIONS connections at once
(past it the oldest one still waiting for its ask is closed, or the new one when none waits).

NOTE: TCP rather than torch.distributed point to point: p2p needs both instances in one process
group formed up front (a fixed world, a rendezvous), and a peer that dies mid-send leaves the
group unusable; instances here start, stop and die independently. The bytes go through host
memory either way (gloo), at similar speeds into fresh memory (samples/microbench/disaggregated.py,
2 busy cores: 47 MB in 33-54 ms by socket, 36-56 ms by gloo, gloo's group setup aside).
"""
from __future__ import annotations

import logging
import math
import socket
import threading
import time
from dataclasses import dataclass

import msgpack
import torch

from runtime.cache.kv_cache_manager import RELEASED

from .kv_handoff import ExportedKv, KvExports
from .kv_wire import (MAX_ASK_BYTES, WIRE_VERSION, KvLayout, KvTransferError, abort, count_nonfinite, recv_frame,
                      recv_tensor, send_frame, send_pool_blocks)

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 16          # served at once by one server (a thread each)


# -- the context side --------------------------------------------------------------------------

class KvTransferServer:
    """Serves `exports` from `runner`'s pool on (host, a free port) until `close`. Each fetch takes
    its export (one fetch per export) and frees it after the send, sent or not. At most
    MAX_CONNECTIONS connections (a thread each) at once, each ended `timeout_s` after its accept."""

    def __init__(self, exports: KvExports, runner, layout: KvLayout, host: str, timeout_s: float):
        self.exports, self.runner, self.layout, self.timeout_s = exports, runner, layout, timeout_s
        self._listener = socket.create_server((host, 0))
        # What the params carry: a wildcard bind is reached through this host's name.
        self.address = (socket.getfqdn() if host in ("", "0.0.0.0", "::") else host, self._listener.getsockname()[1])
        self._closed = False
        self._lock = threading.Lock()
        self._num_serving = 0                                 # connections with a thread
        self._asking: dict[socket.socket, None] = {}          # of those, the ones whose ask has not come (oldest first)
        self._warned: set[str] = set()
        self.num_refused = self.num_failed = 0                # cumulative: connections past the bound, failed sends
        self._thread = threading.Thread(target=self._accept_loop, name="KvTransferServer", daemon=True)
        self._thread.start()

    @property
    def num_serving(self) -> int:
        return self._num_serving

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._thread.join(timeout=5)

    def _warn_once(self, kind: str, message: str, *args) -> None:
        """The first of a kind as a warning, the others at debug level (a flood of bad peers must
        not flood the log)."""
        level = logging.DEBUG if kind in self._warned else logging.WARNING
        self._warned.add(kind)
        logger.log(level, message + ("" if level == logging.DEBUG else " (later ones are logged at debug level)"),
                   *args)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return   # closed
            if not self._admit(connection):
                self.num_refused += 1
                self._warn_once("refused", "KV transfer: %d connections at once (the most served); a new one "
                                "was refused", MAX_CONNECTIONS)
                abort(connection)
                connection.close()
                continue
            threading.Thread(target=self._serve, args=(connection,), name="KvTransferSend", daemon=True).start()

    def _admit(self, connection: socket.socket) -> bool:
        """Take `connection` under the bound, closing the oldest one still waiting for its ask
        when the bound is reached; False when every served connection is sending."""
        with self._lock:
            if self._num_serving >= MAX_CONNECTIONS:
                if not self._asking:
                    return False
                oldest = next(iter(self._asking))
                del self._asking[oldest]
                abort(oldest)   # its thread ends at its next recv (and leaves the count then)
                self.num_refused += 1
            self._num_serving += 1
            self._asking[connection] = None
            return True

    def _serve(self, connection: socket.socket) -> None:
        handle = None
        deadline_s = time.monotonic() + self.timeout_s
        with connection:
            try:
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                ask = recv_frame(connection, MAX_ASK_BYTES, deadline_s)
                with self._lock:
                    if self._asking.pop(connection, False) is False:
                        return   # closed for a newer connection meanwhile
                if not isinstance(ask, dict) or ask.get("version") != WIRE_VERSION:
                    send_frame(connection, {"error": f"unsupported fetch {str(ask)[:80]!r} (wire version "
                                                      f"{WIRE_VERSION} expected)"}, deadline_s)
                    return
                mismatch = self.layout.mismatch(ask.get("layout"))
                if mismatch is not None:
                    send_frame(connection, {"error": f"the two instances differ in {mismatch}"}, deadline_s)
                    return
                taken = self.exports.take(ask.get("handle"))
                if isinstance(taken, str):
                    send_frame(connection, {"error": taken}, deadline_s)
                    return
                handle = taken.handle
                self._send_blocks(connection, taken, deadline_s)
                self.exports.finish(handle, sent=True)
            except (OSError, ValueError, TypeError, msgpack.UnpackException) as e:
                self.num_failed += 1
                self._warn_once("failed", "KV transfer to a generation instance failed: %s", e)
            finally:
                if handle is not None:
                    self.exports.finish(handle, sent=False)
                with self._lock:
                    self._asking.pop(connection, None)
                    self._num_serving -= 1

    def _send_blocks(self, connection: socket.socket, exported: ExportedKv, deadline_s: float) -> None:
        indexes = [j for j, b in enumerate(exported.block_ids) if b != RELEASED]
        ids = [exported.block_ids[j] for j in indexes]
        blocks = self.runner.read_blocks(ids)
        send_frame(connection, {"error": None, "num_tokens": exported.num_tokens, "block_indexes": indexes,
                                 **_answer_blocks(self.runner.kv_block_byte_shapes, len(ids))}, deadline_s)
        for parts in (blocks.values,) if blocks.scales is None else (blocks.values, blocks.scales):
            send_pool_blocks(connection, parts, deadline_s)


def _answer_blocks(block_byte_shapes: tuple, num_blocks: int) -> dict:
    """The answer's "shape", "num_value_bytes" and "num_scale_bytes" for `num_blocks` blocks of
    pools of these byte shapes less the block axis (ModelRunner.kv_block_byte_shapes)."""
    value_shape, scale_shape = block_byte_shapes
    return {"shape": [*value_shape[:2], num_blocks, *value_shape[2:]],
            "num_value_bytes": math.prod(value_shape) * num_blocks,
            "num_scale_bytes": 0 if scale_shape is None else math.prod(scale_shape) * num_blocks}


# -- the generation side -----------------------------------------------------------------------

@dataclass(frozen=True)
class FetchedBlocks:
    """A context-only request's prompt KV, received into host memory."""
    num_tokens: int                         # prompt tokens the blocks cover
    block_indexes: tuple[int, ...]          # per fetched block: its position in the prompt's table
    values: torch.Tensor                    # uint8 [L, 2, n, tpb, H, D * element size]: the pool's bytes
    scales: torch.Tensor | None             # uint8 [L, 2, n, tpb, H * 4]: a quantized pool's float32 scales


@dataclass(frozen=True)
class FetchExpectation:
    """What a generation-only request can take as an answer: its prompt's blocks in this pool's byte shapes."""
    num_tokens: int                          # the request's prompt length
    tokens_per_block: int
    block_byte_shapes: tuple                 # ModelRunner.kv_block_byte_shapes: (values, scales or None)
    kv_dtype: str = "float32"                # the pool's element dtype (KvLayout.kv_cache_dtype): what the values hold

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.tokens_per_block)

    @property
    def max_header_bytes(self) -> int:
        return 1024 + 9 * self.num_blocks   # the keys and shape, plus a msgpack int (<= 9 bytes) per index


class OpenSockets:
    """The sockets of the fetches under way, so that `abort_all` (shutdown) ends them at once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._is_aborted = False

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            if self._is_aborted:
                raise ConnectionError("the fetch was aborted (shutdown)")
            self._sockets.add(sock)

    def discard(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)

    def abort_all(self) -> None:
        """End every fetch under way (its next recv fails) and refuse new ones."""
        with self._lock:
            self._is_aborted = True
            sockets = list(self._sockets)
        for sock in sockets:
            abort(sock)


def fetch_blocks(host: str, port: int, handle: int, layout: KvLayout, timeout_s: float, expect: FetchExpectation,
                 open_sockets: OpenSockets | None = None) -> FetchedBlocks:
    """KvTransferError naming the address and the cause when the blocks cannot be fetched within
    `timeout_s` (connect to last byte), or the answer is not one of `expect`. open_sockets: where
    the connection is registered while it is open."""
    where = f"{host}:{port} (handle {handle})"
    deadline_s = time.monotonic() + timeout_s
    open_sockets = OpenSockets() if open_sockets is None else open_sockets
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            open_sockets.add(sock)
            try:
                header, values, scales = _fetch_over(sock, handle, layout, expect, where, deadline_s)
            finally:
                open_sockets.discard(sock)
    except TimeoutError:   # socket.timeout
        raise KvTransferError(f"cannot fetch the KV blocks from the context instance at {where}: not all there "
                              f"by the deadline (kv_transfer_timeout_ms {round(timeout_s * 1000)}, connect to "
                              f"last byte)") from None
    except (OSError, ValueError, msgpack.UnpackException) as e:
        raise KvTransferError(f"cannot fetch the KV blocks from the context instance at {where}: {e}") from None
    shape = header["shape"]
    return FetchedBlocks(header["num_tokens"], tuple(header["block_indexes"]), values.view(shape),
                         None if scales is None else scales.view(*shape[:-2], -1))


def _fetch_over(sock: socket.socket, handle: int, layout: KvLayout, expect: FetchExpectation, where: str,
                deadline_s: float) -> tuple[dict, torch.Tensor, torch.Tensor | None]:
    """(the answer's header, the values' bytes, the scales' bytes or None)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    send_frame(sock, {"version": WIRE_VERSION, "handle": handle, "layout": layout.to_dict()}, deadline_s)
    header = recv_frame(sock, expect.max_header_bytes, deadline_s)
    if not isinstance(header, dict) or header.get("error") is not None:
        error = header.get("error") if isinstance(header, dict) else f"a malformed answer {str(header)[:80]}"
        raise KvTransferError(f"the context instance at {where} refused the fetch: {str(error)[:200]}")
    problem = _answer_problem(header, expect)
    if problem is not None:
        raise KvTransferError(f"the context instance at {where} answered {problem}")
    values = recv_tensor(sock, header["num_value_bytes"], deadline_s)
    scales = recv_tensor(sock, header["num_scale_bytes"], deadline_s) if header["num_scale_bytes"] else None
    for name, data, dtype in (("values", values, expect.kv_dtype), ("scales", scales, "float32")):
        num_bad = 0 if data is None else count_nonfinite(data, dtype)
        if num_bad:
            raise KvTransferError(f"the context instance at {where} sent KV {name} holding {num_bad} NaN or "
                                  f"infinite {dtype} elements")
    return header, values, scales


def _is_int(value) -> bool:
    return type(value) is int


def _answer_problem(header: dict, expect: FetchExpectation) -> str | None:
    """'field value: why' for an answer header that is not one of the request's prompt blocks, else None."""
    num_tokens, indexes = header.get("num_tokens"), header.get("block_indexes")
    if not _is_int(num_tokens) or num_tokens != expect.num_tokens:
        return f"num_tokens {num_tokens!r}: the request's prompt has {expect.num_tokens} tokens"
    if not isinstance(indexes, list) or not all(_is_int(j) for j in indexes) or not indexes \
            or any(b <= a for a, b in zip(indexes, indexes[1:])) or indexes[0] < 0 or indexes[-1] >= expect.num_blocks:
        return (f"block_indexes {str(indexes)[:80]}: expected increasing indexes in [0, {expect.num_blocks}) "
                f"(the prompt's blocks)")
    expected = _answer_blocks(expect.block_byte_shapes, len(indexes))
    if header.get("shape") != expected["shape"]:
        return (f"shape {str(header.get('shape'))[:80]}: expected {expected['shape']} (one block per index, "
                f"this pool's layout)")
    for field in ("num_value_bytes", "num_scale_bytes"):
        if not _is_int(header.get(field)) or header[field] != expected[field]:
            return f"{field} {header.get(field)!r}: expected {expected[field]}"
    return None
