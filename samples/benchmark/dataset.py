"""Benchmark workloads: the legacy gptManagerBenchmark dataset JSON, seeded synthetic datasets and
arrival schedules (offline, per-sample delays, or a seeded Poisson process). Used by samples.benchmark.

Legacy format: {"samples": [{"input_ids": [...], "output_len": N, "delay": seconds}, ...]}; the
delay is slept after enqueueing the sample (as the legacy benchmark did).
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    input_ids: list[int]
    output_len: int        # tokens to generate (request_output_len)
    delay_s: float = 0.0   # pause after enqueueing this sample


@dataclass(frozen=True)
class LengthDistribution:
    """`uniform:LOW:HIGH` (inclusive), `constant:N`, `normal:MEAN:STD` or `exponential:MEAN`;
    every draw is clipped to [1, max_len]."""
    kind: str
    params: tuple[float, ...]

    @staticmethod
    def parse(option: str, text: str) -> "LengthDistribution":
        parts = text.split(":")
        arity = {"uniform": 2, "constant": 1, "normal": 2, "exponential": 1}
        if parts[0] not in arity or len(parts) != arity[parts[0]] + 1:
            raise ValueError(f"{option}: {text!r} is not one of uniform:LOW:HIGH, constant:N, normal:MEAN:STD, "
                             "exponential:MEAN")
        try:
            params = tuple(float(p) for p in parts[1:])
        except ValueError:
            raise ValueError(f"{option}: {text!r} has a non-numeric parameter") from None
        if any(p < 0 for p in params) or (parts[0] == "uniform" and params[0] > params[1]):
            raise ValueError(f"{option}: {text!r} has negative or inverted parameters")
        return LengthDistribution(parts[0], params)

    def draw(self, rng: random.Random, max_len: int) -> int:
        if self.kind == "uniform":
            value = rng.randint(int(self.params[0]), int(self.params[1]))
        elif self.kind == "constant":
            value = int(self.params[0])
        elif self.kind == "normal":
            value = round(rng.gauss(self.params[0], self.params[1]))
        else:
            value = round(rng.expovariate(1.0 / self.params[0])) if self.params[0] > 0 else 1
        return max(1, min(max_len, value))


def synthetic_dataset(num_samples: int, prompt_len: LengthDistribution, output_len: LengthDistribution,
                      vocab_size: int, seed: int, max_seq_len: int) -> list[Sample]:
    """Random prompts (token ids in [3, vocab_size), skipping the usual special ids); prompt +
    output never exceeds max_seq_len."""
    if num_samples <= 0:
        raise ValueError(f"num_samples: must be positive, got {num_samples}")
    rng = random.Random(seed)
    samples = []
    for _ in range(num_samples):
        num_prompt = prompt_len.draw(rng, max_seq_len - 1)
        num_output = output_len.draw(rng, max_seq_len - num_prompt)
        samples.append(Sample([rng.randrange(3, vocab_size) for _ in range(num_prompt)], num_output))
    return samples


def load_dataset(path: str | os.PathLike, max_num_samples: int | None = None) -> list[Sample]:
    """Read the legacy dataset JSON; raises ValueError naming the sample and the field."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
        raise ValueError(f"dataset {os.fspath(path)!r}: expected an object with a 'samples' list")
    samples = []
    for i, s in enumerate(data["samples"][:max_num_samples]):
        ids, output_len = s.get("input_ids"), s.get("output_len")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"samples[{i}].input_ids: expected a non-empty list of ints, got {ids!r:.60}")
        if not isinstance(output_len, int) or output_len <= 0:
            raise ValueError(f"samples[{i}].output_len: expected a positive int, got {output_len!r}")
        delay_s = s.get("delay", 0.0)
        if not isinstance(delay_s, (int, float)) or delay_s < 0:
            raise ValueError(f"samples[{i}].delay: expected a non-negative number, got {delay_s!r}")
        samples.append(Sample(ids, output_len, float(delay_s)))
    if not samples:
        raise ValueError(f"dataset {os.fspath(path)!r}: no samples")
    return samples


def save_dataset(samples: list[Sample], path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        json.dump({"samples": [{"input_ids": s.input_ids, "output_len": s.output_len, "delay": s.delay_s}
                               for s in samples]}, f)


def arrival_delays_s(samples: list[Sample], request_rate: float | None, seed: int) -> list[float]:
    """Seconds to wait after enqueueing each sample: exponential gaps (a Poisson process) at
    request_rate requests/s when given and > 0, else the samples' own delays (0 = offline)."""
    if request_rate is None or request_rate <= 0:
        return [s.delay_s for s in samples]
    rng = random.Random(seed)
    return [rng.expovariate(request_rate) for _ in samples]
