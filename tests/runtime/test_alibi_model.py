"""BLOOM's ALiBi through the runtime: with an attention window and sink tokens, incremental decoding
over shuffled (and released) blocks and chunked context equal a one-shot step; the emu backend (the
paged_attention.cu kernel on the CPU) equals torch; GptManager with block reuse, chunked context and
a window keeps the tokens of a full recompute (transformers' `generate` where no window is set)."""
from __future__ import annotations

import json
import random

import pytest
import torch

from batch_manager import (GptManager, KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType,
                           tensor_names)
from runtime import Engine, ModelRunner, build_engine
from tests.batch_manager.conftest import Client, make_request
from tests.factories import step_inputs
from tests.runtime.arch_factories import make_checkpoint
from tests.runtime.test_paged_cache import shuffled_block_tables

ATOL = 1e-4
WINDOW, SINK = 8, 2
SYSTEM_PROMPT = [(5 * i + 7) % 120 + 3 for i in range(16)]  # 4 blocks of 4 tokens


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def bloom(tmp_path_factory):
    """(checkpoint dir, transformers model): 6 heads, so the slopes include the non-power-of-two tail."""
    path = tmp_path_factory.mktemp("bloom")
    return path, make_checkpoint(path, "bloom_6_heads", seed=3)


@pytest.fixture(scope="module")
def emu():
    from runtime.kernels.cuda.emu_backend import EmuKernels, compiler_available
    if not compiler_available():
        pytest.skip("emu kernels need a C++20 compiler (g++)")
    return EmuKernels()


def windowed_runner(engine: Engine, num_blocks: int, kernels=None) -> ModelRunner:
    return ModelRunner(engine, num_blocks, kernels=kernels, max_attention_window=WINDOW, sink_token_length=SINK)


def one_shot(engine: Engine, tokens: list[int]) -> torch.Tensor:
    """float32 [len(tokens), V]: every position's logits from one fresh windowed context step."""
    num_blocks = -(-len(tokens) // engine.build_config.tokens_per_block)
    runner = windowed_runner(engine, num_blocks)
    return runner.forward(step_inputs([(tokens, 0, list(range(num_blocks)))], True))["context_logits"]


def test_the_window_changes_alibi_logits(bloom):
    engine = Engine.from_dir(bloom[0], tokens_per_block=4)
    tokens = random_tokens(30, seed=1)
    full = ModelRunner(engine, 8).forward(step_inputs([(tokens, 0, list(range(8)))], True))["context_logits"]
    windowed = one_shot(engine, tokens)
    torch.testing.assert_close(windowed[:WINDOW], full[:WINDOW], atol=ATOL, rtol=0)  # nothing cut yet
    assert (windowed[-1] - full[-1]).abs().max() > 1e-2


@pytest.mark.parametrize("backend", ["torch", "emu"])
def test_windowed_decoding_over_released_blocks_equals_one_shot(bloom, backend, request):
    """Decoding runs well past the window; blocks no query can see any more are released (negative
    ids in the table), so every key read must come from its absolute position's block."""
    kernels = request.getfixturevalue("emu") if backend == "emu" else "torch"
    engine = Engine.from_dir(bloom[0], tokens_per_block=4)
    prompts = [random_tokens(n, seed=n) for n in (3, 11)]
    continuations = [random_tokens(20, seed=50 + i) for i in range(2)]
    references = [one_shot(engine, p + c) for p, c in zip(prompts, continuations)]
    tables = shuffled_block_tables(18, 8, 2, seed=5)
    runner = windowed_runner(engine, 18, kernels)
    logits = runner.forward(step_inputs([(p, 0, t) for p, t in zip(prompts, tables)]))["logits"]
    num_released = 0
    for step in range(len(continuations[0]) + 1):
        for i, p in enumerate(prompts):
            torch.testing.assert_close(logits[i], references[i][len(p) - 1 + step], atol=ATOL, rtol=0,
                                       msg=f"sequence {i} step {step}")
        if step == len(continuations[0]):
            break
        seqs = []
        for p, c, table in zip(prompts, continuations, tables):
            past = len(p) + step
            released = [j for j in range(1, (past - WINDOW + 1) // 4)]  # block 0 holds the sinks
            num_released += len(released)
            seqs.append(([c[step]], past, [-1 if j in released else b for j, b in enumerate(table)]))
        logits = runner.forward(step_inputs(seqs))["logits"]
    assert num_released > 0


def test_windowed_chunked_context_equals_one_shot(bloom):
    engine = Engine.from_dir(bloom[0], tokens_per_block=4)
    tokens = random_tokens(27, seed=9)
    reference = one_shot(engine, tokens)
    runner = windowed_runner(engine, 7)
    table, past = shuffled_block_tables(7, 7, 1, seed=2)[0], 0
    for n in (10, 1, 9, 7):
        out = runner.forward(step_inputs([(tokens[past:past + n], past, table)], context_logits=True))
        torch.testing.assert_close(out["context_logits"], reference[past:past + n], atol=ATOL, rtol=0)
        past += n


# --- GptManager ---------------------------------------------------------------------------------------

NUM_NEW_TOKENS = 10


@pytest.fixture(scope="module")
def engine_dir(bloom, tmp_path_factory):
    path = tmp_path_factory.mktemp("bloom_engine")
    build_engine(bloom[0], path, tokens_per_block=4, max_batch_size=4, max_input_len=32, max_seq_len=48,
                 max_num_tokens=64)
    return str(path)


@pytest.fixture(scope="module")
def shared_prompts():
    rng = random.Random(2)
    return {i: SYSTEM_PROMPT + [rng.randrange(3, 128) for _ in range(rng.randrange(1, 10))] for i in range(6)}


def recompute_greedy(engine: Engine, prompt: list[int], window: int | None, sink: int) -> list[int]:
    """prompt + NUM_NEW_TOKENS greedy tokens, each from a fresh context step over the whole sequence."""
    runner = ModelRunner(engine, 16, max_attention_window=window, sink_token_length=sink)
    tokens = list(prompt)
    for _ in range(NUM_NEW_TOKENS):
        logits = runner.forward(step_inputs([(tokens, 0, list(range(16)))]))["logits"]
        tokens.append(int(logits[0].argmax()))
    return tokens


def run_manager(engine_dir: str, prompts: dict[int, list[int]], params: TrtGptModelOptionalParams):
    client = Client([make_request(i, p, max_new_tokens=NUM_NEW_TOKENS) for i, p in prompts.items()],
                    [3 * i for i in prompts])
    with GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *client.callbacks(), optional_params=params):
        client.wait(120)
    outputs = {}
    for i in prompts:
        tensors, _, err = client.final(i)
        assert err == "", err
        outputs[i] = tensors[tensor_names.OUTPUT_IDS][0, 0].tolist()
    return outputs, json.loads(client.stats[-1])


def test_manager_block_reuse_matches_generate(bloom, engine_dir, shared_prompts):
    _, model = bloom
    params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=160, enable_block_reuse=True),
                                       enable_chunked_context=True, max_num_tokens=12)
    outputs, stats = run_manager(engine_dir, shared_prompts, params)
    assert stats["Reused KV cache blocks"] > 0
    for i, p in shared_prompts.items():
        expected = model.generate(torch.tensor([p]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0].tolist()
        assert outputs[i] == expected, f"request {i}"


@pytest.mark.parametrize("backend", ["torch", "emu"])
def test_manager_reuse_chunks_window_and_sinks_match_a_full_recompute(engine_dir, shared_prompts, backend):
    params = TrtGptModelOptionalParams(
        kv_cache_config=KvCacheConfig(max_tokens=160, enable_block_reuse=True, max_attention_window=WINDOW,
                                      sink_token_length=SINK),
        enable_chunked_context=True, max_num_tokens=12, kernel_backend=backend)
    outputs, stats = run_manager(engine_dir, shared_prompts, params)
    assert stats["Reused KV cache blocks"] > 0
    engine = Engine.from_dir(engine_dir)
    for i, p in shared_prompts.items():
        assert outputs[i] == recompute_greedy(engine, p, WINDOW, SINK), f"request {i}"
