"""Guided decoding's cost: decoder time per step at batch 64 for vocabularies of 32k and 128k
tokens, every request guided (a JSON schema) vs none, in one run; and the time to compile a
typical JSON schema (first use; later requests with the same guide hit the cache).

The tokenizers are synthetic byte-level BPE vocabularies of the given sizes (no download here):
llguidance reads a tokenizer's token -> bytes table, which is what the sizes change.

    python -m samples.microbench.guided [--batch 64] [--steps 30] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from runtime.decoding import Decoder, DecodeState, DecodingParams
from runtime.decoding.guided import GrammarCompiler, make_tokenizer
from runtime.kernels import get_kernels
from runtime.request import RequestOutput

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "email": {"type": "string", "format": "email"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
                         "address": {"type": "object", "properties": {"street": {"type": "string"},
                                                                       "city": {"type": "string"}}}},
          "required": ["name", "age", "tags"]}


def synthetic_tokenizer_json(vocab_size: int, seed: int = 0) -> str:
    """A byte-level BPE tokenizer.json: the 256 byte tokens, 3 specials, then random multi-byte tokens."""
    from tokenizers import pre_tokenizers
    rng = random.Random(seed)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for c in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(c, len(vocab))
    letters = 'abcdefghijklmnopqrstuvwxyz{}":,[]0123456789 '
    while len(vocab) < vocab_size:
        word = "".join(rng.choice(letters) for _ in range(rng.randrange(2, 9))).replace(" ", "\u0120")
        vocab.setdefault(word, len(vocab))
    special = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                "special": True} for c, i in (("<pad>", 0), ("<s>", 1), ("</s>", 2))]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": special,
                       "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
                       "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                                 "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                                 "ignore_merges": False, "vocab": vocab, "merges": []}})


def time_steps(batch: int, vocab: int, steps: int, template) -> float:
    """Median ms of one decoder step over `batch` sampled requests (a fresh request replaces one
    that finished)."""
    decoder = Decoder(get_kernels("torch"))
    gen = torch.Generator().manual_seed(0)

    def new_state(seed: int) -> DecodeState:
        state = DecodeState(DecodingParams(top_k=50, random_seed=seed, end_id=2), RequestOutput(0, [1, 5, 6]), 10_000)
        if template is not None:
            state.guide = template.start()
        return state

    states = [new_state(i) for i in range(batch)]
    timings = []
    for step in range(steps + 1):
        logits = torch.randn(batch, vocab, generator=gen) * 2
        start = time.perf_counter()
        outcomes = decoder.step(states, logits)
        elapsed = time.perf_counter() - start
        if step:
            timings.append(elapsed * 1e3)
        for i, (s, o) in enumerate(zip(states, outcomes)):
            s.record.apply(o)
            if s.is_finished:
                states[i] = new_state(1000 * step + i)
    return statistics.median(timings)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--vocab-sizes", default="32000,128000")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    results = {}
    for vocab in (int(v) for v in args.vocab_sizes.split(",")):
        tokenizer = make_tokenizer(synthetic_tokenizer_json(vocab), vocab, [2])
        compiler = GrammarCompiler(tokenizer, [2])
        compile_ms = []
        for i in range(5):   # distinct schemas: each a cold compile
            schema = dict(SCHEMA, properties=dict(SCHEMA["properties"], **{f"field{i}": {"type": "number"}}))
            start = time.perf_counter()
            compiler.compile("json_schema", json.dumps(schema)).result()
            compile_ms.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        template = compiler.compile("json_schema", json.dumps(schema)).result()
        cached_ms = (time.perf_counter() - start) * 1e3
        plain = time_steps(args.batch, vocab, args.steps, None)
        guided = time_steps(args.batch, vocab, args.steps, template)
        row = {"plain_step_ms": round(plain, 2), "guided_step_ms": round(guided, 2),
               "grammar_us_per_token": round((guided - plain) * 1e3 / args.batch, 1),
               "schema_compile_ms": round(statistics.median(compile_ms), 2), "cached_compile_ms": round(cached_ms, 3)}
        results[f"vocab {vocab}"] = row
        print(f"vocab {vocab:6d}, batch {args.batch}: decoder step {plain:6.2f} ms plain, {guided:6.2f} ms guided "
              f"({row['grammar_us_per_token']:.1f} us per guided token); JSON schema compile "
              f"{row['schema_compile_ms']:.2f} ms (cached {cached_ms:.3f} ms)", flush=True)
        compiler.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
