"""Benchmark the decoder: time per step at a batch of sequences with mixed settings, for two
vocabulary sizes, next to the generation forward of the default model at the same batch.

    python -m samples.microbench.decoder [--batch 64] [--vocabs 32000,128256] [--steps 20] [--json OUT]

Mixes (per request, cycling): greedy; temperature 0.8 + top-k 40; top-p 0.9; top-k 50 + top-p 0.95
with repetition 1.1 and presence 0.3; greedy with no-repeat 3-grams and a bad-word list; beam
search (width 4, counted as 4 rows). Each step runs the full decoder on [rows, V] logits (the
sequences already hold --past tokens: penalties and n-gram bans scan them).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from runtime import Engine, ModelRunner
from runtime.decoding import Decoder, DecodeState
from runtime.request import RequestOutput
from runtime.decoding import DecodingParams
from runtime.kernels import get_kernels
from samples.microbench.runtime import step_inputs
from samples.default_model import default_model_dir

MIXES = [
    dict(),
    dict(temperature=0.8, top_k=40),
    dict(top_p=0.9),
    dict(top_k=50, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.3),
    dict(no_repeat_ngram_size=3, bad_words=((5, 6), (7,))),
    dict(beam_width=4),
]


def make_states(batch: int, vocab: int, past: int, mix: str) -> list[DecodeState]:
    gen = torch.Generator().manual_seed(0)
    states = []
    for i in range(batch):
        settings = MIXES[i % len(MIXES)] if mix == "mixed" else {}
        params = DecodingParams(random_seed=i, end_id=-1, **settings)
        prompt = torch.randint(0, vocab, (past,), generator=gen).tolist()
        states.append(DecodeState(params, RequestOutput(0, prompt), max_new_tokens=10_000))
    return states


def time_decoder(batch: int, vocab: int, past: int, steps: int, mix: str) -> float:
    """Median ms per decoder step (after one warm-up step that also expands the beams)."""
    kernels = get_kernels("torch")
    decoder = Decoder(kernels)
    states = make_states(batch, vocab, past, mix)
    gen = torch.Generator().manual_seed(1)
    timings = []
    for step in range(steps + 1):
        rows = sum(s.num_rows for s in states)
        logits = torch.randn(rows, vocab, generator=gen) * 3
        start = time.perf_counter()
        outcomes = decoder.step(states, logits)
        for s, o in zip(states, outcomes):   # the records' owner applies what was decoded
            s.record.apply(o)
        if step:
            timings.append((time.perf_counter() - start) * 1e3)
    return statistics.median(timings)


def time_forward(batch: int, past: int, steps: int) -> tuple[float, int]:
    """Median ms of one generation forward of the default model at `batch` sequences; its vocab."""
    engine = Engine.from_dir(default_model_dir())
    tpb = engine.build_config.tokens_per_block
    blocks_per_seq = -(-(past + 1) // tpb)
    runner = ModelRunner(engine, batch * blocks_per_seq)
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
    tokens = torch.randint(0, engine.model_config.vocab_size, (batch, 1), dtype=torch.int32)
    timings = []
    for step in range(steps + 1):
        start = time.perf_counter()
        runner.forward(step_inputs(tokens, past, tables))
        if step:
            timings.append((time.perf_counter() - start) * 1e3)
    return statistics.median(timings), engine.model_config.vocab_size


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocabs", default="32000,128256")
    parser.add_argument("--past", type=int, default=256, help="tokens each sequence already holds")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"batch": args.batch, "past": args.past, "threads": torch.get_num_threads(), "decoder_ms": {}}
    forward_ms, model_vocab = time_forward(args.batch, args.past, args.steps)
    results["forward_ms"] = forward_ms
    print(f"default model generation forward, batch {args.batch}, past {args.past}: {forward_ms:.2f} ms "
          f"(vocab {model_vocab})")
    for vocab in [int(v) for v in args.vocabs.split(",")]:
        for mix in ("greedy", "mixed"):
            ms = time_decoder(args.batch, vocab, args.past, args.steps, mix)
            results["decoder_ms"][f"{mix}/{vocab}"] = ms
            print(f"decoder, {mix:6s} batch {args.batch}, vocab {vocab:6d}: {ms:7.2f} ms/step "
                  f"({ms / forward_ms:.2f}x the forward)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
