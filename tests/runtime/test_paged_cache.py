"""The paged KV cache: incremental and chunked decoding over arbitrary block ids equal a one-shot
context step; block copies; ModelRunner.forward input validation."""
from __future__ import annotations

import pytest
import torch

from runtime import Engine, KvBlocks, ModelRunner
from runtime.kernels import TorchKernels
from tests.factories import make_checkpoints, step_inputs

ATOL = 1e-4
VOCAB = 128


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def one_shot_logits(engine: Engine, tokens: list[int]) -> torch.Tensor:
    """Every position's logits [len(tokens), V] from one fresh context step in a fresh runner."""
    tpb = engine.build_config.tokens_per_block
    num_blocks = -(-len(tokens) // tpb)
    runner = ModelRunner(engine, num_blocks)
    return runner.forward(step_inputs([(tokens, 0, list(range(num_blocks)))], True))["context_logits"]


def shuffled_block_tables(num_blocks: int, blocks_per_seq: int, num_seqs: int, seed: int) -> list[list[int]]:
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    return [ids[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(num_seqs)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> checkpoint dir."""
    return {arch: path for arch, (path, _) in make_checkpoints(tmp_path_factory).items()}


@pytest.fixture(scope="module")
def llama_engine(checkpoints):
    return Engine.from_dir(checkpoints["llama"], tokens_per_block=4)


@pytest.mark.parametrize("tokens_per_block", [1, 4, 16, 128])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_incremental_decoding_over_shuffled_blocks_equals_one_shot(checkpoints, arch, tokens_per_block):
    engine = Engine.from_dir(checkpoints[arch], tokens_per_block=tokens_per_block)
    num_steps = 12
    prompts = [random_tokens(n, seed=n) for n in (5, 9, 2)]
    continuations = [random_tokens(num_steps, seed=100 + i) for i in range(3)]
    full = [p + c for p, c in zip(prompts, continuations)]
    blocks_per_seq = -(-max(map(len, full)) // tokens_per_block)
    num_blocks = 3 * blocks_per_seq + 5  # spare blocks stay unused
    runner = ModelRunner(engine, num_blocks)
    tables = shuffled_block_tables(num_blocks, blocks_per_seq, 3, seed=tokens_per_block)
    if tokens_per_block == 1:
        assert tables[0] != sorted(tables[0])  # the ids really are out of order

    references = [one_shot_logits(engine, tokens) for tokens in full]
    logits = runner.forward(step_inputs([(p, 0, t) for p, t in zip(prompts, tables)]))["logits"]
    for step in range(num_steps + 1):
        for i, p in enumerate(prompts):
            torch.testing.assert_close(logits[i], references[i][len(p) - 1 + step], atol=ATOL, rtol=0,
                                       msg=f"sequence {i} step {step}")
        if step < num_steps:
            seqs = [([c[step]], len(p) + step, t) for p, c, t in zip(prompts, continuations, tables)]
            logits = runner.forward(step_inputs(seqs))["logits"]


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_chunked_context_equals_one_shot(checkpoints, arch):
    engine = Engine.from_dir(checkpoints[arch], tokens_per_block=4)
    a, b = random_tokens(25, seed=1), random_tokens(19, seed=2)
    references = [one_shot_logits(engine, a), one_shot_logits(engine, b)]
    # The two prompts are split differently and share steps; a 1-token chunk is a generation step.
    chunks_a, chunks_b = [10, 1, 6, 8], [3, 9, 2, 5]
    tables = shuffled_block_tables(20, 7, 2, seed=3)
    runner = ModelRunner(engine, 20)
    past = [0, 0]
    for n_a, n_b in zip(chunks_a, chunks_b):
        seqs = [(a[past[0]:past[0] + n_a], past[0], tables[0]), (b[past[1]:past[1] + n_b], past[1], tables[1])]
        out = runner.forward(step_inputs(seqs, context_logits=True))
        torch.testing.assert_close(out["context_logits"][:n_a], references[0][past[0]:past[0] + n_a],
                                   atol=ATOL, rtol=0)
        torch.testing.assert_close(out["context_logits"][n_a:], references[1][past[1]:past[1] + n_b],
                                   atol=ATOL, rtol=0)
        past = [past[0] + n_a, past[1] + n_b]
    assert past == [len(a), len(b)]


def test_position_ids_input_overrides_cache_positions(llama_engine):
    tokens = random_tokens(6, seed=4)
    runner = ModelRunner(llama_engine, 8)
    default = runner.forward(step_inputs([(tokens, 0, [0, 1])], True))["context_logits"]
    inputs = step_inputs([(tokens, 0, [2, 3])], True)
    inputs["position_ids"] = torch.arange(6, dtype=torch.int32)
    torch.testing.assert_close(runner.forward(inputs)["context_logits"], default, atol=0, rtol=0)
    # RoPE is relative: shifting every position alike keeps the logits; a gap changes them.
    inputs["position_ids"] = torch.arange(6, dtype=torch.int32) + 3
    torch.testing.assert_close(runner.forward(inputs)["context_logits"], default, atol=ATOL, rtol=0)
    inputs["position_ids"] = torch.tensor([0, 1, 2, 3, 4, 9], dtype=torch.int32)
    gapped = runner.forward(inputs)["context_logits"]
    torch.testing.assert_close(gapped[:5], default[:5], atol=0, rtol=0)
    assert (gapped[5] - default[5]).abs().max() > 1e-2


# --- block copies -----------------------------------------------------------------------------

def test_copy_blocks_copies_every_layer_k_and_v():
    torch.manual_seed(0)
    pool = torch.randn(3, 2, 6, 4, 2, 8)  # [layers, K/V, blocks, tpb, kv heads, head dim]
    before = pool.clone()
    TorchKernels().copy_blocks(pool, torch.tensor([0, 4]), torch.tensor([5, 1]))
    for layer in range(3):
        for kv in range(2):
            assert torch.equal(pool[layer, kv, 5], before[layer, kv, 0])
            assert torch.equal(pool[layer, kv, 1], before[layer, kv, 4])
            for untouched in (0, 2, 3, 4):
                assert torch.equal(pool[layer, kv, untouched], before[layer, kv, untouched])
    TorchKernels().copy_blocks(pool, torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))
    assert torch.equal(pool[:, :, 5], before[:, :, 0])


def test_copied_blocks_continue_the_sequence(llama_engine):
    """A sequence forked by copying its blocks decodes exactly like the original."""
    tokens = random_tokens(10, seed=5)
    runner = ModelRunner(llama_engine, 8)
    runner.forward(step_inputs([(tokens[:-1], 0, [0, 1, 2])]))
    runner.copy_blocks([0, 1, 2], [7, 5, 3])
    original = runner.forward(step_inputs([(tokens[-1:], 9, [0, 1, 2])]))["logits"]
    forked = runner.forward(step_inputs([(tokens[-1:], 9, [7, 5, 3])]))["logits"]
    torch.testing.assert_close(forked, original, atol=0, rtol=0)
    torch.testing.assert_close(original[0], one_shot_logits(llama_engine, tokens)[-1], atol=ATOL, rtol=0)


# --- forward input validation -----------------------------------------------------------------

def _valid_inputs() -> dict:
    return step_inputs([(random_tokens(6, 1), 0, [0, 1]), ([5], 3, [2, 3])])


def _without(name):
    def edit(inputs):
        del inputs[name]
    return edit


def _set(name, value):
    def edit(inputs):
        inputs[name] = value
    return edit


BAD_INPUTS = {
    "missing input": (_without("past_lengths"), "past_lengths"),
    "unknown input": (_set("attention_mask", torch.ones(7, dtype=torch.int32)), "attention_mask"),
    "block id out of range": (_set("block_tables", torch.tensor([[0, 8], [2, 3]], dtype=torch.int32)), "block_tables"),
    "negative block id": (_set("block_tables", torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)), "block_tables"),
    "too few block columns": (_set("block_tables", torch.tensor([[0], [2]], dtype=torch.int32)), "block_tables"),
    "lengths not summing": (_set("input_lengths", torch.tensor([5, 1], dtype=torch.int32)), "input_lengths"),
    "zero length": (_set("input_lengths", torch.tensor([7, 0], dtype=torch.int32)), "input_lengths"),
    "token id >= vocab": (_set("input_ids", torch.tensor([1, 2, 3, VOCAB, 4, 5, 6], dtype=torch.int32)), "input_ids"),
    "negative token id": (_set("input_ids", torch.tensor([1, 2, 3, -1, 4, 5, 6], dtype=torch.int32)), "input_ids"),
    "float input_ids": (_set("input_ids", torch.zeros(7)), "input_ids"),
    "past_lengths rows": (_set("past_lengths", torch.tensor([0], dtype=torch.int32)), "past_lengths"),
    "position_ids shape": (_set("position_ids", torch.arange(6, dtype=torch.int32)), "position_ids"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_forward_rejects_bad_inputs_and_leaves_cache_untouched(llama_engine, case):
    edit, tensor_name = BAD_INPUTS[case]
    runner = ModelRunner(llama_engine, 8)
    runner.forward(_valid_inputs())  # the valid inputs run
    pool = runner.kv_pool.clone()
    inputs = _valid_inputs()
    edit(inputs)
    with pytest.raises(ValueError, match=tensor_name):
        runner.forward(inputs)
    assert torch.equal(runner.kv_pool, pool)



@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_blocks_read_from_one_runner_and_written_into_another_continue_the_sequence(checkpoints, kv_cache_dtype):
    """read_blocks (views of the pool, a part per run of ids) and write_blocks at other ids of
    another runner: the same bytes, the same next logits; blocks of another pool's layout refused."""
    engine = Engine.from_dir(checkpoints["llama"], tokens_per_block=4, kv_cache_dtype=kv_cache_dtype)
    source, target = ModelRunner(engine, 8), ModelRunner(engine, 8)
    source.forward(step_inputs([(random_tokens(10, seed=5), 0, [2, 3, 6])]))
    blocks = source.read_blocks([2, 3, 6])
    assert [part.shape[2] for part in blocks.values] == [2, 1]
    assert blocks.values[0].data_ptr() == source.kv_pool[:, :, 2].data_ptr()
    target.write_blocks([4, 7, 0], blocks, slots=[2, 0, 1])   # 4 <- 6, 7 <- 2, 0 <- 3
    for pool in ("kv_pool",) if kv_cache_dtype == "auto" else ("kv_pool", "kv_scales"):
        assert torch.equal(getattr(target, pool)[:, :, [7, 0, 4]], getattr(source, pool)[:, :, [2, 3, 6]])
    nxt = random_tokens(1, seed=6)
    torch.testing.assert_close(target.forward(step_inputs([(nxt, 10, [7, 0, 4])]))["logits"],
                               source.forward(step_inputs([(nxt, 10, [2, 3, 6])]))["logits"], atol=0, rtol=0)
    before = target.kv_pool.clone()
    with pytest.raises(ValueError, match="do not fit this pool"):   # scales where none are, or none where they are
        target.write_blocks([0, 1, 2], KvBlocks(blocks.values, None if blocks.scales else blocks.values))
    assert torch.equal(target.kv_pool, before)
