"""The counter-based generator every sampling draw comes from: Philox4x32-10 (Salmon et al.,
"Parallel random numbers: as easy as 1, 2, 3", SC'11), keyed by the request's 64-bit seed, with
the counter (step, beam, lane, 0).

A draw is a pure function of (seed, step, beam): a seeded request samples the same tokens alone
or in any batch, at any position, under any batching type, and the CUDA kernels reproduce the
draws bit for bit (32-bit integer arithmetic only; the uniform is an exact multiple of 2^-24).
"""
from __future__ import annotations

import numpy as np

_M0, _M1 = 0xD2511F53, 0xCD9E8D57      # Philox multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85      # Weyl key increments
_MASK32 = 0xFFFFFFFF
NUM_ROUNDS = 10

LANE_SAMPLE = 0  # counter lane of the token-sampling draw; other lanes are free for future draws


def philox4x32(counters: np.ndarray, keys: np.ndarray, num_rounds: int = NUM_ROUNDS) -> np.ndarray:
    """counters uint32 [N, 4], keys uint32 [N, 2] -> uint32 [N, 4] (the Random123 reference)."""
    c = [counters[:, i].astype(np.uint64) for i in range(4)]
    k0, k1 = keys[:, 0].astype(np.uint64), keys[:, 1].astype(np.uint64)
    for round_index in range(num_rounds):
        if round_index:
            k0 = (k0 + _W0) & _MASK32
            k1 = (k1 + _W1) & _MASK32
        p0 = c[0] * np.uint64(_M0)  # exact: both factors < 2^32
        p1 = c[2] * np.uint64(_M1)
        hi0, lo0 = p0 >> np.uint64(32), p0 & np.uint64(_MASK32)
        hi1, lo1 = p1 >> np.uint64(32), p1 & np.uint64(_MASK32)
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return np.stack(c, axis=1).astype(np.uint32)


def uniforms(seeds: list[int], steps: list[int], beams: list[int], lane: int = LANE_SAMPLE) -> np.ndarray:
    """float32 [N] in [0, 1): one draw per (seed, step, beam); u = (x0 >> 8) * 2^-24."""
    n = len(seeds)
    if n == 0:
        return np.zeros(0, dtype=np.float32)
    seed_array = np.array([s & 0xFFFFFFFFFFFFFFFF for s in seeds], dtype=np.uint64)
    keys = np.stack([seed_array & np.uint64(_MASK32), seed_array >> np.uint64(32)], axis=1).astype(np.uint32)
    counters = np.zeros((n, 4), dtype=np.uint32)
    counters[:, 0] = np.array(steps, dtype=np.uint64) & _MASK32
    counters[:, 1] = np.array(beams, dtype=np.uint64) & _MASK32
    counters[:, 2] = lane
    x0 = philox4x32(counters, keys)[:, 0]
    return ((x0 >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24)).astype(np.float32)
