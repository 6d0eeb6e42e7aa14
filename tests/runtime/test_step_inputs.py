"""pack_step: exact tensors (dtypes, shapes, padding, released entries, context-logits flags),
tensors that outlive the packer's buffers, and ValueErrors for bad sequences."""
from __future__ import annotations

import gc

import pytest
import torch

from runtime.cache.kv_cache_manager import RELEASED
from runtime.step_inputs import SequenceStep, pack_step


def as_lists(inputs: dict[str, torch.Tensor]) -> dict[str, list]:
    return {name: t.tolist() for name, t in inputs.items()}


def test_mixed_step_packs_tokens_in_order_and_pads_tables_with_zero():
    inputs = pack_step([SequenceStep([5, 6, 7], 0, [3]),               # a context chunk
                        SequenceStep([9], 17, [4, RELEASED, 8, 2, 1]),   # a generation token past a window
                        SequenceStep((11, 12), 4, (6, 7))])              # 1 token + 1 draft, tuples
    assert {name: t.dtype for name, t in inputs.items()} == {
        "input_ids": torch.int32, "input_lengths": torch.int32, "past_lengths": torch.int32,
        "block_tables": torch.int32}
    assert as_lists(inputs) == {"input_ids": [5, 6, 7, 9, 11, 12], "input_lengths": [3, 1, 2],
                                "past_lengths": [0, 17, 4],
                                "block_tables": [[3, 0, 0, 0, 0], [4, -1, 8, 2, 1], [6, 7, 0, 0, 0]]}


def test_context_logits_flags_only_when_some_sequence_asks():
    plain = [SequenceStep([1, 2], 0, [0]), SequenceStep([3], 5, [1, 2])]
    assert "return_context_logits" not in pack_step(plain)
    flagged = pack_step([plain[0], SequenceStep([4, 5, 6], 0, [3], return_context_logits=True)])
    assert flagged["return_context_logits"].dtype == torch.bool
    assert flagged["return_context_logits"].tolist() == [False, True]


def test_tensors_outlive_the_packing_buffers_and_do_not_alias_the_inputs():
    table = [7, 8]
    inputs = pack_step([SequenceStep(list(range(100, 164)), 0, table)])
    table[0] = 99                       # a live block table changes after packing
    gc.collect()
    garbage = [list(range(1000)) for _ in range(100)]   # reuse freed memory, if any was freed
    assert inputs["input_ids"].tolist() == list(range(100, 164))
    assert inputs["block_tables"].tolist() == [[7, 8]]
    del garbage


def test_empty_table_rows_give_zero_columns():
    inputs = pack_step([SequenceStep([1], 0, [])])
    assert list(inputs["block_tables"].shape) == [1, 0]


@pytest.mark.parametrize("sequences, field", [
    ([], "sequences"),
    ([SequenceStep([1], 0, [0]), SequenceStep([], 3, [1])], "token_ids"),
    ([SequenceStep([2**31], 0, [0])], "token_ids"),
    ([SequenceStep([1], 2**40, [0])], "past_length"),
    ([SequenceStep([1], 0, [0, 1.5])], "block_table"),
])
def test_bad_sequences_raise_value_error_naming_the_field(sequences, field):
    with pytest.raises(ValueError, match=field):
        pack_step(sequences)


def test_packed_step_runs_on_the_model_runner(tmp_path):
    from runtime import Engine, ModelRunner
    from tests.factories import make_checkpoint
    make_checkpoint(tmp_path, "llama")
    runner = ModelRunner(Engine.from_dir(tmp_path, tokens_per_block=4), num_blocks=6)
    prompt = [3, 4, 5, 6, 7, 8]
    full = runner.forward(pack_step([SequenceStep(prompt, 0, [4, 1], return_context_logits=True)]))
    runner.forward(pack_step([SequenceStep(prompt[:5], 0, [2, 0])]))
    last = runner.forward(pack_step([SequenceStep(prompt[5:], 5, [2, 0])]))["logits"]
    torch.testing.assert_close(last, full["context_logits"][-1:], atol=1e-4, rtol=1e-4)


def test_num_logits_returns_the_last_n_positions_of_each_sequence(tmp_path):
    """A token + D drafts asks for D + 1 logits rows; they equal the context logits of the same
    positions, packed in sequence order next to a plain sequence's single row."""
    from runtime import Engine, ModelRunner
    from tests.factories import make_checkpoint
    make_checkpoint(tmp_path, "llama")
    runner = ModelRunner(Engine.from_dir(tmp_path, tokens_per_block=4), num_blocks=8)
    a, b = [3, 4, 5, 6, 7, 8], [9, 10, 11]
    inputs = pack_step([SequenceStep(a, 0, [0, 1], num_logits=3), SequenceStep(b, 0, [2])])
    assert inputs["num_logits"].tolist() == [3, 1]
    out = runner.forward(inputs)
    full_a = runner.forward(pack_step([SequenceStep(a, 0, [4, 5], return_context_logits=True)]))["context_logits"]
    full_b = runner.forward(pack_step([SequenceStep(b, 0, [6], return_context_logits=True)]))["context_logits"]
    assert out["logits"].shape[0] == 4
    torch.testing.assert_close(out["logits"][:3], full_a[-3:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out["logits"][3:], full_b[-1:], atol=1e-4, rtol=1e-4)
    assert "num_logits" not in pack_step([SequenceStep(b, 0, [2])])
    with pytest.raises(ValueError, match="num_logits"):
        runner.forward(dict(inputs, num_logits=torch.tensor([7, 1], dtype=torch.int32)))
