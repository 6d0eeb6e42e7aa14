"""The whole stack on emu: ModelRunner decoding (GPT-2's strided fused-QKV K/V, Mistral's window)
matches the torch backend, and a GptManager workload yields exactly the torch backend's tokens."""
from __future__ import annotations

import random

import pytest
import torch

from batch_manager import GptManager, KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType
from runtime import Engine, ModelRunner, build_engine
from tests.batch_manager.conftest import Client, make_request
from tests.factories import make_checkpoint, step_inputs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}
    for seed, arch in enumerate(("gpt2", "llama", "mistral")):
        paths[arch] = tmp_path_factory.mktemp(arch)
        make_checkpoint(paths[arch], arch, seed=seed)
    return paths


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mistral"])
def test_incremental_decoding_matches_torch(checkpoints, arch, emu):
    engine = Engine.from_dir(checkpoints[arch], tokens_per_block=4)
    runners = {"torch": ModelRunner(engine, 24, kernels="torch"), "emu": ModelRunner(engine, 24, kernels=emu)}
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (3, 11)]
    tables = [list(range(12)), list(range(23, 11, -1))]
    logits = {name: r.forward(step_inputs([(p, 0, t) for p, t in zip(prompts, tables)])) for name, r in runners.items()}
    past = [len(p) for p in prompts]
    for step in range(14):    # mistral's window is 8 tokens: decoding runs well past it
        torch.testing.assert_close(logits["emu"]["logits"], logits["torch"]["logits"], atol=1e-4, rtol=1e-4,
                                   msg=f"step {step}")
        tokens = logits["torch"]["logits"].argmax(-1).tolist()
        seqs = [([tok], n, t) for tok, n, t in zip(tokens, past, tables)]
        logits = {name: r.forward(step_inputs(seqs)) for name, r in runners.items()}
        past = [n + 1 for n in past]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("manager_emu")
    make_checkpoint(root / "hf", "mistral")
    build_engine(root / "hf", root / "engine", tokens_per_block=4, max_batch_size=4, max_input_len=24,
                 max_seq_len=40, max_num_tokens=64)
    return str(root / "engine")


def run_manager(engine_dir: str, backend: str, prompts: dict[int, list[int]]) -> dict[int, list[int]]:
    arrivals = [0, 0, 1, 3, 5, 8]
    client = Client([make_request(i, p, max_new_tokens=10) for i, p in prompts.items()], arrivals)
    params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=96), kernel_backend=backend)
    with GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.MAX_UTILIZATION,
                    *client.callbacks(), optional_params=params) as manager:
        assert manager.model_executor.runner.kernels.name == backend
        client.wait(120)
    return dict(zip(prompts, client.final_output_ids(prompts)))


def test_gpt_manager_greedy_tokens_equal_torch(engine_dir):
    rng = random.Random(5)
    prompts = {i: [rng.randrange(3, 128) for _ in range(rng.randrange(1, 20))] for i in range(6)}
    expected = run_manager(engine_dir, "torch", prompts)
    assert run_manager(engine_dir, "emu", prompts) == expected
