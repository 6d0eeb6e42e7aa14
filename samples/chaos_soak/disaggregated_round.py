"""The disaggregated round of samples.chaos_soak: one Executor serves context-only requests and the
generation-only requests that take their params, beside generation-only requests whose context
instance is dead (a closed port), drips its answer (a byte at a time, slower than the transfer
deadline) or lies (an answer header that is not the prompt's blocks). Checked: every honest pair
served (the generation side's output continues the context side's), every bad request answered
with one error naming context_phase_params, nothing left active or reserved once the deadline has
passed, shutdown (with a dripping fetch in flight) prompt, the pool whole, the threads back."""
from __future__ import annotations

import random
import socket
import threading
import time
from collections import Counter
from datetime import timedelta

import msgpack

from batch_manager.executor import ContextPhaseParams, Executor, ExecutorConfig, KvCacheConfig, Request, RequestType
from samples.chaos_soak.tracker import threads_started_since

CONTEXT_ONLY, GENERATION_ONLY = RequestType.REQUEST_TYPE_CONTEXT_ONLY, RequestType.REQUEST_TYPE_GENERATION_ONLY
TRANSFER_TIMEOUT_MS = 3000   # also how long an honest context result waits for its fetch (a busy machine)
BAD_KINDS = ("dead", "drip", "lie")
BAD_RATE = 0.3
SHUTDOWN_BOUND_S = 10.0
AWAIT_S = 60.0


class _HostilePeer:
    """A context instance's transfer port that drips its answer or lies in it; one thread per connection."""

    def __init__(self, kind: str):
        self.kind = kind
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()[:2]
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._accept_loop, name=f"chaos-{kind}-peer", daemon=True)
        self._accept.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            t = threading.Thread(target=self._answer, args=(connection,), name=f"chaos-{self.kind}-answer", daemon=True)
            self._threads.append(t)
            t.start()

    def _answer(self, connection: socket.socket) -> None:
        with connection:
            try:
                connection.settimeout(30)
                connection.recv(1 << 16)
                if self.kind == "lie":   # a header for a million tokens: never this request's prompt
                    body = msgpack.packb({"error": None, "num_tokens": 10**6, "block_indexes": [1000], "shape": [1],
                                          "num_value_bytes": 1, "num_scale_bytes": 0})
                    connection.sendall(len(body).to_bytes(4, "big") + body + b"\x00")
                    return
                frame = (1000).to_bytes(4, "big") + b"\xc0" * 1000
                for i in range(len(frame)):   # a byte per 0.6 x the deadline
                    if self._closed.wait(0.6 * TRANSFER_TIMEOUT_MS / 1000):
                        return
                    connection.sendall(frame[i:i + 1])
            except OSError:
                pass

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for t in [self._accept, *self._threads]:
            t.join(timeout=10)


def _pointed_at(params: ContextPhaseParams, address: tuple[str, int]) -> ContextPhaseParams:
    state = msgpack.unpackb(params.opaque_state)
    state.update(host=address[0], port=address[1])
    return ContextPhaseParams(params.first_gen_tokens, params.req_id, msgpack.packb(state, use_bin_type=True))


def _final(executor: Executor, request_id: int):
    """The request's final response (or None when none came in AWAIT_S)."""
    deadline = time.monotonic() + AWAIT_S
    while time.monotonic() < deadline:
        for response in executor.await_responses(request_id, timedelta(seconds=1)):
            if response.has_error() or response.result.is_final:
                return response
    return None


def _produce(executor: Executor, addresses: dict, tally: Counter, problems: list, lock: threading.Lock, seed: int,
             num_requests: int) -> None:
    rng = random.Random(seed)
    for _ in range(num_requests):
        prompt = [rng.randrange(3, 128) for _ in range(rng.randrange(2, 40))]
        max_tokens = rng.randrange(2, 12)
        context = _final(executor, executor.enqueue_request(Request(prompt, max_tokens, request_type=CONTEXT_ONLY)))
        if context is None or context.has_error():
            with lock:
                problems.append(f"context-only request: {'no answer' if context is None else context.error_msg}")
            continue
        params = context.result.context_phase_params
        if params is None:   # its first token ended it
            continue
        kind = rng.choice(BAD_KINDS) if rng.random() < BAD_RATE else "honest"
        if kind != "honest":
            params = _pointed_at(params, addresses[kind])   # the honest blocks expire unfetched
        response = _final(executor, executor.enqueue_request(Request(prompt, max_tokens, request_type=GENERATION_ONLY,
                                                                     context_phase_params=params)))
        with lock:
            tally[f"{kind}_submitted"] += 1
            if response is None:
                problems.append(f"{kind}: no final response in {AWAIT_S} s")
            elif kind == "honest" and response.has_error():
                problems.append(f"honest: {response.error_msg}")
            elif kind == "honest":
                tokens = response.result.output_token_ids[0]
                if tokens[:len(prompt) + 1] != prompt + params.first_gen_tokens:
                    problems.append("honest: the output does not continue the prompt and the first token")
                tally["honest_served"] += 1
            elif not response.has_error() or not response.error_msg.startswith("context_phase_params"):
                problems.append(f"{kind}: {'served' if not response.has_error() else response.error_msg}")
            else:
                tally[f"{kind}_errors"] += 1


def _wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def run_disaggregated_round(engine_dir: str, pool_tokens: int, num_requests: int, num_producers: int,
                            seed: int) -> dict:
    threads_before = set(threading.enumerate())
    start = time.monotonic()
    tally, problems, lock = Counter(), [], threading.Lock()
    dead = socket.create_server(("127.0.0.1", 0))
    peers = {kind: _HostilePeer(kind) for kind in ("drip", "lie")}
    addresses = {"dead": dead.getsockname()[:2], **{kind: p.address for kind, p in peers.items()}}
    dead.close()   # nothing listens there now
    config = ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=pool_tokens),
                            kv_transfer_timeout_ms=TRANSFER_TIMEOUT_MS)
    executor = Executor(engine_dir, executor_config=config)
    shares = [num_requests // num_producers + (i < num_requests % num_producers) for i in range(num_producers)]
    producers = [threading.Thread(target=_produce, args=(executor, addresses, tally, problems, lock,
                                                         seed * 1000 + i, n), name=f"chaos-disaggregated-{i}")
                 for i, n in enumerate(shares)]
    for t in producers:
        t.start()
    for t in producers:
        t.join()
    # Unfetched exports (the bad requests' honest blocks) expire at the deadline.
    drained = _wait_until(lambda: not any(executor.get_bookkeeping_counts()[k] for k in ("active", "kv_exports")),
                          TRANSFER_TIMEOUT_MS / 1000 + 30)
    leftovers = {k: v for k, v in executor.get_bookkeeping_counts().items() if v}
    # Shutdown with a dripping fetch in flight: it ends at once, the request answered with an error.
    context = _final(executor, executor.enqueue_request(Request([5, 6, 7, 8, 9], 8, request_type=CONTEXT_ONLY)))
    in_flight = executor.enqueue_request(Request([5, 6, 7, 8, 9], 8, request_type=GENERATION_ONLY,
                                                 context_phase_params=_pointed_at(
                                                     context.result.context_phase_params, addresses["drip"])))
    shutdown_start = time.monotonic()
    executor.shutdown()
    shutdown_s = time.monotonic() - shutdown_start
    last = executor.await_responses(in_flight, timedelta(seconds=1))
    kv = executor.kv_cache_manager
    used_blocks = kv.num_used_blocks
    for peer in peers.values():
        peer.close()
    del executor, kv
    threads_left = threads_started_since(threads_before)
    return dict(requests=num_requests, **dict(tally), problems=problems[:10], num_problems=len(problems),
                drained=drained, leftovers=leftovers, used_blocks=used_blocks, shutdown_s=round(shutdown_s, 3),
                in_flight_answered=bool(last) and last[-1].has_error(), threads_left=threads_left,
                wall_s=round(time.monotonic() - start, 2))


def disaggregated_violations(r: dict) -> list[str]:
    found = [f"{p}" for p in r["problems"]]
    if not r["drained"]:
        found.append(f"left active or reserved past the deadline: {r['leftovers']}")
    if r["used_blocks"]:
        found.append(f"{r['used_blocks']} KV blocks held after shutdown")
    if r["shutdown_s"] > SHUTDOWN_BOUND_S:
        found.append(f"shutdown took {r['shutdown_s']} s with a dripping fetch in flight")
    if not r["in_flight_answered"]:
        found.append("the generation-only request in flight at shutdown got no error response")
    if r["threads_left"]:
        found.append(f"threads left running: {r['threads_left']}")
    return found
