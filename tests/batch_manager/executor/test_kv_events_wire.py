"""KV-cache events on the wire, read by an independent subscriber (pyzmq SUB + msgpack, nothing of
ours): the exact frames and event maps of a known run of stores and evictions, with and without a
LoRA adapter; a late subscriber filling its gap by replay; the bounded replay buffer; a subscriber
that cannot keep up costing counted drops, never a wait; the config's checks."""
from __future__ import annotations

import json
import re
import socket
import time

import msgpack
import pytest
import zmq

from batch_manager import GptManager, KvCacheConfig as CoreKvCacheConfig, KVEventsConfig, SchedulerPolicy, \
    TrtGptModelOptionalParams, TrtGptModelType, load_peft_adapter
from batch_manager.executor import (KvCacheConfig, KvCacheEventType, KvEventsConfig, LoraConfig, OutputConfig,
                                    Request)
from batch_manager.kv_transport.kv_events_publisher import KvEventPublisher, WireEventCollector, check_kv_events_config
from runtime.cache.kv_cache_manager import block_hash
from tests.batch_manager.conftest import Client, make_request
from tests.batch_manager.executor.helpers import collect, executor_for
from tests.lora_helpers import ALL_TARGETS, make_peft_adapter

TPB = 4                       # the tiny engine's tokens per block
STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
               "lora_name"]
END = (-1).to_bytes(8, "big", signed=True)


class Subscriber:
    """A SUB socket on the events and a DEALER on the replay socket (a REQ's envelope, but it
    takes every reply of one request)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: bytes = b""):
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.live: dict[int, tuple[bytes, bytes]] = {}   # sequence -> (topic, payload)

    def receive_until(self, sequence: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while sequence not in self.live:
            assert time.monotonic() < deadline, f"message {sequence} never came; got {sorted(self.live)}"
            if self.sub.poll(100):
                topic, raw_sequence, payload = self.sub.recv_multipart()
                assert len(raw_sequence) == 8
                self.live[int.from_bytes(raw_sequence, "big")] = (topic, payload)

    def replay(self, start: int, topic: bytes = b"") -> list[tuple[int, bytes]]:
        """[b"", start] -> per message from `start` on [b"", topic, sequence, payload], then
        [b"", b"", -1, b""] (as vllm-router reads a replay)."""
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(10_000), "the replay socket did not answer"
            empty, reply_topic, raw_sequence, payload = dealer.recv_multipart()
            assert empty == b""
            if raw_sequence == END:
                assert reply_topic == payload == b""
                dealer.close(linger=0)
                return out
            assert reply_topic == topic
            out.append((int.from_bytes(raw_sequence, "big"), payload))

    def close(self) -> None:
        self.context.destroy(linger=0)


def decode(payload: bytes) -> list:
    """[ts, events, data-parallel rank], checked for vLLM's shape."""
    batch = msgpack.unpackb(payload)
    ts, events, rank = batch
    assert isinstance(ts, float) and abs(ts - time.time()) < 600 and rank == 0
    return events


def chain(tokens: list[int]) -> list[bytes]:
    keys, parent = [], b""
    for j in range(len(tokens) // TPB):
        parent = block_hash(parent, tokens[j * TPB:(j + 1) * TPB])
        keys.append(parent)
    return keys


def stored(hashes, parent, token_ids, lora_id=None) -> dict:
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent, "token_ids": token_ids,
            "block_size": TPB, "lora_id": lora_id, "medium": "CPU",
            "lora_name": None if lora_id is None else str(lora_id)}


def removed(key: bytes) -> dict:
    return {"type": "BlockRemoved", "block_hashes": [key], "medium": "CPU"}


@pytest.fixture
def endpoints(tmp_path):
    return f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"


def run_to_end(executor, request: Request) -> list[int]:
    request_id = executor.enqueue_request(request)
    [response] = collect(executor, [request_id])[request_id]
    assert not response.has_error(), response.error_msg
    return response.result.output_token_ids[0]


def test_stores_then_evictions_exact_frames_and_maps(tiny_engine, endpoints):
    """8 blocks of 4 tokens. A (10 + 3 tokens) stores its 2 prompt blocks in its context step,
    then the block its first two generated tokens complete; B (29 + 3) takes the 5 never-used
    blocks and evicts A's 3, tail first, then stores 7. A subscriber that joined late (message 0
    is sent at bind) fills the gap by replay; the live and replayed bytes agree."""
    endpoint, replay_endpoint = endpoints
    subscriber = Subscriber(endpoint, replay_endpoint, b"kv")
    prompt_a, prompt_b = list(range(3, 13)), list(range(20, 49))
    config = KvCacheConfig(enable_block_reuse=True, max_tokens=32, event_buffer_max_size=64)
    try:
        with executor_for(tiny_engine[0], kv_cache_config=config, iter_stats_max_iterations=100,
                          kv_events_config=KvEventsConfig(endpoint, replay_endpoint, "kv")) as executor:
            time.sleep(0.3)   # let the subscription reach the publisher before the first store
            output = OutputConfig(exclude_input_from_output=True)
            generated_a = run_to_end(executor, Request(prompt_a, 3, output_config=output))
            run_to_end(executor, Request(prompt_b, 3, output_config=output))
            subscriber.receive_until(3)
            in_process = executor.get_latest_kv_cache_events(timeout=0)
            [stats] = executor.get_latest_iteration_stats()[-1:]
            replayed = subscriber.replay(0, b"kv")
    finally:
        subscriber.close()

    assert [s for s, _ in replayed] == [0, 1, 2, 3]
    for sequence, payload in replayed:     # what the subscriber got live is byte for byte the replay's
        if sequence in subscriber.live:
            assert subscriber.live[sequence] == (b"kv", payload)
    events = [decode(payload) for _, payload in replayed]
    keys_a, keys_b = chain(prompt_a + generated_a[:2]), chain(prompt_b)
    assert events[0] == [{"type": "AllBlocksCleared"}]
    assert events[1] == [stored(keys_a[:2], None, prompt_a[:8])]
    assert events[2] == [stored(keys_a[2:], keys_a[1], prompt_a[8:] + generated_a[:2])]
    assert events[3] == [removed(keys_a[2]), removed(keys_a[1]), removed(keys_a[0]),
                         stored(keys_b[:7], None, prompt_b[:28])]
    assert [list(e) for e in events[1] + events[3][-1:]] == [STORED_KEYS] * 2
    assert list(events[3][0]) == ["type", "block_hashes", "medium"]
    # The in-process events are the same events, unchanged.
    assert [(e.type, e.block_hashes) for e in in_process] == \
        [(KvCacheEventType.STORED, tuple(int.from_bytes(k, "big") for k in keys_a[:2])),
         (KvCacheEventType.STORED, (int.from_bytes(keys_a[2], "big"),)),
         *[(KvCacheEventType.REMOVED, (int.from_bytes(k, "big"),)) for k in reversed(keys_a)],
         (KvCacheEventType.STORED, tuple(int.from_bytes(k, "big") for k in keys_b[:7]))]
    assert stats.num_kv_events_dropped == 0 and json.loads(stats.to_json_str())["KV Events Dropped"] == 0
    assert stats.num_kv_events_published == 4 and json.loads(stats.to_json_str())["KV Events Published"] == 4


def test_a_lora_request_names_its_adapter_with_the_prompts_own_tokens(tiny_engine, endpoints, tmp_path):
    """The adapter's blocks are keyed apart (the KV manager salts the chain's first token) but the
    event carries the token ids the request gave, the task id as lora_id and as lora_name. The
    same prompt without the adapter: other keys, no adapter."""
    engine_dir, model = tiny_engine
    make_peft_adapter(model, tmp_path / "adapter", 4, 8, ALL_TARGETS["llama"], seed=1)
    weights, lora_config = load_peft_adapter(tmp_path / "adapter")
    endpoint, replay_endpoint = endpoints
    prompt = list(range(30, 39))   # 9 tokens: 2 full blocks at the context step
    subscriber = Subscriber(endpoint, replay_endpoint)
    try:
        with executor_for(engine_dir, kv_cache_config=KvCacheConfig(enable_block_reuse=True, event_buffer_max_size=64),
                          kv_events_config=KvEventsConfig(endpoint, replay_endpoint)) as executor:
            run_to_end(executor, Request(prompt, 1, lora_config=LoraConfig(7, weights, lora_config)))
            run_to_end(executor, Request(prompt, 1))
            in_process = executor.get_latest_kv_cache_events(timeout=0)
            time.sleep(0.1)
            events = [decode(payload) for _, payload in subscriber.replay(0)]
    finally:
        subscriber.close()
    with_adapter, without = in_process
    assert with_adapter.tokens[0][0] < 0 and with_adapter.tokens[0][1:] == tuple(prompt[1:4])   # salted inside
    assert events[1] == [stored([k.to_bytes(16, "big") for k in with_adapter.block_hashes], None, prompt[:8], 7)]
    assert events[2] == [stored(chain(prompt)[:2], None, prompt[:8])]
    assert set(with_adapter.block_hashes).isdisjoint(without.block_hashes)
    assert len(events) == 3


def test_gpt_manager_publishes_through_its_optional_params(tiny_engine, endpoints):
    endpoint, replay_endpoint = endpoints
    prompt = list(range(40, 49))
    client = Client([make_request(0, prompt, 2)])
    params = TrtGptModelOptionalParams(kv_cache_config=CoreKvCacheConfig(enable_block_reuse=True),
                                       kv_events_config=KVEventsConfig(endpoint, replay_endpoint, buffer_steps=4))
    subscriber = Subscriber(endpoint, replay_endpoint)
    try:
        with GptManager(tiny_engine[0], TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                        *client.callbacks(), optional_params=params):
            client.wait()
            time.sleep(0.1)
            events = [decode(payload) for _, payload in subscriber.replay(0)]
    finally:
        subscriber.close()
    assert events == [[{"type": "AllBlocksCleared"}], [stored(chain(prompt)[:2], None, prompt[:8])]]
    assert json.loads(client.stats[-1])["KV Events Dropped"] == 0
    # The request's last iteration reports message 0 only: its stores (message 1) go out at the
    # top of the next loop, after that iteration's stats.
    assert [json.loads(s)["KV Events Published"] for s in client.stats][-1] == 1


class _Stub:
    """A collector handing the publisher prepared events."""

    def __init__(self):
        self.events: list[dict] = []

    def take(self) -> list[dict]:
        events, self.events = self.events, []
        return events


def test_replay_is_bounded_and_pages_for_a_req_client(endpoints):
    endpoint, replay_endpoint = endpoints
    stub = _Stub()
    publisher = KvEventPublisher(KvEventsConfig(endpoint, replay_endpoint, buffer_steps=3), stub)
    subscriber = Subscriber(endpoint, replay_endpoint)
    try:
        for i in range(5):                 # messages 1..5 after message 0
            stub.events = [{"type": "BlockRemoved", "block_hashes": [bytes([i]) * 16], "medium": "CPU"}]
            publisher.publish()
        publisher.publish()                # nothing new: no message
        assert [s for s, _ in subscriber.replay(0)] == [3, 4, 5]     # the newest buffer_steps
        assert [s for s, _ in subscriber.replay(5)] == [5]
        assert subscriber.replay(6) == []
        [(_, payload), _] = subscriber.replay(4)
        assert decode(payload) == [{"type": "BlockRemoved", "block_hashes": [b"\x03" * 16], "medium": "CPU"}]
        malformed = subscriber.context.socket(zmq.DEALER)
        malformed.connect(replay_endpoint)
        malformed.send_multipart([b"", b"\x01"])                       # ignored, and the service goes on
        req = subscriber.context.socket(zmq.REQ)                       # a REQ takes one reply per request
        req.connect(replay_endpoint)
        req.send((4).to_bytes(8, "big"))
        assert req.poll(10_000) and req.recv_multipart()[1:2] == [(4).to_bytes(8, "big")]
    finally:
        subscriber.close()
        publisher.close()
        publisher.close()


def test_a_subscriber_that_cannot_keep_up_costs_counted_drops_never_a_wait(endpoints):
    endpoint, _ = endpoints
    stub = _Stub()
    publisher = KvEventPublisher(KvEventsConfig(endpoint), stub, send_hwm=2)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        big = {"type": "BlockRemoved", "block_hashes": [b"\x00" * (1 << 20)], "medium": "CPU"}
        deadline = time.monotonic() + 30
        while not sub.poll(10):            # until the subscription is in: one message arrives
            assert time.monotonic() < deadline
            stub.events = [big]
            publisher.publish()
        start = time.monotonic()
        for _ in range(200):               # 200 MiB the subscriber never reads
            stub.events = [big]
            publisher.publish()
        assert time.monotonic() - start < 20
        assert publisher.num_dropped > 0
    finally:
        context.destroy(linger=0)
        publisher.close()


def test_config_needs_block_reuse_and_valid_fields(tiny_engine, endpoints):
    endpoint, _ = endpoints
    assert KVEventsConfig is KvEventsConfig
    with pytest.raises(ValueError, match="kv_events_config: needs KvCacheConfig.enable_block_reuse"):
        executor_for(tiny_engine[0], kv_events_config=KvEventsConfig(endpoint))
    with pytest.raises(ValueError, match="kv_events_config: needs KvCacheConfig.enable_block_reuse"):
        GptManager(tiny_engine[0], TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                   *Client([]).callbacks(), optional_params=TrtGptModelOptionalParams(
                       kv_events_config=KvEventsConfig(endpoint)))
    reuse = KvCacheConfig(enable_block_reuse=True)
    for bad, field in ((KvEventsConfig("127.0.0.1:5557"), "endpoint"),
                       (KvEventsConfig(endpoint, "udp://x"), "replay_endpoint"),
                       (KvEventsConfig(endpoint, buffer_steps=0), "buffer_steps"),
                       ({"endpoint": endpoint}, "")):
        with pytest.raises(ValueError, match=f"kv_events_config{'.' + field if field else ''}:"):
            executor_for(tiny_engine[0], kv_cache_config=reuse, kv_events_config=bad)
    with socket.socket() as taken:         # a tcp port in use (an ipc bind takes the path over)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ValueError, match="kv_events_config.endpoint: cannot bind"):
            executor_for(tiny_engine[0], kv_cache_config=reuse, kv_events_config=KvEventsConfig(
                f"tcp://127.0.0.1:{taken.getsockname()[1]}"))


@pytest.mark.parametrize("port", ["99999", "65536", "0", "-1", "*", "x", ""])
@pytest.mark.parametrize("field", ["endpoint", "replay_endpoint"])
def test_a_tcp_port_outside_1_to_65535_is_refused_naming_the_field_and_value(endpoints, field, port):
    """99999 used to bind port 34463 (99999 - 65536) silently; 0 and "*" (any free port) are
    refused too: nothing would tell a subscriber which port was taken."""
    bad = f"tcp://127.0.0.1:{port}"
    config = KvEventsConfig(bad) if field == "endpoint" else KvEventsConfig(endpoints[0], bad)
    with pytest.raises(ValueError, match=f"kv_events_config.{field}: .*{re.escape(repr(bad))}"):
        check_kv_events_config(config, CoreKvCacheConfig(enable_block_reuse=True))
    with pytest.raises(ValueError, match=f"kv_events_config.{field}: "):   # the publisher checks it too
        KvEventPublisher(config, _Stub())


def test_ports_at_the_bounds_and_tcp_hosts_are_accepted():
    reuse = CoreKvCacheConfig(enable_block_reuse=True)
    for endpoint in ("tcp://127.0.0.1:1", "tcp://127.0.0.1:65535", "tcp://*:5557", "tcp://[::1]:5557",
                     "tcp://localhost:5557", "ipc:///tmp/x"):
        check_kv_events_config(KvEventsConfig(endpoint), reuse)


def test_a_topic_that_is_not_utf8_encodable_is_refused_naming_the_field(endpoints):
    config = KvEventsConfig(endpoints[0], topic="kv\ud800")
    with pytest.raises(ValueError, match="kv_events_config.topic: .*'kv\\\\ud800'"):
        check_kv_events_config(config, CoreKvCacheConfig(enable_block_reuse=True))


def test_collector_without_a_request_keeps_the_tokens():
    """A holder the scheduler does not know (GptSession-style use): tokens as given, no adapter."""
    collector = WireEventCollector(TPB, "GPU", lambda holder: None)
    collector.stored(b"", [(b"k" * 16, [1, 2, 3, 4])], holder=("x", 1))
    collector.removed([b"k" * 16])
    assert collector.take() == [{**stored([b"k" * 16], None, [1, 2, 3, 4]), "medium": "GPU"},
                                {**removed(b"k" * 16), "medium": "GPU"}]
    assert collector.take() == []


def test_int64_hash_form_sends_each_key_as_its_first_8_bytes_signed(tiny_engine, endpoints):
    """block_hash_form="int64" (what vLLM sends and Dynamo 1.6.1 decodes): the same events, each
    hash (and parent) the key's first 8 bytes as a signed big-endian integer; msgpack carries
    them as integers, never bytes."""
    endpoint, replay_endpoint = endpoints
    subscriber = Subscriber(endpoint, replay_endpoint)
    prompt = list(range(3, 13))
    config = KvCacheConfig(enable_block_reuse=True, max_tokens=32)
    try:
        with executor_for(tiny_engine[0], kv_cache_config=config, kv_events_config=KvEventsConfig(
                endpoint, replay_endpoint, block_hash_form="int64")) as executor:
            generated = run_to_end(executor, Request(prompt, 3, output_config=OutputConfig(
                exclude_input_from_output=True)))
            replayed = subscriber.replay(0)
    finally:
        subscriber.close()

    def wire(key: bytes) -> int:
        return int.from_bytes(key[:8], "big", signed=True)

    keys = chain(prompt + generated[:2])
    events = [decode(payload) for _, payload in replayed]
    assert events[1] == [stored([wire(k) for k in keys[:2]], None, prompt[:8])]
    assert events[2] == [stored([wire(keys[2])], wire(keys[1]), prompt[8:] + generated[:2])]
    assert all(type(h) is int and -(1 << 63) <= h < (1 << 63) for e in events[1:] for h in e[0]["block_hashes"])


def test_collector_hash_forms_and_a_bad_form_named():
    key, parent = bytes(range(0x80, 0x90)), bytes(range(16))
    collector = WireEventCollector(TPB, "GPU", lambda holder: None, "int64")
    collector.stored(parent, [(key, [1, 2, 3, 4])])
    collector.removed([key])
    stored_event, removed_event = collector.take()
    assert stored_event["block_hashes"] == [int.from_bytes(key[:8], "big", signed=True)] and \
        stored_event["block_hashes"][0] < 0
    assert stored_event["parent_block_hash"] == int.from_bytes(parent[:8], "big", signed=True)
    assert removed_event["block_hashes"] == stored_event["block_hashes"]
    default = WireEventCollector(TPB, "GPU", lambda holder: None)
    default.stored(parent, [(key, [1, 2, 3, 4])])
    assert default.take()[0]["block_hashes"] == [key]
    with pytest.raises(ValueError, match="kv_events_config.block_hash_form: .*'int32'"):
        check_kv_events_config(KvEventsConfig("tcp://127.0.0.1:5557", block_hash_form="int32"),
                               CoreKvCacheConfig(enable_block_reuse=True))
