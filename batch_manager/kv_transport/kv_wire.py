"""The KV transfer's wire (kv_transfer.py's two sides share it): `KvLayout`, what both pools must
share for the bytes to mean the same; frames (4-byte big-endian length, msgpack) and raw bytes
sent and received against one deadline for the whole exchange; a pool's blocks sent from where
they lie (ModelRunner.read_blocks)."""
from __future__ import annotations

import socket
import struct
import time
from dataclasses import asdict, dataclass, fields

import msgpack
import numpy
import torch

WIRE_VERSION = 1
_LENGTH = struct.Struct(">I")
MAX_ASK_BYTES = 1 << 16       # the ask is ~300 bytes (version, handle, layout)
MAX_FRAME_DEPTH = 8           # containers within containers in a frame (the ask and answer have 2)
# KV storage dtype -> (the unsigned view of one element, its bits less the sign, the least such
# bits of a NaN or an infinity: every bit of the exponent set)
_NONFINITE_BITS = {"float32": (numpy.uint32, 0x7FFFFFFF, 0x7F800000), "float16": (numpy.uint16, 0x7FFF, 0x7C00),
                   "bfloat16": (numpy.uint16, 0x7FFF, 0x7F80), "float8_e4m3fn": (numpy.uint8, 0x7F, 0x7F)}
_CHECK_CHUNK = 1 << 22        # elements per pass of the non-finite check (bounds its temporaries)


class KvTransferError(RuntimeError):
    """A fetch failed: the context side is unreachable, refused the handle, or broke off."""


@dataclass(frozen=True)
class KvLayout:
    """What makes one instance's KV blocks readable by another: the same model (its shape fields
    and a digest of a sample of its weights: a different checkpoint of the same shape is caught
    with near certainty, identical weights are not proven), dtypes, block size and parallel layout."""
    model: str
    weights_digest: str
    dtype: str
    kv_cache_dtype: str
    tokens_per_block: int
    tensor_parallelism: int
    pipeline_parallelism: int

    @classmethod
    def of(cls, runner) -> "KvLayout":
        cfg = runner.model_config
        tp = runner.tensor_parallel
        tp_size = 1 if tp is None else tp.size
        world_size = 1 if tp is None else tp.world_size
        model = (f"{cfg.architecture} layers={cfg.num_layers} hidden={cfg.hidden_size} heads={cfg.num_heads} "
                 f"kv_heads={cfg.num_kv_heads} head_dim={cfg.head_dim} vocab={cfg.vocab_size}")
        return cls(model, runner.weights_fingerprint, str(runner.dtype).removeprefix("torch."),
                   str(runner.kv_storage_dtype).removeprefix("torch."), runner.tokens_per_block, tp_size,
                   world_size // tp_size)

    def to_dict(self) -> dict:
        return asdict(self)

    def mismatch(self, other: dict) -> str | None:
        """The first field where `other` (a peer's to_dict) differs: 'field: X there, Y here'."""
        for f in fields(self):
            theirs = other.get(f.name) if isinstance(other, dict) else None
            if theirs != getattr(self, f.name):
                return f"{f.name}: {theirs!r} there, {getattr(self, f.name)!r} here"
        return None


# -- frames ------------------------------------------------------------------------------------

def _remaining_s(sock: socket.socket, deadline_s: float) -> None:
    """Set the socket's timeout to what is left until `deadline_s` (monotonic); timeout if none."""
    left = deadline_s - time.monotonic()
    if left <= 0:
        raise socket.timeout("the transfer's deadline passed")
    sock.settimeout(left)


def send_frame(sock: socket.socket, value, deadline_s: float) -> None:
    body = msgpack.packb(value, use_bin_type=True)
    sendall(sock, _LENGTH.pack(len(body)) + body, deadline_s)


def sendall(sock: socket.socket, data, deadline_s: float) -> None:
    _remaining_s(sock, deadline_s)
    sock.sendall(data)


def _recv_into(sock: socket.socket, view: memoryview, deadline_s: float) -> None:
    num_bytes, received = len(view), 0
    while received < num_bytes:
        _remaining_s(sock, deadline_s)   # a deadline for the whole, not per recv: a dripping peer ends too
        n = sock.recv_into(view[received:], num_bytes - received)
        if n == 0:
            raise ConnectionError(f"the peer closed the connection after {received} of {num_bytes} bytes")
        received += n


def recv_tensor(sock: socket.socket, num_bytes: int, deadline_s: float) -> torch.Tensor:
    """uint8 [num_bytes]. NOTE: into torch.empty, not bytearray: no zero-filling pass first (47 MB:
    33 ms instead of 48 on this machine)."""
    tensor = torch.empty(num_bytes, dtype=torch.uint8)
    _recv_into(sock, memoryview(tensor.numpy()), deadline_s)
    return tensor


def recv_frame(sock: socket.socket, max_bytes: int, deadline_s: float):
    length_bytes = bytearray(_LENGTH.size)
    _recv_into(sock, memoryview(length_bytes), deadline_s)
    (length,) = _LENGTH.unpack(length_bytes)
    if length > max_bytes:
        raise ValueError(f"a frame of {length} bytes (at most {max_bytes} here)")
    body = bytearray(length)
    _recv_into(sock, memoryview(body), deadline_s)
    value = msgpack.unpackb(bytes(body), raw=False)
    if is_nested_deeper(value, MAX_FRAME_DEPTH):
        raise ValueError(f"a frame nested deeper than {MAX_FRAME_DEPTH} levels")
    return value


def is_nested_deeper(value, max_depth: int) -> bool:
    """Whether lists and dicts in `value` nest more than `max_depth` levels (checked without
    recursion: a peer's 1,000-deep value would exhaust Python's stack in a repr or a compare)."""
    level = [value]
    for _ in range(max_depth):
        inner = []
        for item in level:
            if isinstance(item, dict):
                inner.extend(item.keys())
                inner.extend(item.values())
            elif isinstance(item, (list, tuple)):
                inner.extend(item)
        if not inner:
            return False
        level = inner
    return any(isinstance(item, (dict, list, tuple)) for item in level)


def count_nonfinite(data: torch.Tensor, dtype: str) -> int:
    """NaN and infinite elements in `data` (uint8 bytes of `dtype` elements; 0 for integer dtypes):
    per chunk, the largest magnitude's bits against the exponent's (two vector passes; counted
    only when some are there).

    NOTE: numpy on the bits, not a torch op: it runs on a fetch thread, where a torch op could start
    an OpenMP pool of its own (send_pool_blocks' note); and numpy has no bfloat16."""
    if dtype not in _NONFINITE_BITS:
        return 0
    view, magnitude, nonfinite = _NONFINITE_BITS[dtype]
    elements = data.numpy().view(view)
    scratch = numpy.empty(min(elements.size, _CHECK_CHUNK), view)
    count = 0
    for i in range(0, elements.size, _CHECK_CHUNK):
        part = elements[i:i + _CHECK_CHUNK]
        chunk = numpy.bitwise_and(part, magnitude, out=scratch[:part.size])
        if chunk.max() >= nonfinite:
            count += int(numpy.count_nonzero(chunk >= nonfinite))
    return count


def abort(connection: socket.socket) -> None:
    """Wake a thread blocked on `connection` (its recv returns at once); the thread closes it."""
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def send_pool_blocks(connection: socket.socket, parts: tuple[torch.Tensor, ...], deadline_s: float) -> None:
    """The bytes of a pool's blocks [L, 2, n, ...] in that order, from `parts` along the block axis
    (ModelRunner.read_blocks: a CPU pool's are sent from where they lie, no gathering copy), one
    layer and K/V of each part at a time.

    NOTE: numpy views, not torch ops: a torch op on this thread could start an OpenMP pool of its
    own, which slows the worker's forwards (engine_builder.start_worker)."""
    for layer in zip(*(part.numpy() for part in parts)):
        for plane in zip(*layer):   # K, then V
            for blocks in plane:
                sendall(connection, memoryview(blocks).cast("B"), deadline_s)
