"""`python -m samples.chaos_soak.hostile_subscriber ENDPOINT MODE SECONDS`: one hostile peer of a
KV-events endpoint, for the soak's KV-events round and samples.microbench.kv_events_flood. It
imports only pyzmq (starts in well under a second) and prints "attacking" once connected.
churn: subscribe / unsubscribe as fast as it can; unique: a new 200-byte prefix each time;
stuck: subscribe to everything and never read; idle: NUM_IDLE connections that finish the
handshake and never subscribe (the subscriber slots' lockout); replay (ENDPOINT the replay
socket): NUM_REPLAY clients each ask for the whole replay and never read.
"""
from __future__ import annotations

import sys
import time

import zmq

MODES = ("churn", "unique", "stuck", "idle", "replay")
NUM_IDLE = 80        # more than the publisher's subscriber slots
NUM_REPLAY = 300


def _stuck(context: zmq.Context, kind: int) -> zmq.Socket:
    """A socket that takes (almost) nothing off the wire."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def _flood(context: zmq.Context, endpoint: str, mode: str, seconds: float) -> None:
    xsub = context.socket(zmq.XSUB)
    xsub.setsockopt(zmq.SNDHWM, 100_000)
    xsub.connect(endpoint)
    print("attacking", flush=True)
    end, i = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        frame = (b"\x01" if i % 2 == 0 else b"\x00") if mode == "churn" else b"\x01" + i.to_bytes(8, "big") * 25
        try:
            xsub.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            time.sleep(0.0001)
        i += 1


def attack(endpoint: str, mode: str, seconds: float) -> None:
    context = zmq.Context()
    if mode in ("churn", "unique"):
        _flood(context, endpoint, mode, seconds)
    else:
        sockets = []
        for _ in range({"stuck": 1, "idle": NUM_IDLE, "replay": NUM_REPLAY}[mode]):
            sock = _stuck(context, {"stuck": zmq.SUB, "idle": zmq.XSUB, "replay": zmq.DEALER}[mode])
            if mode == "stuck":
                sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(endpoint)
            if mode == "replay":
                sock.send_multipart([b"", (0).to_bytes(8, "big")])
            sockets.append(sock)
        time.sleep(0.2)       # the connections are up (libzmq connects in the background)
        print("attacking", flush=True)
        time.sleep(seconds)
    context.destroy(linger=0)


def start(endpoint: str, mode: str, seconds: float, cwd) -> "subprocess.Popen":
    """The peer in its own process, returned once it is connected and attacking."""
    [peer] = start_all([(endpoint, mode)], seconds, cwd)
    return peer


def start_all(attacks: list[tuple[str, str]], seconds: float, cwd) -> list["subprocess.Popen"]:
    """One peer per (endpoint, mode), started together, returned once each is attacking."""
    import subprocess
    peers = [subprocess.Popen([sys.executable, "-m", "samples.chaos_soak.hostile_subscriber", endpoint, mode,
                               str(seconds)], cwd=cwd, stdout=subprocess.PIPE, text=True) for endpoint, mode in attacks]
    for peer in peers:
        peer.stdout.readline()
    return peers


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[2] not in MODES:
        sys.exit(f"usage: python -m samples.chaos_soak.hostile_subscriber ENDPOINT {'|'.join(MODES)} SECONDS")
    attack(sys.argv[1], sys.argv[2], float(sys.argv[3]))
