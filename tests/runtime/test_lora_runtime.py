"""The runtime side of LoRA and prompt tuning: the PEFT directory loader (rows, scaling, refusals),
the grouped per-step computation (batched and looped) against a per-token reference (interleaved
sequences, MLP row chunks), and the runner's checks of its LoRA and prompt-table inputs."""
from __future__ import annotations

import json
import math

import pytest
import torch

from runtime import Engine, ModelRunner
from runtime.adapters.lora import LORA_MODULE_IDS, adapter_from_tensors
from runtime.adapters.lora_step import LoraWeightStore
from runtime.adapters.peft_adapter import load_peft_adapter
from runtime.step_inputs import SequenceStep, pack_step
from tests.factories import make_checkpoint
from tests.lora_helpers import ALL_TARGETS, make_peft_adapter


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_runtime")
    model = make_checkpoint(root / "hf", "llama")
    peft_model = make_peft_adapter(model, root / "adapter", 4, 12, ALL_TARGETS["llama"], seed=3)
    return root, model, peft_model


@pytest.mark.parametrize("use_rslora", [False, True])
def test_peft_directory_rows_fold_the_scaling_into_b(llama, tmp_path, use_rslora):
    root, model, _ = llama
    peft_model = make_peft_adapter(model, tmp_path, 4, 12, ["q_proj", "down_proj"], seed=4, use_rslora=use_rslora)
    weights, config = load_peft_adapter(tmp_path)
    q, down = LORA_MODULE_IDS["attn_q"], LORA_MODULE_IDS["mlp_4h_to_h"]
    assert config.tolist() == [[q, 0, 4], [down, 0, 4], [q, 1, 4], [down, 1, 4]]
    scaling = 12 / math.sqrt(4) if use_rslora else 12 / 4
    layer = peft_model.base_model.model.model.layers[1].mlp.down_proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = torch.cat([a.flatten(), (b * scaling).flatten()])
    assert torch.equal(weights[3, :expected.numel()], expected.detach())
    assert torch.equal(weights[0, 4 * (64 + 64):], torch.zeros(weights.shape[1] - 4 * 128))   # zero padded


def test_peft_directory_refusals(llama, tmp_path):
    root, _, _ = llama
    (tmp_path / "adapter_model.bin").write_bytes(b"pickle")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    with pytest.raises(ValueError, match="adapter_model.bin is refused: safetensors only"):
        load_peft_adapter(tmp_path)
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    for change, message in [({"modules_to_save": ["lm_head"]}, "modules_to_save"), ({"use_dora": True}, "use_dora"),
                            ({"bias": "all"}, "bias='all' is not supported")]:
        (tmp_path / "adapter_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            load_peft_adapter(tmp_path)


@pytest.mark.parametrize("sizes, batched", [((6, 4), True), ((12, 1, 1), False), ((8,), False),
                                            ((3, 3, 2), True)])
def test_grouped_products_equal_a_per_token_reference(llama, sizes, batched):
    """Adapters of different ranks (one without the q/k/v linear) on sequences that interleave, one
    more sequence without an adapter; batched (padded bmm) or looped per the rows' shares; applied
    whole and in row chunks (the MLP's) of 5."""
    root, _, _ = llama
    cfg = Engine.from_dir(root / "hf").model_config
    gen = torch.Generator().manual_seed(0)
    store = LoraWeightStore(torch.device("cpu"), torch.float32)
    for task_id, rank in enumerate((2, 6, 3)):
        module = LORA_MODULE_IDS["attn_dense"] if task_id == 2 else LORA_MODULE_IDS["attn_k"]
        config = torch.tensor([(module, 0, rank), (LORA_MODULE_IDS["attn_v"], 0, rank)], dtype=torch.int32)
        store.load(task_id, adapter_from_tensors(torch.randn(2, rank * (64 + 64), generator=gen), config, cfg, 64))
    # Sequences: adapter i's share split in two, interleaved with the others, then one without.
    seq_tasks, seq_lengths = [], []
    for half in (0, 1):
        for task_id, size in enumerate(sizes):
            n = size // 2 if half == 0 else size - size // 2
            if n:
                seq_tasks.append(task_id)
                seq_lengths.append(n)
    seq_tasks.append(-1)
    seq_lengths.append(2)
    starts = [sum(seq_lengths[:i]) for i in range(len(seq_lengths))]
    plan = store.plan(seq_tasks, starts, seq_lengths)
    num_tokens = sum(seq_lengths)
    assert plan.is_batched(0, num_tokens) == batched
    x = torch.randn(num_tokens, 64, generator=gen)
    base = torch.randn(num_tokens, 128, generator=gen)
    expected = base.clone()
    for seq, task_id in enumerate(seq_tasks):
        factors = store[task_id].factors.get("layers.0.qkv") if task_id >= 0 else None
        if factors is not None:
            a, b = factors
            for t in range(starts[seq], starts[seq] + seq_lengths[seq]):
                expected[t] += b @ (a @ x[t])
    whole = base.clone()
    plan.apply("layers.0.qkv", x, whole)
    torch.testing.assert_close(whole, expected)
    chunked = base.clone()
    for start in range(0, num_tokens, 5):
        plan.apply("layers.0.qkv", x[start:start + 5], chunked[start:start + 5], start)
    torch.testing.assert_close(chunked, expected)
    assert torch.equal(whole[-2:], base[-2:])
    untouched = base.clone()
    plan.apply("layers.1.qkv", x, untouched)   # no factors for layer 1
    assert torch.equal(untouched, base)


def test_runner_chunked_mlp_and_mixed_steps_match_the_peft_model(llama):
    root, _, peft_model = llama
    engine = Engine.from_dir(root / "hf")
    runner = ModelRunner(engine, 32)
    runner.model.mlp_chunk_rows = 3         # every linear's LoRA rows cross chunk boundaries
    runner.lora_store.load(9, adapter_from_tensors(*load_peft_adapter(root / "adapter"), engine.model_config, 64))
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
    out = runner.forward(pack_step([SequenceStep(prompts[0], 0, [0, 1], True, lora_task_id=9),
                                    SequenceStep(prompts[1], 0, [2], True),
                                    SequenceStep(prompts[2], 0, [3], True, lora_task_id=9)]))
    with torch.no_grad():
        for i, start in ((0, 0), (2, 8)):
            ref = peft_model(torch.tensor([prompts[i]])).logits[0]
            torch.testing.assert_close(out["context_logits"][start:start + len(prompts[i])], ref, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="lora_task_ids: task 4 .* is not loaded"):
        runner.forward(pack_step([SequenceStep([1, 2], 0, [5], lora_task_id=4)]))
    runner.lora_store.evict(9)
    with pytest.raises(ValueError, match="lora_task_ids: task 9"):
        runner.forward(pack_step([SequenceStep([1, 2], 0, [5], lora_task_id=9)]))


def test_runner_prompt_table_checks(llama):
    root, _, _ = llama
    runner = ModelRunner(Engine.from_dir(root / "hf"), 8)
    table = torch.randn(3, 64)
    ok = runner.forward(pack_step([SequenceStep([128, 130, 5], 0, [0], prompt_table=table), SequenceStep([7], 0, [1])]))
    assert ok["logits"].shape == (2, 128)
    with pytest.raises(ValueError, match=r"input_ids: token id 131 of sequence 0 is outside \[0, 128 \+ its prompt "
                                         r"table's 3 rows\)"):
        runner.forward(pack_step([SequenceStep([131, 5], 0, [0], prompt_table=table)]))
    with pytest.raises(ValueError, match=r"input_ids: token ids must be in \[0, 128\)"):
        runner.forward(pack_step([SequenceStep([128, 5], 0, [0])]))


def test_pack_step_stacks_each_distinct_table_once():
    t1, t2 = torch.ones(2, 4), torch.zeros(3, 4)
    inputs = pack_step([SequenceStep([1], 0, [0], prompt_table=t1), SequenceStep([2], 0, [1]),
                        SequenceStep([3], 0, [2], prompt_table=t2), SequenceStep([4], 0, [3], prompt_table=t1,
                                                                             lora_task_id=7)])
    assert inputs["prompt_embedding_table"].shape == (5, 4)
    assert inputs["prompt_table_offsets"].tolist() == [0, -1, 2, 0]
    assert inputs["prompt_vocab_sizes"].tolist() == [2, 0, 3, 2]
    assert inputs["lora_task_ids"].tolist() == [-1, -1, -1, 7]
