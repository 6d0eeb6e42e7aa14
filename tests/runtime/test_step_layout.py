"""StepPlanner.fused_generation (runtime.step_layout): its checks on Python lists agree with the
general path's (`layout`, which raises ValueError naming the input) on random generation steps, with
and without an attention window and sink tokens, and its arguments equal the general layout's
positions, cache slots and sequence lengths."""
from __future__ import annotations

import random

import pytest
import torch

from runtime.adapters.lora_step import LoraWeightStore
from runtime.step_layout import StepPlanner

VOCAB, TPB, NUM_BLOCKS, WIDTH = 50, 4, 12, 6


def planner(window: int | None, sink: int) -> StepPlanner:
    return StepPlanner(VOCAB, 8, TPB, NUM_BLOCKS, window, sink, torch.device("cpu"), torch.float32,
                       LoraWeightStore(torch.device("cpu"), torch.float32))


def random_step(rng: random.Random) -> dict[str, torch.Tensor]:
    """One new token per sequence; now and then an id, a position or a table entry out of range,
    including entries the step does not read (-1 there is allowed)."""
    rows = rng.randint(1, 4)
    past = [rng.randint(0, TPB * WIDTH - 1) for _ in range(rows)]
    ids = [rng.randint(0, VOCAB - 1) for _ in range(rows)]
    tables = [[rng.randrange(NUM_BLOCKS) for _ in range(WIDTH)] for _ in range(rows)]
    for _ in range(rng.randint(0, 2)):
        r, c = rng.randrange(rows), rng.randrange(WIDTH)
        tables[r][c] = rng.choice([-1, NUM_BLOCKS, NUM_BLOCKS + 5])
    if rng.random() < 0.1:
        ids[rng.randrange(rows)] = rng.choice([-1, VOCAB])
    if rng.random() < 0.05:
        past[rng.randrange(rows)] = -1
    if rng.random() < 0.05:
        past[rng.randrange(rows)] = TPB * WIDTH   # its block is past the table's width
    inputs = {"input_ids": torch.tensor(ids), "input_lengths": torch.ones(rows, dtype=torch.int32),
              "past_lengths": torch.tensor(past), "block_tables": torch.tensor(tables, dtype=torch.int32)}
    if rng.random() < 0.3:
        inputs["position_ids"] = torch.tensor([p + rng.randint(0, 3) for p in past])
    if rng.random() < 0.2:
        inputs["num_logits"] = torch.ones(rows, dtype=torch.int32)
    return inputs


@pytest.mark.parametrize("window, sink", [(None, 0), (6, 0), (5, 3)])
def test_fused_generation_agrees_with_the_general_layout(window, sink):
    rng = random.Random(window or 0)
    plan = planner(window, sink)
    taken = refused = 0
    for _ in range(400):
        inputs = random_step(rng)
        fused = plan.fused_generation(inputs, max_rows=8)
        try:
            layout = plan.layout(inputs)
        except ValueError:
            assert fused is None, inputs
            refused += 1
            continue
        assert fused is not None, inputs
        taken += 1
        ids, positions, slots, block_tables, seq_lens = fused
        assert ids.tolist() == layout.input_ids.tolist()
        assert positions.tolist() == layout.position_ids.tolist()
        assert slots.tolist() == layout.slot_mapping.tolist()
        assert torch.equal(block_tables, layout.block_tables)
        assert seq_lens.tolist() == layout.generation_seq_lens.tolist()
    assert taken > 100 and refused > 50   # both sides of every check were exercised


def test_fused_generation_declines_what_it_does_not_cover():
    plan = planner(None, 0)
    step = {"input_ids": torch.tensor([1, 2]), "input_lengths": torch.tensor([1, 1]),
            "past_lengths": torch.tensor([3, 0]), "block_tables": torch.zeros(2, 2, dtype=torch.int32)}
    assert plan.fused_generation(step, max_rows=8) is not None
    assert plan.fused_generation(step, max_rows=1) is None                       # more rows than it takes
    assert plan.fused_generation({**step, "input_ids": torch.tensor([1, 2, 3]),
                                  "input_lengths": torch.tensor([1, 2])}, max_rows=8) is None   # a context
    assert plan.fused_generation({**step, "num_logits": torch.tensor([1, 2])}, max_rows=8) is None
    assert plan.fused_generation({**step, "lora_task_ids": torch.tensor([0, 0])}, max_rows=8) is None
