"""Disaggregated context and generation against one instance on a long-prompt workload, in one run
(same model, same requests):

1. transport: one request's prompt KV (its bytes for --prompt-len tokens of the model) moved
   between two processes, into fresh memory each time, through a TCP socket (the transfer's path:
   a connection per fetch, sendall, recv_into) and through torch.distributed point to point (gloo
   send / recv): median of 5, and gloo's process-group setup, which the socket does not need.
2. serving: --requests streaming requests (random prompts of --prompt-len tokens, --output-len
   tokens each, Poisson arrivals at --rate per second) through
     one:           one Executor with 2 threads (--one-threads);
     disaggregated: a context instance and a generation instance, 1 thread each, each its own
                    process; the client sends a request context-only to the first and, with the
                    ContextPhaseParams of its result, generation-only to the second.
   Time to first token and inter-token latency (p50 / p90 / max; the gap from the first token to
   the second, which holds the KV fetch, is counted with them and reported apart), the context
   tokens each instance computed, the KV bytes moved and the fetch time.

NOTE: on a 2-core machine both configurations share the same two cores: this measures that the
split works and what it costs (what moves, how long it takes, where the prompt is computed), not
what separate machines would gain.

    python -m samples.microbench.disaggregated [--model DIR | --random-model] [--requests 8]
        [--prompt-len 1024] [--output-len 32] [--rate 0.5] [--part transport|serving] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.connection
import random
import socket
import statistics
import threading
import time
from datetime import timedelta

import numpy as np

from samples.default_model import add_model_arguments, model_from_arguments

SPAWN = multiprocessing.get_context("spawn")


# -- 1. transport -----------------------------------------------------------------------------

def _socket_peer(rank: int, port: int, num_bytes: int, repeats: int, results) -> None:
    if rank == 0:   # receives, as the generation side does: a connection and fresh memory per fetch
        import torch
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(b"\x00")
                received, view = 0, memoryview(torch.empty(num_bytes, dtype=torch.uint8).numpy())
                while received < num_bytes:
                    received += sock.recv_into(view[received:], num_bytes - received)
            times.append(time.perf_counter() - start)
        results.put(("socket", statistics.median(times), 0.0))
        return
    payload = np.random.default_rng(0).integers(0, 255, num_bytes, dtype=np.uint8)
    with socket.create_server(("127.0.0.1", port)) as listener:
        results.put(("listening", 0, 0))
        for _ in range(repeats):
            connection, _ = listener.accept()
            with connection:
                connection.recv(1)
                connection.sendall(memoryview(payload))


def _gloo_peer(rank: int, port: int, num_bytes: int, repeats: int, results) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    start = time.perf_counter()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    setup_s = time.perf_counter() - start
    tensor = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:   # into fresh memory, as a fetch must
            dist.recv(torch.empty(num_bytes, dtype=torch.uint8), 1)
        else:
            dist.send(tensor, 0)
        times.append(time.perf_counter() - start)
    if rank == 0:
        results.put(("gloo", statistics.median(times), setup_s))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def transport(num_bytes: int, repeats: int = 5) -> dict:
    out = {"bytes": num_bytes}
    for name, target in (("socket", _socket_peer), ("gloo", _gloo_peer)):
        results, port = SPAWN.Queue(), _free_port()
        server = SPAWN.Process(target=target, args=(1, port, num_bytes, repeats, results))
        server.start()
        if name == "socket":
            assert results.get(timeout=60)[0] == "listening"
        client = SPAWN.Process(target=target, args=(0, port, num_bytes, repeats, results))
        client.start()
        _, median_s, setup_s = results.get(timeout=300)
        client.join(60)
        server.join(60)
        out[name] = {"median_s": median_s, "setup_s": setup_s, "gbytes_per_s": num_bytes / median_s / 1e9}
    return out


# -- 2. serving -------------------------------------------------------------------------------

def _instance(model_dir: str, threads: int, pool_tokens: int, connection) -> None:
    """An Executor in its own process: ("submit", index, kind, prompt, max_tokens, params) in;
    ("tokens", index, t, num_tokens, is_final, params) and ("error", index, t, message) out;
    ("stop",) ends it after its requests, answering ("stats", {...})."""
    import torch
    torch.set_num_threads(threads)
    from batch_manager.executor import (ContextPhaseParams, Executor, ExecutorConfig, KvCacheConfig, Request,
                                        RequestType)
    config = ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=pool_tokens))
    with Executor(model_dir, executor_config=config) as executor:
        lock, index_of, stopping = threading.Lock(), {}, threading.Event()

        def receive() -> None:
            while True:
                message = connection.recv()
                if message[0] == "stop":
                    stopping.set()
                    return
                _, index, kind, prompt, max_tokens, params = message
                params = None if params is None else ContextPhaseParams.from_bytes(params)
                request = Request(prompt, max_tokens, streaming=True, request_type=RequestType[kind],
                                  context_phase_params=params)
                with lock:   # the answers wait for the index
                    index_of[executor.enqueue_request(request)] = index

        threading.Thread(target=receive, daemon=True).start()
        connection.send(("ready",))
        num_context_tokens = 0
        while not stopping.is_set() or executor.get_num_active_requests():
            for response in executor.await_responses(timeout=timedelta(milliseconds=20)):
                now = time.monotonic()
                with lock:
                    index = index_of[response.request_id]
                if response.has_error():
                    connection.send(("error", index, now, response.error_msg))
                    continue
                result = response.result
                params = None if result.context_phase_params is None else result.context_phase_params.to_bytes()
                connection.send(("tokens", index, now, len(result.output_token_ids[0]), result.is_final, params))
            num_context_tokens += sum(s.num_context_tokens for s in executor.get_latest_iteration_stats())
        transfer = executor.front_end.kv_transfer   # the cost counters of this instance's KV transfer
        connection.send(("stats", {"context_tokens": num_context_tokens, "fetches": transfer.num_fetches,
                                   "fetched_bytes": transfer.num_fetched_bytes, "fetch_s": transfer.fetch_s,
                                   "exports": transfer.exports.num_exported, "sent": transfer.exports.num_sent}))


def _start_instance(model_dir: str, threads: int, pool_tokens: int):
    parent, child = SPAWN.Pipe()
    process = SPAWN.Process(target=_instance, args=(model_dir, threads, pool_tokens, child), daemon=True)
    process.start()
    assert parent.recv() == ("ready",)
    return process, parent


def _serve(model_dir: str, workload: list[tuple[float, list[int]]], output_len: int, disaggregated: bool,
           one_threads: int = 2) -> dict:
    pool = len(workload) * (len(workload[0][1]) + output_len) + 1024
    instances = [_start_instance(model_dir, 1, pool), _start_instance(model_dir, 1, pool)] if disaggregated \
        else [_start_instance(model_dir, one_threads, pool)]
    context, generation = instances[0][1], instances[-1][1]
    token_times: dict[int, list[float]] = {i: [] for i in range(len(workload))}
    arrivals, done, errors = {}, set(), []
    t0 = time.monotonic() + 0.5

    def submit() -> None:
        for index, (at_s, prompt) in enumerate(workload):
            time.sleep(max(0.0, t0 + at_s - time.monotonic()))
            arrivals[index] = time.monotonic()
            kind = "REQUEST_TYPE_CONTEXT_ONLY" if disaggregated else "REQUEST_TYPE_CONTEXT_AND_GENERATION"
            context.send(("submit", index, kind, prompt, output_len, None))

    threading.Thread(target=submit, daemon=True).start()
    while len(done) < len(workload):
        for connection in multiprocessing.connection.wait([c for _, c in instances], timeout=300):
            message = connection.recv()
            if message[0] == "error":
                errors.append(message[3])
                done.add(message[1])
                continue
            _, index, at, num_tokens, is_final, params = message
            token_times[index] += [at] * num_tokens
            if params is not None:   # a context-only result: its generation continues on the other instance
                generation.send(("submit", index, "REQUEST_TYPE_GENERATION_ONLY", workload[index][1], output_len,
                                 params))
            elif is_final:
                done.add(index)
    stats = []
    for process, connection in instances:
        connection.send(("stop",))
        stats.append(connection.recv()[1])
        process.join(60)
    return _summary(workload, arrivals, token_times, stats, errors)


def _percentiles(values: list[float]) -> dict:
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]   # noqa: E731
    return {"p50_ms": 1000 * pick(0.5), "p90_ms": 1000 * pick(0.9), "max_ms": 1000 * values[-1]}


def _summary(workload, arrivals, token_times, stats, errors) -> dict:
    ttft = [token_times[i][0] - arrivals[i] for i in token_times if token_times[i]]
    itl = [b - a for times in token_times.values() for a, b in zip(times, times[1:])]
    second = [times[1] - times[0] for times in token_times.values() if len(times) > 1]
    return {"ttft": _percentiles(ttft), "itl": _percentiles(itl), "first_to_second_token": _percentiles(second),
            "end_to_end_s": max(t[-1] for t in token_times.values() if t) - min(arrivals.values()),
            "instances": stats, "errors": errors[:3], "num_errors": len(errors),
            "tokens": [len(token_times[i]) for i in range(len(workload))]}


def _print_serving(name: str, f: dict) -> None:
    ms = lambda p: f"p50 {p['p50_ms']:.0f} / p90 {p['p90_ms']:.0f} / max {p['max_ms']:.0f} ms"   # noqa: E731
    print(f"{name}: TTFT {ms(f['ttft'])}; ITL {ms(f['itl'])}; first->second token {ms(f['first_to_second_token'])}; "
          f"all done {f['end_to_end_s']:.1f} s after the first arrival; errors {f['num_errors']}")
    for i, s in enumerate(f["instances"]):
        moved = (f"; fetched {s['fetches']} x {s['fetched_bytes'] / max(1, s['fetches']) / 1e6:.1f} MB in "
                 f"{1000 * s['fetch_s'] / max(1, s['fetches']):.1f} ms each") if s["fetches"] else ""
        print(f"  instance {i}: context tokens computed {s['context_tokens']}, KV exports {s['exports']} "
              f"(sent {s['sent']}){moved}")


def workload_of(num_requests: int, prompt_len: int, rate: float, vocab_size: int, seed: int = 0):
    rng = random.Random(seed)
    at, out = 0.0, []
    for _ in range(num_requests):
        out.append((at, [rng.randrange(3, vocab_size) for _ in range(prompt_len)]))
        at += rng.expovariate(rate)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rate", type=float, default=0.5, help="arrivals per second (Poisson)")
    parser.add_argument("--part", choices=["transport", "serving"], help="one part only (default: both)")
    parser.add_argument("--one-threads", type=int, default=2, help="torch threads of the one instance (default 2: "
                                                                    "the cores the two instances share)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    model_dir = model_from_arguments(args.model, args.random_model)
    from runtime import Engine
    engine = Engine.from_dir(model_dir)
    kv_bytes = engine.kv_bytes_per_token() * args.prompt_len
    figures = {"model": model_dir, "prompt_len": args.prompt_len, "output_len": args.output_len,
               "requests": args.requests, "rate": args.rate, "kv_bytes_per_request": kv_bytes}
    vocab_size = engine.model_config.vocab_size
    del engine
    print(f"{model_dir}: {args.requests} requests of {args.prompt_len} + {args.output_len} tokens at {args.rate}/s; "
          f"one request's prompt KV: {kv_bytes / 1e6:.1f} MB")
    if args.part in (None, "transport"):
        figures["transport"] = t = transport(kv_bytes)
        print(f"transport of {kv_bytes / 1e6:.1f} MB, median of 5: socket {1000 * t['socket']['median_s']:.1f} ms "
              f"({t['socket']['gbytes_per_s']:.2f} GB/s); gloo send/recv {1000 * t['gloo']['median_s']:.1f} ms "
              f"({t['gloo']['gbytes_per_s']:.2f} GB/s) after {1000 * t['gloo']['setup_s']:.0f} ms of group setup")
    if args.part in (None, "serving"):
        workload = workload_of(args.requests, args.prompt_len, args.rate, vocab_size)
        for name, disaggregated in (("one", False), ("disaggregated", True)):
            figures[name] = _serve(model_dir, workload, args.output_len, disaggregated, args.one_threads)
            _print_serving(name, figures[name])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
