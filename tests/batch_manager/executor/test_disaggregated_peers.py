"""Disaggregated context and generation against hostile peers: a context instance's answer that is
not the request's prompt blocks, one that drips, idle and oversized connections to the transfer
port, and malformed params each fail their own request (or connection) only; the worker keeps
serving and shutdown returns."""
from __future__ import annotations

import logging
import socket
import threading
import time

import msgpack
import pytest
import torch

from batch_manager.kv_transport import kv_transfer
from batch_manager.executor import ContextPhaseParams, KvCacheConfig, Request, RequestType
from batch_manager.kv_transport.kv_handoff import import_blocks
from runtime.cache.kv_cache_manager import KvCacheManager
from tests.batch_manager.conftest import NUM_NEW_TOKENS
from tests.batch_manager.executor.helpers import collect, executor_for
from tests.batch_manager.executor.kv_peers import (DeepHeaderPeer, DrippingPeer, PoisoningProxy, TamperingProxy, nested,
                                                  params_to)

POOL = 400   # KV tokens
CONTEXT_ONLY, GENERATION_ONLY = RequestType.REQUEST_TYPE_CONTEXT_ONLY, RequestType.REQUEST_TYPE_GENERATION_ONLY
PROMPT = list(range(3, 21))   # 18 tokens: 5 blocks of 4, the last partial


def context_params(executor, prompt=PROMPT) -> ContextPhaseParams:
    request_id = executor.enqueue_request(Request(prompt, NUM_NEW_TOKENS, request_type=CONTEXT_ONLY))
    [response] = collect(executor, [request_id])[request_id]
    return response.result.context_phase_params


def state_of(params: ContextPhaseParams) -> dict:
    return msgpack.unpackb(params.opaque_state)


def generate(executor, params, prompt=PROMPT, timeout_s: float = 60.0) -> list:
    request_id = executor.enqueue_request(Request(prompt, NUM_NEW_TOKENS, request_type=GENERATION_ONLY,
                                                  context_phase_params=params))
    return collect(executor, [request_id], timeout_s)[request_id]


def assert_still_serves(executor) -> None:
    """An honest generation-only request is served, and nothing is left held or active."""
    responses = generate(executor, context_params(executor))
    assert not responses[-1].has_error(), responses[-1].error_msg
    assert len(responses[-1].result.output_token_ids[0]) == len(PROMPT) + NUM_NEW_TOKENS
    counts = executor.get_bookkeeping_counts()
    assert counts["active"] == 0 and counts["kv_exports"] == 0
    kv = executor.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


BAD_ANSWERS = {   # name -> (header edit, the field the error names)
    "num_tokens 10**6": (lambda h: dict(h, num_tokens=10**6), "num_tokens 1000000"),
    "num_tokens negative": (lambda h: dict(h, num_tokens=-5), "num_tokens -5"),
    "num_tokens a string": (lambda h: dict(h, num_tokens="9"), "num_tokens '9'"),
    "an index past the prompt": (lambda h: dict(h, block_indexes=[1000] + h["block_indexes"][1:]), "block_indexes"),
    "more indexes than blocks": (lambda h: dict(h, block_indexes=h["block_indexes"] + [5]), "block_indexes"),
    "all indexes negative": (lambda h: dict(h, block_indexes=[-1 - j for j in h["block_indexes"]]), "block_indexes"),
    "a repeated index": (lambda h: dict(h, block_indexes=[0] + h["block_indexes"][:-1]), "block_indexes"),
}


@pytest.mark.parametrize("checked_on_receipt", [True, False], ids=["fetch-check", "import-check"])
@pytest.mark.parametrize("name", list(BAD_ANSWERS))
def test_an_answer_that_is_not_the_prompts_blocks_fails_its_request_only(tiny_engine, monkeypatch, name,
                                                                        checked_on_receipt):
    """Checked when received (the fetch thread) and again when imported (the capacity stage): with
    the first check off, the second still fails the request alone, never the worker."""
    edit, field = BAD_ANSWERS[name]
    if not checked_on_receipt:
        monkeypatch.setattr(kv_transfer, "_answer_problem", lambda header, expect: None)
    with executor_for(tiny_engine[0], kv_cache_config=KvCacheConfig(max_tokens=POOL)) as executor:
        params = context_params(executor)
        state = state_of(params)
        with TamperingProxy((state["host"], state["port"]), edit) as proxy:
            [response] = generate(executor, params_to(params, proxy.address))
        assert response.has_error()
        assert response.error_msg.startswith("context_phase_params: "), response.error_msg
        assert field in response.error_msg, response.error_msg
        # The context side marks its send done on the server thread, which may be after this
        # response: the worker releases the export at its next iteration (at most IDLE_BLOCK_S idle).
        deadline = time.monotonic() + 10
        while executor.get_bookkeeping_counts()["kv_exports"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert executor.get_bookkeeping_counts()["kv_exports"] == 0   # the proxied fetch took them
        assert_still_serves(executor)


def test_kv_bytes_holding_nan_fail_the_request_naming_the_context_instance(tiny_engine):
    """The right shape, every element NaN. Before: the request ran and failed as "the logits are
    NaN (a model that computes NaN ...)", which blames this instance's model."""
    with executor_for(tiny_engine[0], kv_cache_config=KvCacheConfig(max_tokens=POOL)) as executor:
        params = context_params(executor)
        state = state_of(params)
        with PoisoningProxy((state["host"], state["port"])) as proxy:
            [response] = generate(executor, params_to(params, proxy.address))
        assert response.has_error()
        message = response.error_msg
        assert message.startswith("context_phase_params: ") and f"{proxy.address[0]}:{proxy.address[1]}" in message
        assert "NaN or infinite float32 elements" in message, message
        assert_still_serves(executor)


def test_a_deeply_nested_answer_fails_the_request_naming_the_context_instance(tiny_engine):
    """A header with a field 900 lists deep (within the header's byte limit). Before: Python's
    recursion limit, "maximum recursion depth exceeded", naming no peer."""
    with executor_for(tiny_engine[0], kv_cache_config=KvCacheConfig(max_tokens=POOL)) as executor:
        params = context_params(executor)
        with DeepHeaderPeer("error", 900) as peer:
            [response] = generate(executor, params_to(params, peer.address))
        message = response.error_msg
        assert message.startswith("context_phase_params: ") and f"{peer.address[0]}:{peer.address[1]}" in message
        assert "nested deeper than" in message, message
        assert not generate(executor, params)[-1].has_error()   # the blocks kept for it, fetched honestly
        assert_still_serves(executor)


@pytest.mark.parametrize("field", ["sampling", "layout", "host"])
def test_deeply_nested_params_are_refused_naming_them(tiny_engine, field):
    """opaque_state with a field 1,000 lists deep. Before: enqueue raised RecursionError."""
    with executor_for(tiny_engine[0], kv_cache_config=KvCacheConfig(max_tokens=POOL)) as executor:
        params = context_params(executor)
        bad = msgpack.packb(dict(state_of(params), **{field: nested(1000)}))
        with pytest.raises(ValueError, match=r"^context_phase_params: opaque_state nests deeper than"):
            executor.enqueue_request(Request(PROMPT, NUM_NEW_TOKENS, request_type=GENERATION_ONLY,
                                             context_phase_params=ContextPhaseParams(params.first_gen_tokens,
                                                                                     params.req_id, bad)))
        assert not generate(executor, params)[-1].has_error()
        assert_still_serves(executor)


def test_a_dripping_context_instance_is_cut_off_at_the_deadline(tiny_engine):
    """kv_transfer_timeout_ms is a deadline from connect to the last byte: a peer sending a byte
    every 0.6 x the timeout ends the request (0.5 s: well within 20 s on any machine)."""
    with executor_for(tiny_engine[0], kv_cache_config=KvCacheConfig(max_tokens=POOL),
                      kv_transfer_timeout_ms=500) as executor:
        params = context_params(executor)
        with DrippingPeer(0.3) as peer:
            start = time.monotonic()
            responses = generate(executor, params_to(params, peer.address), timeout_s=20)
            assert time.monotonic() - start < 20 and peer.num_connections == 1
            assert responses[-1].has_error() and "deadline" in responses[-1].error_msg, responses[-1].error_msg
            # More dripping requests than fetch threads, then an honest one (its blocks kept on a
            # context instance of the default 60 s timeout): it is served after them.
            with executor_for(tiny_engine[0], kv_cache_config=KvCacheConfig(max_tokens=POOL)) as context:
                honest = context_params(context)
                ids = executor.enqueue_requests([Request(PROMPT, NUM_NEW_TOKENS, request_type=GENERATION_ONLY,
                                                         context_phase_params=params_to(params, peer.address))
                                                 for _ in range(6)] + [
                    Request(PROMPT, NUM_NEW_TOKENS, request_type=GENERATION_ONLY, context_phase_params=honest)])
                responses = collect(executor, ids, timeout_s=30)
        assert all(responses[i][-1].has_error() for i in ids[:-1])
        assert not responses[ids[-1]][-1].has_error(), responses[ids[-1]][-1].error_msg
        assert_still_serves(executor)


def test_shutdown_returns_while_a_context_instance_drips(tiny_engine):
    """Under the default 60 s timeout: shutdown ends the fetch at once; the request gets an error."""
    executor = executor_for(tiny_engine[0], kv_cache_config=KvCacheConfig(max_tokens=POOL))
    params = context_params(executor)
    with DrippingPeer(0.5) as peer:
        request_ids = executor.enqueue_requests([Request(PROMPT, NUM_NEW_TOKENS, request_type=GENERATION_ONLY,
                                                         context_phase_params=params_to(params, peer.address))
                                                 for _ in range(6)])   # more than the fetch threads
        deadline = time.monotonic() + 30
        while peer.num_connections < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        start = time.monotonic()
        executor.shutdown()
        assert time.monotonic() - start < 15
    responses = collect(executor, request_ids, timeout_s=5)
    assert all(responses[i][-1].has_error() for i in request_ids)
    assert all("context_phase_params" in responses[i][-1].error_msg for i in request_ids)


def transfer_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "KvTransferSend")


def test_idle_connections_are_bounded_and_honest_fetches_still_get_through(tiny_engine, caplog):
    with executor_for(tiny_engine[0], kv_cache_config=KvCacheConfig(max_tokens=POOL)) as executor:
        params = context_params(executor)
        state = state_of(params)
        threads = transfer_threads()
        caplog.set_level(logging.WARNING, logger="batch_manager.kv_transport.kv_transfer")
        idle = [socket.create_connection((state["host"], state["port"]), timeout=10) for _ in range(60)]
        try:
            deadline = time.monotonic() + 10   # the closed ones' threads end at their next recv
            while transfer_threads() - threads > kv_transfer.MAX_CONNECTIONS and time.monotonic() < deadline:
                time.sleep(0.05)
            assert transfer_threads() - threads <= kv_transfer.MAX_CONNECTIONS
            responses = generate(executor, params)   # its connection closes the oldest idle one
            assert not responses[-1].has_error(), responses[-1].error_msg
            assert_still_serves(executor)
        finally:
            for connection in idle:
                connection.close()
        warnings = [r for r in caplog.records if r.name == "batch_manager.kv_transport.kv_transfer"]
        assert len(warnings) <= 2, [r.getMessage() for r in warnings]   # once per kind, not per connection


def test_an_oversized_ask_frame_is_refused_before_its_body(tiny_engine):
    with executor_for(tiny_engine[0], kv_cache_config=KvCacheConfig(max_tokens=POOL),
                      kv_transfer_timeout_ms=60000) as executor:
        state = state_of(context_params(executor))
        with socket.create_connection((state["host"], state["port"]), timeout=20) as connection:
            connection.sendall((1 << 24).to_bytes(4, "big"))   # a 16 MiB frame announced, no body
            assert connection.recv(16) == b""                  # closed at once, not after the deadline
        assert kv_transfer.MAX_ASK_BYTES < 1 << 20


def test_an_idle_connection_is_closed_at_the_deadline(tiny_engine):
    with executor_for(tiny_engine[0], kv_cache_config=KvCacheConfig(max_tokens=POOL),
                      kv_transfer_timeout_ms=500) as executor:
        state = state_of(context_params(executor))
        with socket.create_connection((state["host"], state["port"]), timeout=20) as connection:
            connection.sendall(b"\x00\x00")   # half a length, then nothing
            assert connection.recv(16) == b""


@pytest.mark.parametrize("field", ["prompt_len", "host", "sampling", "port", "layout", "first_log_prob"])
def test_params_missing_a_state_field_are_refused_naming_it(tiny_engine, field):
    with executor_for(tiny_engine[0], kv_cache_config=KvCacheConfig(max_tokens=POOL)) as executor:
        params = context_params(executor)
        state = state_of(params)
        for broken in ({k: v for k, v in state.items() if k != field}, dict(state, **{field: [1]})):
            bad = ContextPhaseParams(params.first_gen_tokens, params.req_id, msgpack.packb(broken))
            with pytest.raises(ValueError, match=rf"^context_phase_params: opaque_state\.{field}"):
                executor.enqueue_request(Request(PROMPT, NUM_NEW_TOKENS, request_type=GENERATION_ONLY,
                                                 context_phase_params=bad))
        assert executor.get_num_active_requests() == 0


@pytest.mark.parametrize("data", [10**10, "text", None, b"\x80" * (1 << 20)], ids=["int", "str", "None", "1 MiB"])
def test_params_from_other_than_small_bytes_are_refused(data):
    with pytest.raises(ValueError, match=r"^context_phase_params: "):
        ContextPhaseParams.from_bytes(data)


def fetched_blocks(indexes, num_tokens=len(PROMPT)):
    return kv_transfer.FetchedBlocks(num_tokens, tuple(indexes), torch.zeros(1, 2, len(indexes), 4, 1, 1), None)


def test_an_import_that_leaves_a_read_block_unwritten_is_refused_and_allocates_nothing():
    kv = KvCacheManager(16, 4)
    with pytest.raises(ValueError, match=r"^context_phase_params: .*block_indexes \[0, 1, 2, 3\]: the prompt's "
                                         r"blocks \[4\] are missing"):
        import_blocks(kv, 1, len(PROMPT), 0, fetched_blocks([0, 1, 2, 3]))
    assert kv.num_free_blocks == 16
    for bad, match in (([0, 1, 2, 3, 4, 4], "distinct"), ([0, 1, 2, 3, 5], "in \\[0, 5\\)"),
                       ([-1, -2, -3, -4, -5], "in \\[0, 5\\)")):
        with pytest.raises(ValueError, match=match):
            import_blocks(kv, 1, len(PROMPT), 0, fetched_blocks(bad))
    with pytest.raises(ValueError, match="num_tokens 19: the request's prompt has 18 tokens"):
        import_blocks(kv, 1, len(PROMPT), 0, fetched_blocks(range(5), num_tokens=19))
    assert kv.num_free_blocks == 16
    # A cached prefix of 2 blocks needs only the rest; a window of 8 hides blocks 0 and 1 of 18 tokens.
    writes = import_blocks(kv, 1, len(PROMPT), 8, fetched_blocks([2, 3, 4]))
    assert writes.slots == (0, 1, 2)
    windowed = KvCacheManager(16, 4, attention_window=8)
    assert import_blocks(windowed, 1, len(PROMPT), 0, fetched_blocks([2, 3, 4])).slots == (0, 1, 2)


def test_shutdown_frees_the_blocks_left_for_a_fetch(tiny_engine):
    executor = executor_for(tiny_engine[0], kv_cache_config=KvCacheConfig(max_tokens=POOL))
    context_params(executor)
    kv = executor.kv_cache_manager
    assert executor.get_bookkeeping_counts()["kv_exports"] == 1 and kv.num_free_blocks < kv.num_blocks
    executor.shutdown()
    assert kv.num_free_blocks == kv.num_blocks and executor.get_bookkeeping_counts()["kv_exports"] == 0
    kv.check_invariants()
