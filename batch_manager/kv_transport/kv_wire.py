"""The KV transfer's wire (kv_transfer.py's two sides share it): `KvLayout`, what both pools must
share for the bytes to mean the same; frames (4-byte big-endian length, msgpack) and raw bytes
sent and received against one deadline for the whole exchange; a pool's blocks sent from where
they lie."""
from __future__ import annotations

import hashlib
import socket
import struct
import time
from dataclasses import asdict, dataclass, fields

import msgpack
import torch

WIRE_VERSION = 1
_LENGTH = struct.Struct(">I")
MAX_ASK_BYTES = 1 << 16       # the ask is ~300 bytes (version, handle, layout)


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
        cfg, engine = runner.model_config, runner.engine
        tp = runner.tensor_parallel
        tp_size = 1 if tp is None else tp.size
        world_size = 1 if tp is None else tp.world_size
        model = (f"{cfg.architecture} layers={cfg.num_layers} hidden={cfg.hidden_size} heads={cfg.num_heads} "
                 f"kv_heads={cfg.num_kv_heads} head_dim={cfg.head_dim} vocab={cfg.vocab_size}")
        return cls(model, weights_digest(engine.weights), str(engine.dtype).removeprefix("torch."),
                   str(engine.kv_storage_dtype).removeprefix("torch."), runner.tokens_per_block, tp_size,
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


def weights_digest(weights: dict) -> str:
    """blake2b over each weight's name, shape, dtype and its first and last 32 elements' bytes."""
    digest = hashlib.blake2b(digest_size=8)
    for name in sorted(weights):
        t = weights[name]
        digest.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        try:
            flat = t.detach().reshape(-1)
            for part in (flat[:32], flat[-32:]):
                digest.update(part.cpu().contiguous().view(torch.uint8).numpy().tobytes())
        except (RuntimeError, TypeError):   # an opaque (reordered) tensor: its name and shape only
            pass
    return digest.hexdigest()


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
    return msgpack.unpackb(bytes(body), raw=False)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of a contiguous tensor (the last dimension widened by the element size); shares
    its memory, so writes through it land in `t`."""
    assert t.is_contiguous()
    return t.view(torch.uint8)



def abort(connection: socket.socket) -> None:
    """Wake a thread blocked on `connection` (its recv returns at once); the thread closes it."""
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """[start, stop) of each run of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs


def send_pool_blocks(connection: socket.socket, pool: torch.Tensor, block_ids: list[int], deadline_s: float) -> None:
    """The bytes of `pool`'s blocks [L, 2, n, ...] in that order. A CPU pool is sent from where it
    lies, a run of consecutive blocks per layer and K/V at a time (no gathering copy); a GPU pool
    is gathered on the device, then copied to the host.

    NOTE: numpy views for a CPU pool, not torch ops: a torch op on this thread could start an
    OpenMP pool of its own, which slows the worker's forwards (engine_builder.start_worker)."""
    if pool.device.type == "cpu":
        array = pool.numpy()
        runs = _block_runs(block_ids)
        for layer in range(array.shape[0]):
            for kv in range(array.shape[1]):
                for start, stop in runs:
                    sendall(connection, memoryview(array[layer, kv, start:stop]).cast("B"), deadline_s)
        return
    ids = torch.tensor(block_ids, dtype=torch.int64, device=pool.device)
    sendall(connection, memoryview(pool.index_select(2, ids).cpu().numpy()).cast("B"), deadline_s)
