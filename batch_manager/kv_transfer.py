"""KV blocks over TCP between two instances (disaggregated context and generation): the context
side's `KvTransferServer` (a listening thread; one short connection per fetch) reads the blocks a
`kv_handoff.KvExports` keeps; the generation side's `fetch_blocks` receives them into host memory
and the model executor's `install_blocks` writes them into its own pool. `KvLayout` is what both
pools must share for the bytes to mean the same.

Wire (one connection per fetch): the client sends a frame {"version", "handle", "layout"}; the
server answers a frame {"error"} or {"num_tokens", "block_indexes", "shape", "num_value_bytes",
"num_scale_bytes"} followed by the raw bytes of the values [L, 2, n, tpb, H, D] (the pool's dtype)
and, for a quantized pool, of the float32 scales [L, 2, n, tpb, H]. A frame: 4-byte big-endian
length, msgpack.

NOTE: TCP rather than torch.distributed point to point: p2p needs both instances in one process
group formed up front (a fixed world, a rendezvous), and a peer that dies mid-send leaves the
group unusable; instances here start, stop and die independently. The bytes go through host
memory either way (gloo), at similar speeds into fresh memory (samples/microbench/disaggregated.py,
2 busy cores: 47 MB in 33-54 ms by socket, 36-56 ms by gloo, gloo's group setup aside).
"""
from __future__ import annotations

import hashlib
import logging
import socket
import struct
import threading
from dataclasses import asdict, dataclass, fields

import msgpack
import torch

from runtime.cache.kv_cache_manager import RELEASED

from .kv_handoff import ExportedKv, KvExports, KvWrites

logger = logging.getLogger(__name__)

WIRE_VERSION = 1
_LENGTH = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 24


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
        return cls(model, _weights_digest(engine.weights), str(engine.dtype).removeprefix("torch."),
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


def _weights_digest(weights: dict) -> str:
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

def _send_frame(sock: socket.socket, value) -> None:
    body = msgpack.packb(value, use_bin_type=True)
    sock.sendall(_LENGTH.pack(len(body)) + body)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    num_bytes, received = len(view), 0
    while received < num_bytes:
        n = sock.recv_into(view[received:], num_bytes - received)
        if n == 0:
            raise ConnectionError(f"the peer closed the connection after {received} of {num_bytes} bytes")
        received += n


def _recv_exact(sock: socket.socket, num_bytes: int) -> bytearray:
    buffer = bytearray(num_bytes)
    _recv_into(sock, memoryview(buffer))
    return buffer


def _recv_tensor(sock: socket.socket, num_bytes: int) -> torch.Tensor:
    """uint8 [num_bytes]. NOTE: into torch.empty, not bytearray: no zero-filling pass first (47 MB:
    33 ms instead of 48 on this machine)."""
    tensor = torch.empty(num_bytes, dtype=torch.uint8)
    _recv_into(sock, memoryview(tensor.numpy()))
    return tensor


def _recv_frame(sock: socket.socket):
    (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise ConnectionError(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})")
    return msgpack.unpackb(bytes(_recv_exact(sock, length)), raw=False)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of a contiguous tensor (the last dimension widened by the element size); shares
    its memory, so writes through it land in `t`."""
    assert t.is_contiguous()
    return t.view(torch.uint8)


# -- the context side --------------------------------------------------------------------------

class KvTransferServer:
    """Serves `exports` from `runner`'s pool on (host, a free port) until `close`. Each fetch takes
    its export (one fetch per export) and frees it after the send, sent or not."""

    def __init__(self, exports: KvExports, runner, layout: KvLayout, host: str, timeout_s: float):
        self.exports, self.runner, self.layout, self.timeout_s = exports, runner, layout, timeout_s
        self._listener = socket.create_server((host, 0))
        # What the params carry: a wildcard bind is reached through this host's name.
        self.address = (socket.getfqdn() if host in ("", "0.0.0.0", "::") else host, self._listener.getsockname()[1])
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="KvTransferServer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return   # closed
            threading.Thread(target=self._serve, args=(connection,), name="KvTransferSend", daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        handle = None
        with connection:
            try:
                connection.settimeout(self.timeout_s)
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                ask = _recv_frame(connection)
                if not isinstance(ask, dict) or ask.get("version") != WIRE_VERSION:
                    _send_frame(connection, {"error": f"unsupported fetch {str(ask)[:80]!r} (wire version "
                                                      f"{WIRE_VERSION} expected)"})
                    return
                mismatch = self.layout.mismatch(ask.get("layout"))
                if mismatch is not None:
                    _send_frame(connection, {"error": f"the two instances differ in {mismatch}"})
                    return
                taken = self.exports.take(ask.get("handle"))
                if isinstance(taken, str):
                    _send_frame(connection, {"error": taken})
                    return
                handle = taken.handle
                self._send_blocks(connection, taken)
                self.exports.finish(handle, sent=True)
            except (OSError, ValueError, msgpack.UnpackException) as e:
                logger.warning("KV transfer to a generation instance failed: %s", e)
            finally:
                if handle is not None:
                    self.exports.finish(handle, sent=False)

    def _send_blocks(self, connection: socket.socket, exported: ExportedKv) -> None:
        indexes = [j for j, b in enumerate(exported.block_ids) if b != RELEASED]
        ids = [exported.block_ids[j] for j in indexes]
        values = _as_bytes(self.runner.kv_pool)                 # uint8 [L, 2, N, tpb, H, D * size]
        scales = None if self.runner.kv_scales is None else _as_bytes(self.runner.kv_scales)   # [L, 2, N, tpb, H * 4]
        shape = [*values.shape[:2], len(ids), *values.shape[3:]]
        num_bytes = lambda pool: pool[:, :, :1].numel() * len(ids)   # noqa: E731
        _send_frame(connection, {"error": None, "num_tokens": exported.num_tokens, "block_indexes": indexes,
                                 "shape": shape, "num_value_bytes": num_bytes(values),
                                 "num_scale_bytes": 0 if scales is None else num_bytes(scales)})
        for pool in (values,) if scales is None else (values, scales):
            _send_pool_blocks(connection, pool, ids)


def _block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """[start, stop) of each run of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs


def _send_pool_blocks(connection: socket.socket, pool: torch.Tensor, block_ids: list[int]) -> None:
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
                    connection.sendall(memoryview(array[layer, kv, start:stop]).cast("B"))
        return
    ids = torch.tensor(block_ids, dtype=torch.int64, device=pool.device)
    connection.sendall(memoryview(pool.index_select(2, ids).cpu().numpy()).cast("B"))


# -- the generation side -----------------------------------------------------------------------

@dataclass(frozen=True)
class FetchedBlocks:
    """A context-only request's prompt KV, received into host memory."""
    num_tokens: int                         # prompt tokens the blocks cover
    block_indexes: tuple[int, ...]          # per fetched block: its position in the prompt's table
    values: torch.Tensor                    # uint8 [L, 2, n, tpb, H, D * element size]: the pool's bytes
    scales: torch.Tensor | None             # uint8 [L, 2, n, tpb, H * 4]: a quantized pool's float32 scales


def fetch_blocks(host: str, port: int, handle: int, layout: KvLayout, timeout_s: float) -> FetchedBlocks:
    """KvTransferError naming the address and the cause when the blocks cannot be fetched."""
    where = f"{host}:{port} (handle {handle})"
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _send_frame(sock, {"version": WIRE_VERSION, "handle": handle, "layout": layout.to_dict()})
            header = _recv_frame(sock)
            if not isinstance(header, dict) or header.get("error") is not None:
                error = header.get("error") if isinstance(header, dict) else f"a malformed answer {header!r}"
                raise KvTransferError(f"the context instance at {where} refused the fetch: {error}")
            values = _recv_tensor(sock, header["num_value_bytes"])
            scales = _recv_tensor(sock, header["num_scale_bytes"]) if header["num_scale_bytes"] else None
    except (OSError, ConnectionError) as e:
        raise KvTransferError(f"cannot fetch the KV blocks from the context instance at {where}: {e}") from None
    shape = header["shape"]
    return FetchedBlocks(header["num_tokens"], tuple(header["block_indexes"]), values.view(shape),
                         None if scales is None else scales.view(*shape[:-2], -1))


@torch.inference_mode()
def install_blocks(runner, writes: KvWrites) -> None:
    """Write the fetched blocks into `runner`'s pool (and scales) at the planned block ids."""
    device = runner.kv_pool.device
    dst = torch.tensor(writes.block_ids, dtype=torch.int64, device=device)
    src = torch.tensor(writes.slots, dtype=torch.int64)
    fetched = writes.fetched
    pool = _as_bytes(runner.kv_pool)
    if fetched.values.shape[:2] + fetched.values.shape[3:] != pool.shape[:2] + pool.shape[3:]:
        raise RuntimeError(f"fetched KV blocks of shape {list(fetched.values.shape)} (bytes) do not fit this pool's "
                           f"{list(pool.shape)}")
    pool.index_copy_(2, dst, fetched.values.index_select(2, src).to(device))
    if runner.kv_scales is not None:
        _as_bytes(runner.kv_scales).index_copy_(2, dst, fetched.scales.index_select(2, src).to(device))
