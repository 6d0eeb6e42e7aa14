"""KV-cache events on the wire, in vLLM's format (ZMQ + msgpack), for routers in other processes.

`WireEventCollector` is the KV manager's event sink on the worker thread: it turns stores and
evictions into vLLM's event maps. Once per iteration the worker calls `KvEventPublisher.publish`,
which numbers the iteration's events as one message, keeps it for replay (kv_events_replay answers
replay requests on its own thread) and hands it to the PUB endpoint (zmtp_publisher, its own
thread) without ever waiting (a subscriber that cannot take it loses it; the drop is counted).
engine_builder makes one on rank 0 when `kv_events_config` is set.
"""
from __future__ import annotations

import time
from typing import Callable, Hashable

import msgpack

from ..options import KvCacheConfig, KvEventsConfig
from .kv_events_replay import ReplayBuffer, ZmtpReplayServer
from .zmtp_publisher import ZmtpPublisher

SEND_HWM = 10_000            # messages queued per subscriber before it misses one (dropped, counted)
ALL_BLOCKS_CLEARED = {"type": "AllBlocksCleared"}
# KvEventsConfig.block_hash_form -> a block key (16 bytes) as it goes on the wire
BLOCK_HASH_FORMS: dict[str, Callable[[bytes], bytes | int]] = {
    "bytes16": lambda key: key,
    "int64": lambda key: int.from_bytes(key[:8], "big", signed=True)}


def check_kv_events_config(config, kv_cache_config: KvCacheConfig) -> None:
    """ValueError naming the field for a config the publisher cannot use."""
    if config is None:
        return
    if not isinstance(config, KvEventsConfig):
        raise ValueError(f"kv_events_config: expected a KvEventsConfig, got {type(config).__name__}")
    if not kv_cache_config.enable_block_reuse:
        raise ValueError("kv_events_config: needs KvCacheConfig.enable_block_reuse=True (the events report the "
                         "blocks kept for reuse)")
    _check_fields(config)


def _check_fields(config: KvEventsConfig) -> bytes:
    """The config's own fields (endpoints, topic, buffer_steps); -> the topic's UTF-8 bytes."""
    endpoint_address(config.endpoint, "endpoint")
    if config.replay_endpoint is not None:
        endpoint_address(config.replay_endpoint, "replay_endpoint")
    if not isinstance(config.topic, str):
        raise ValueError(f"kv_events_config.topic: expected a string, got {config.topic!r}")
    try:
        topic = config.topic.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"kv_events_config.topic: not encodable as UTF-8 ({e.reason}), got {config.topic!r}") from None
    steps = config.buffer_steps
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"kv_events_config.buffer_steps: expected an integer >= 1, got {steps!r}")
    if not isinstance(config.block_hash_form, str) or config.block_hash_form not in BLOCK_HASH_FORMS:
        raise ValueError(f"kv_events_config.block_hash_form: expected one of {sorted(BLOCK_HASH_FORMS)}, "
                         f"got {config.block_hash_form!r}")
    return topic


def endpoint_address(value, field: str) -> tuple[str, str | tuple[str, int]]:
    """"tcp://HOST:PORT" -> ("tcp", (host, port)), "ipc://PATH" -> ("ipc", path); ValueError naming
    kv_events_config.<field> otherwise. HOST "*" is every interface; PORT must be 1..65535 (0 or
    "*", any free port, is refused: nothing would tell a subscriber which one was taken)."""
    expected = (f"kv_events_config.{field}: expected \"tcp://HOST:PORT\" (PORT 1..65535) or \"ipc://PATH\", "
                f"got {value!r}")
    if not isinstance(value, str):
        raise ValueError(expected)
    if value.startswith("ipc://") and len(value) > len("ipc://"):
        return "ipc", value[len("ipc://"):]
    if not value.startswith("tcp://"):
        raise ValueError(expected)
    host, _, port = value[len("tcp://"):].rpartition(":")
    if not host or not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(expected)
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return "tcp", ("" if host == "*" else host, int(port))


class WireEventCollector:
    """The events since the last `take`, as vLLM's maps (keys in vLLM's order). A stored chain
    names its request's adapter and carries the token ids the request gave: the KV manager's
    keys salt the first token of a chain at the root (cache_salt), which is put back here."""

    def __init__(self, tokens_per_block: int, medium: str, request_of: Callable[[Hashable], object],
                 block_hash_form: str = "bytes16"):
        self.tokens_per_block, self.medium = tokens_per_block, medium
        self._request_of = request_of   # holder -> its LlmRequest, or None
        self._wire_hash = BLOCK_HASH_FORMS[block_hash_form]
        self._events: list[dict] = []

    def stored(self, parent_key: bytes, blocks: list[tuple[bytes, list[int]]], holder=None) -> None:
        token_ids = [t for _, tokens in blocks for t in tokens]
        request = self._request_of(holder)
        lora_id = None
        if request is not None:
            if request.adapter is not None:
                lora_id = request.adapter.task_id
            if not parent_key and request.cache_salt is not None:
                token_ids[0] = request.spec.prompt[0]
        self._events.append({"type": "BlockStored", "block_hashes": [self._wire_hash(key) for key, _ in blocks],
                             "parent_block_hash": self._wire_hash(parent_key) if parent_key else None,
                             "token_ids": token_ids,
                             "block_size": self.tokens_per_block, "lora_id": lora_id, "medium": self.medium,
                             "lora_name": None if lora_id is None else str(lora_id)})

    def removed(self, keys: list[bytes]) -> None:
        self._events.append({"type": "BlockRemoved", "block_hashes": [self._wire_hash(key) for key in keys],
                             "medium": self.medium})

    def take(self) -> list[dict]:
        events, self._events = self._events, []
        return events


class KvEventPublisher:
    """Binds the PUB endpoint (and the replay socket) of `config`. `publish` and `close` run on
    the worker thread; the PUB endpoint and the replay socket each serve on their own thread.

    NOTE: both are ZMTP endpoints of ours (zmtp_publisher, kv_events_replay), not libzmq sockets:
    those keep every prefix a peer subscribes to and process the subscriptions inside `send`, and
    cap neither peers nor the bytes queued for one, so one peer could stall the worker or grow the
    engine without bound. Subscribers and replay clients cannot tell them from a PUB and a ROUTER."""

    def __init__(self, config: KvEventsConfig, collector: WireEventCollector, send_hwm: int = SEND_HWM):
        self.collector = collector
        self._topic = _check_fields(config)
        self._buffer = ReplayBuffer(config.buffer_steps)
        self._pub, self._replay = None, None
        self._closed = False
        try:
            self._pub = _bind(lambda address: ZmtpPublisher(address, send_hwm), config.endpoint, "endpoint")
            if config.replay_endpoint is not None:
                self._replay = _bind(lambda address: ZmtpReplayServer(address, self._topic, self._buffer),
                                     config.replay_endpoint, "replay_endpoint")
        except BaseException:
            if self._pub is not None:
                self._pub.close()
            raise
        self._send([ALL_BLOCKS_CLEARED])   # message 0: routers forget what an earlier engine held

    @property
    def num_published(self) -> int:
        """Messages numbered and handed to the endpoint so far (message 0 included), taken or not."""
        return self._buffer.next_sequence

    @property
    def num_dropped(self) -> int:
        """Messages a subscriber could not take (it may replay them)."""
        return self._pub.num_dropped

    @property
    def replay_server(self) -> ZmtpReplayServer | None:
        return self._replay

    # -- worker thread ------------------------------------------------------------------------------

    def publish(self) -> None:
        """One message with the events since the last call, if any."""
        events = self.collector.take()
        if events:
            self._send(events)

    def _send(self, events: list[dict]) -> None:
        sequence = self._buffer.next_sequence
        payload = msgpack.packb([time.time(), events, 0], use_bin_type=True)
        self._buffer.append(sequence, payload)
        self._pub.send([self._topic, sequence.to_bytes(8, "big"), payload])

    def close(self) -> None:
        """Publish what is left, close both endpoints. Idempotent."""
        if self._closed:
            return
        self.publish()
        self._closed = True
        if self._replay is not None:
            self._replay.close()
        self._pub.close()


def _bind(make, endpoint: str, field: str):
    try:
        return make(endpoint_address(endpoint, field))
    except OSError as e:
        raise ValueError(f"kv_events_config.{field}: cannot bind {endpoint!r}: {e}") from None


def make_publisher(config: KvEventsConfig, tokens_per_block: int, is_cuda_pool: bool,
                   request_of: Callable[[Hashable], object]) -> KvEventPublisher:
    """The publisher and its collector; medium "GPU" for a CUDA pool, "CPU" for a host one."""
    collector = WireEventCollector(tokens_per_block, "GPU" if is_cuda_pool else "CPU", request_of,
                                   config.block_hash_form)
    return KvEventPublisher(config, collector)
