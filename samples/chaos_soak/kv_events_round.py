"""The KV-events round of samples.chaos_soak: an Executor publishing its KV-cache events (block
reuse on, a replay socket) serves honest requests in waves while hostile ZMTP peers, each its own
process (samples.chaos_soak.hostile_subscriber), attack both endpoints: a subscribe / unsubscribe
flood, a flood of unique 200-byte prefixes, a subscriber that never reads, 80 connections taking
the subscriber slots and never subscribing, and 300 replay clients that never read. An honest
subscriber listens throughout; a second one joins once the attack is on, and an honest client
replays during it.
Checked: every request served without error, the engine's RSS bounded during the attack, the
honest subscriber received messages in order and, with the replay socket, every message the
engine published; the late subscriber received messages while the slots' squatters stayed; the
replay during the attack was complete; no thread the round started left running.
"""
from __future__ import annotations

import os
import random
import socket
import threading
import time
from pathlib import Path

import zmq

from batch_manager.executor import Executor, ExecutorConfig, KvCacheConfig, KvEventsConfig, Request
from samples.chaos_soak import hostile_subscriber
from samples.chaos_soak.hostile_subscriber import MODES as HOSTILE_MODES
from samples.chaos_soak.tracker import threads_started_since

ATTACK_S = 4.0
WAVE = 8                   # requests submitted together, then awaited
RSS_BOUND_MIB = 64.0       # growth of the engine's RSS over the attack (it grew GiBs before the fix)
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _free_tcp_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


class _HonestSubscriber:
    """A SUB on its own thread recording the sequence numbers it receives."""

    def __init__(self, endpoint: str):
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.sequences: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="chaos-kv-events-subscriber")
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            if self.sub.poll(50):
                _, sequence, _ = self.sub.recv_multipart()
                self.sequences.append(int.from_bytes(sequence, "big"))

    def replay(self, endpoint: str, start: int) -> list[int]:
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        sequences = []
        while dealer.poll(10_000):
            frames = dealer.recv_multipart()
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                break
            sequences.append(int.from_bytes(frames[2], "big"))
        return sequences

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.context.destroy(linger=0)


def _serve_wave(executor: Executor, rng: random.Random, prefixes: list[list[int]]) -> tuple[int, int]:
    """WAVE requests sharing prefixes (so blocks are stored, reused and evicted); -> (served, errors)."""
    ids = [executor.enqueue_request(Request(rng.choice(prefixes) + [rng.randrange(3, 128) for _ in range(
        rng.randrange(0, 16))], rng.randrange(2, 10))) for _ in range(WAVE)]
    served = errors = 0
    pending, deadline = set(ids), time.monotonic() + 120
    while pending and time.monotonic() < deadline:
        for response in executor.await_responses(timeout=0.1):
            if response.has_error() or response.result.is_final:
                pending.discard(response.request_id)
                served, errors = served + (not response.has_error()), errors + response.has_error()
    return served, errors


def run_kv_events_round(engine_dir: str, pool_tokens: int, num_requests: int, seed: int,
                        attack_s: float = ATTACK_S) -> dict:
    threads_before = set(threading.enumerate())
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 128) for _ in range(16)] for _ in range(4)]
    endpoint, replay_endpoint = _free_tcp_endpoint(), _free_tcp_endpoint()
    config = ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=pool_tokens, enable_block_reuse=True),
                            kv_events_config=KvEventsConfig(endpoint, replay_endpoint), iter_stats_max_iterations=4)
    start = time.monotonic()
    executor = Executor(engine_dir, executor_config=config)
    honest = _HonestSubscriber(endpoint)
    served, errors = _serve_wave(executor, rng, prefixes)   # warm-up, before the RSS baseline
    peers = hostile_subscriber.start_all([(replay_endpoint if mode == "replay" else endpoint, mode)
                                          for mode in HOSTILE_MODES], attack_s, PROJECT_ROOT)
    squatters = peers[HOSTILE_MODES.index("idle")]
    rss_before = rss_max = _rss_mib()
    late = _HonestSubscriber(endpoint)   # after the slots' squatters
    submitted, replayed_under_attack, late_received_under_attack = WAVE, [], 0
    replaying = threading.Thread(target=lambda: replayed_under_attack.extend(honest.replay(replay_endpoint, 0)),
                                 name="chaos-kv-events-replay")
    replaying.start()
    while submitted < num_requests or any(p.poll() is None for p in peers):
        s, e = _serve_wave(executor, rng, prefixes)
        served, errors, submitted = served + s, errors + e, submitted + WAVE
        rss_max = max(rss_max, _rss_mib())
        if squatters.poll() is None:   # the slots' squatters still there
            late_received_under_attack = len(late.sequences)
    replaying.join()
    peer_codes = [p.wait(60) for p in peers]
    stats = executor.get_latest_iteration_stats()[-1]
    time.sleep(0.2)   # the last messages reach the honest subscriber
    replayed = honest.replay(replay_endpoint, 0)
    executor.shutdown()
    received = list(honest.sequences)
    honest.close()
    late.close()
    under_attack = replayed_under_attack
    del executor
    threads_left = threads_started_since(threads_before)
    return dict(submitted=submitted, served=served, errors=errors, hostile_exit_codes=peer_codes,
                rss_growth_mib=round(rss_max - rss_before, 1), rss_bound_mib=RSS_BOUND_MIB,
                published=stats.num_kv_events_published, dropped=stats.num_kv_events_dropped,
                received=len(received), received_in_order=received == sorted(set(received)),
                first_received=received[0] if received else None,
                missed_live=len(set(range(received[0], received[-1] + 1)) - set(received)) if received else None,
                replay_complete=replayed == list(range(len(replayed))) and set(received) <= set(replayed),
                replay_under_attack_complete=bool(under_attack) and under_attack == list(range(len(under_attack))),
                late_received_under_attack=late_received_under_attack,
                threads_left=threads_left, wall_s=round(time.monotonic() - start, 2))


def kv_events_violations(r: dict) -> list[str]:
    found = []
    if r["served"] != r["submitted"] or r["errors"]:
        found.append(f"{r['submitted']} requests, {r['served']} served, {r['errors']} errors")
    if r["rss_growth_mib"] > r["rss_bound_mib"]:
        found.append(f"RSS grew {r['rss_growth_mib']} MiB under the attack (bound {r['rss_bound_mib']})")
    if not r["received"] or not r["received_in_order"]:
        found.append(f"the honest subscriber received {r['received']} messages, in order: {r['received_in_order']}")
    if r["missed_live"] or not r["replay_complete"]:
        found.append(f"the honest subscriber missed {r['missed_live']} messages live; replay complete: "
                     f"{r['replay_complete']}")
    if not r["late_received_under_attack"]:
        found.append("a subscriber joining during the attack received nothing while it lasted")
    if not r["replay_under_attack_complete"]:
        found.append("a replay during the attack was empty or had gaps")
    if any(r["hostile_exit_codes"]):
        found.append(f"a hostile peer failed: {r['hostile_exit_codes']}")
    if r["threads_left"]:
        found.append(f"threads left running: {r['threads_left']}")
    return found

