"""Benchmark the step packer: runtime.step_inputs.pack_step (SequenceSteps built included) against
packing by plain lists and one torch.tensor per field (the manager's executor before the packer).

    python -m samples.microbench.packing [--repeats 7] [--json OUT]

Cases: 64 generation sequences x 1 token with 40-block tables; 16 contexts x 256 tokens.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from runtime.step_inputs import SequenceStep, pack_step

Case = list[tuple[list[int], int, list[int]]]   # (new tokens, past length, block table) per sequence


def pack_with_lists(sequences: Case) -> dict[str, torch.Tensor]:
    """The former executor packing: lists, then torch.tensor per field on (nested) lists."""
    token_ids, lengths, past, tables = [], [], [], []
    for tokens, past_length, table in sequences:
        token_ids.extend(tokens)
        lengths.append(len(tokens))
        past.append(past_length)
        tables.append(table)
    width = max(len(t) for t in tables)
    return {"input_ids": torch.tensor(token_ids, dtype=torch.int32),
            "input_lengths": torch.tensor(lengths, dtype=torch.int32),
            "past_lengths": torch.tensor(past, dtype=torch.int32),
            "block_tables": torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)}


def pack_with_packer(sequences: Case) -> dict[str, torch.Tensor]:
    return pack_step([SequenceStep(tokens, past, table) for tokens, past, table in sequences])


def make_cases(tokens_per_block: int = 16) -> dict[str, Case]:
    rng = random.Random(0)
    generation = [([rng.randrange(32000)], 40 * tokens_per_block - 1, list(range(40 * i, 40 * (i + 1))))
                  for i in range(64)]
    context = [([rng.randrange(32000) for _ in range(256)], 0, list(range(16 * i, 16 * (i + 1))))
               for i in range(16)]
    return {"generation 64 x 1 token, 40 blocks": generation, "context 16 x 256 tokens": context}


def best_us(fns, case: Case, repeats: int, number: int) -> list[float]:
    """Per fn, the best mean microseconds per call over `repeats` rounds of `number` calls; the
    rounds of the fns alternate, so a busy machine slows them alike."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for j, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(number):
                fn(case)
            best[j] = min(best[j], (time.perf_counter() - start) / number)
    return [b * 1e6 for b in best]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--number", type=int, default=200, help="calls per round")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    for name, case in make_cases().items():
        before, after = pack_with_lists(case), pack_with_packer(case)
        assert all(torch.equal(before[k], after[k]) for k in before), f"{name}: the two packings differ"
        lists_us, packer_us = best_us([pack_with_lists, pack_with_packer], case, args.repeats, args.number)
        results[name] = {"lists_us": lists_us, "packer_us": packer_us}
        print(f"{name}: lists + torch.tensor {lists_us:.1f} us, pack_step {packer_us:.1f} us "
              f"({lists_us / packer_us:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
