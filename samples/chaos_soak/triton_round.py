"""The Triton round of samples.chaos_soak: the soak's engine behind samples.triton's server
(tritonserver from the nvidia-pytriton wheel) with a KV pool that keeps requests waiting, and
client threads streaming requests over gRPC (plain and mapped ids): some run to their length,
some are stopped (`stop` with their id, after their first token or at once, also while they
wait for a slot), and some clients disconnect mid-stream (the stream cancelled with its requests
live). Then the shutdown with requests live and queued and a client's stream still open.
Checked: every request of a client that stayed got exactly one final response, without error
(the full length unless stopped); the server back to idle with every KV block free and serving
again; at shutdown every live and queued request answered (the queued ones with the shutdown
error) and a clean exit. Skipped, saying why, where Triton cannot run."""
from __future__ import annotations

import random
import tempfile
import threading
import time

from samples.triton.request_book import SHUTTING_DOWN

FULL, STOP_AFTER_TOKEN, STOP_AT_ONCE = "full", "stop_after_token", "stop_at_once"
LONG = 60                  # tokens asked by the requests that are meant to be stopped
DISCONNECTING_EVERY = 3    # clients 1, 4, 7, ... disconnect mid-stream
SHUTDOWN_REQUESTS = 8
WAIT_S = 120.0


def triton_unavailable() -> str | None:
    """Why the Triton server or client cannot run here, or None."""
    try:
        import tritonclient.grpc  # noqa: F401
        from samples.triton.environment import TritonUnavailableError, prepare
        prepare()
    except ImportError as e:
        return f"tritonclient is not installed: {e}"
    except TritonUnavailableError as e:
        return str(e)
    return None


def _request_id(client_index: int, j: int) -> str:
    number = client_index * 1000 + j
    return str(number) if j % 2 == 0 else f"r²-{number}"   # plain ids and ids the model maps


def _inputs(rng: random.Random, max_new_tokens: int):
    from samples.triton.client import llm_inputs
    prompt = [rng.randrange(3, 128) for _ in range(rng.randrange(2, 12))]
    return llm_inputs(prompt, max_new_tokens, streaming=rng.random() < 0.7)


def _wait_tokens(stream, request_id: str, deadline_s: float) -> bool:
    while not stream.result(request_id).tokens and time.monotonic() < deadline_s:
        if stream.is_done(request_id):
            return False
        time.sleep(0.005)
    return bool(stream.result(request_id).tokens)


def _client(url: str, client_index: int, num_requests: int, seed: int, out: list) -> None:
    """One stream: submit, stop some, then wait for everything or disconnect mid-stream."""
    from samples.triton.client import StreamClient
    rng = random.Random(seed)
    disconnects = client_index % DISCONNECTING_EVERY == 1
    stream = StreamClient(url)
    kinds = {}
    try:
        for j in range(num_requests):
            request_id = _request_id(client_index, j)
            kind = rng.choice((FULL, FULL, STOP_AFTER_TOKEN, STOP_AT_ONCE))
            kinds[request_id] = (kind, rng.randrange(2, 12) if kind == FULL else LONG)   # (kind, max new tokens)
            stream.submit(request_id, _inputs(rng, kinds[request_id][1]))
            if kind == STOP_AT_ONCE:
                stream.send_stop(request_id)
        deadline_s = time.monotonic() + WAIT_S
        for request_id, (kind, _) in kinds.items():
            if kind == STOP_AFTER_TOKEN and _wait_tokens(stream, request_id, deadline_s):
                stream.send_stop(request_id)
        if disconnects:
            stream.close(cancel_requests=True)
            out[client_index] = dict(disconnected=True, submitted=num_requests)
            return
        results = {}
        for request_id in kinds:
            try:
                results[request_id] = stream.wait(request_id, max(1.0, deadline_s - time.monotonic()))
            except TimeoutError:
                results[request_id] = None
        out[client_index] = dict(disconnected=False, submitted=num_requests,
                                 **_judge(kinds, results, stream.num_finals))
        stream.close()
    except Exception as e:  # noqa: BLE001 - a broken client is a finding, not a crash of the soak
        out[client_index] = dict(disconnected=disconnects, submitted=num_requests, client_error=repr(e))


def _judge(kinds: dict, results: dict, num_finals: dict) -> dict:
    unanswered = [i for i, r in results.items() if r is None]
    errors = [f"{i}: {r.error}" for i, r in results.items() if r is not None and r.error is not None]
    wrong_length = [f"{i}: {len(r.tokens)} of {kinds[i][1]}" for i, r in results.items()
                    if r is not None and r.error is None and kinds[i][0] == FULL and len(r.tokens) != kinds[i][1]]
    return dict(served=sum(r is not None and r.error is None for r in results.values()),
                stopped=sum(r is not None and kinds[i][0] != FULL and len(r.tokens) < LONG
                            for i, r in results.items()),
                unanswered=unanswered, errors=errors, wrong_length=wrong_length,
                extra_finals=[i for i, n in num_finals.items() if n > 1])


def _wait_idle(metrics_url: str, timeout_s: float = WAIT_S) -> dict:
    from samples.triton.testing import metric_values
    deadline_s = time.monotonic() + timeout_s
    while True:
        requests = metric_values(metrics_url, "nv_trt_llm_request_metrics")
        kv = metric_values(metrics_url, "nv_trt_llm_kv_cache_block_metrics")
        if (requests.get("active") == 0 and kv.get("free") == kv.get("max")) or time.monotonic() > deadline_s:
            return dict(active=requests.get("active"), free_blocks=kv.get("free"), max_blocks=kv.get("max"))
        time.sleep(0.05)


def _shutdown(server, rng: random.Random) -> dict:
    """More long streamed requests than slots, the first running, then the launcher's stop; the
    client closes its stream once every request is answered. -> what each request got and the
    server's exit code."""
    from samples.triton.client import StreamClient
    stream = StreamClient(server.grpc_url)
    ids = [f"shutdown-{j}" for j in range(SHUTDOWN_REQUESTS)]
    for request_id in ids:
        stream.submit(request_id, _inputs(rng, LONG))
    _wait_tokens(stream, ids[0], time.monotonic() + WAIT_S)
    exit_codes = []
    stopper = threading.Thread(target=lambda: exit_codes.append(server.stop()), name="chaos-triton-stop")
    stopper.start()
    results = {}
    for request_id in ids:
        try:
            results[request_id] = stream.wait(request_id, 30)
        except TimeoutError:
            results[request_id] = None
    stream.close()
    stopper.join()
    shutting_down = [r for r in results.values() if r is not None and r.error is not None and SHUTTING_DOWN in r.error]
    return dict(exit_code=exit_codes[0] if exit_codes else None, unanswered=[i for i, r in results.items() if r is None],
                not_started=len(shutting_down),   # waiting at the drain, or arriving after it
                other_errors=[r.error for r in results.values() if r is not None and r.error is not None
                              and SHUTTING_DOWN not in r.error],
                extra_finals=[i for i, n in stream.num_finals.items() if n > 1])


def run_triton_round(engine_dir: str, pool_tokens: int, num_requests: int, num_clients: int, seed: int) -> dict:
    reason = triton_unavailable()
    if reason is not None:
        return dict(skipped=reason)
    from samples.triton.repository import RepositoryOptions
    from samples.triton.testing import running_server
    start = time.monotonic()
    rng = random.Random(seed)
    options = RepositoryOptions(max_tokens_in_paged_kv_cache=pool_tokens, cancellation_check_period_ms=20)
    with tempfile.TemporaryDirectory(prefix="chaos-triton-") as repository, \
            running_server(repository, engine_dir, options) as server:
        per_client = [num_requests // num_clients + (i < num_requests % num_clients) for i in range(num_clients)]
        clients: list = [None] * num_clients
        threads = [threading.Thread(target=_client, args=(server.grpc_url, i, n, seed * 31 + i, clients),
                                    name=f"chaos-triton-client-{i}") for i, n in enumerate(per_client)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        idle = _wait_idle(server.metrics_url)
        follow_up = _client_follow_up(server.grpc_url)
        shutdown = _shutdown(server, rng)
    return dict(clients=clients, idle=idle, follow_up_tokens=follow_up, shutdown=shutdown,
                wall_s=round(time.monotonic() - start, 1))


def _client_follow_up(url: str) -> int | None:
    from samples.triton.client import StreamClient, llm_inputs
    stream = StreamClient(url)
    try:
        stream.submit("follow-up", llm_inputs([5, 6, 7], 4, streaming=False))
        result = stream.wait("follow-up", WAIT_S)
        return len(result.tokens) if result.error is None else None
    except TimeoutError:
        return None
    finally:
        stream.close()


def triton_violations(r: dict) -> list[str]:
    if "skipped" in r:
        return []
    found = []
    for i, c in enumerate(r["clients"]):
        if c is None or c.get("client_error"):
            found.append(f"client {i} failed: {c}")
        elif not c["disconnected"]:
            for key in ("unanswered", "errors", "wrong_length", "extra_finals"):
                if c[key]:
                    found.append(f"client {i} {key.replace('_', ' ')}: {c[key][:5]}")
    if r["idle"]["active"] != 0 or r["idle"]["free_blocks"] != r["idle"]["max_blocks"]:
        found.append(f"not idle after the clients left: {r['idle']}")
    if r["follow_up_tokens"] != 4:
        found.append(f"a later request got {r['follow_up_tokens']} tokens, not 4")
    s = r["shutdown"]
    if s["exit_code"] != 0 or s["unanswered"] or s["other_errors"] or s["extra_finals"]:
        found.append(f"shutdown: {s}")
    return found


def triton_summary(r: dict) -> str:
    if "skipped" in r:
        return f"Triton round skipped: {r['skipped']}"
    stayed = [c for c in r["clients"] if c and not c["disconnected"] and not c.get("client_error")]
    return (f"Triton round: {sum(c['submitted'] for c in r['clients'] if c)} requests from {len(r['clients'])} "
            f"clients ({len(r['clients']) - len(stayed)} disconnected mid-stream), "
            f"{sum(c['served'] for c in stayed)} served ({sum(c['stopped'] for c in stayed)} stopped); "
            f"shutdown: {r['shutdown']['not_started']} refused or never started, exit {r['shutdown']['exit_code']}; "
            f"wall {r['wall_s']} s")
