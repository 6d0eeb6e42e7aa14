"""GptManager on emu with the decoding kernels in play: a mixed workload (greedy, seeded sampling
with penalties / top-k / top-p, a beam request) yields exactly the torch backend's tokens."""
from __future__ import annotations

import pytest
import torch

from batch_manager import (GptManager, KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType,
                           tensor_names)
from runtime import build_engine
from tests.batch_manager.conftest import Client, make_request
from tests.factories import make_checkpoint

PROMPTS = {0: [5, 17, 99, 3, 40], 1: [42, 7], 2: [100, 101, 102, 8, 9, 60, 61], 3: [77, 12, 13], 4: [64] * 6}


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("manager_decoding_emu")
    make_checkpoint(root / "hf", "llama", seed=2)
    build_engine(root / "hf", root / "engine", tokens_per_block=4, max_batch_size=4, max_input_len=24,
                 max_seq_len=40, max_num_tokens=64)
    return str(root / "engine")


def workload() -> list:
    seed = lambda value: torch.tensor([value], dtype=torch.int64)  # noqa: E731
    return [
        make_request(0, PROMPTS[0], max_new_tokens=8),
        make_request(1, PROMPTS[1], max_new_tokens=8, temperature=torch.tensor([0.8]),
                     runtime_top_k=torch.tensor([5], dtype=torch.int32), random_seed=seed(11)),
        make_request(2, PROMPTS[2], max_new_tokens=8, runtime_top_p=torch.tensor([0.85]),
                     repetition_penalty=torch.tensor([1.3]), random_seed=seed(-3)),  # uint64 2^64 - 3
        make_request(3, PROMPTS[3], max_new_tokens=8, beam_width=torch.tensor([2], dtype=torch.int32),
                     return_log_probs=torch.tensor([True])),
        make_request(4, PROMPTS[4], max_new_tokens=8, runtime_top_k=torch.tensor([30], dtype=torch.int32),
                     runtime_top_p=torch.tensor([0.7]), frequency_penalty=torch.tensor([0.4]),
                     min_length=torch.tensor([4]), random_seed=seed(7)),
    ]


def run_manager(engine_dir: str, backend: str) -> dict[int, list[list[int]]]:
    client = Client(workload(), [0, 0, 1, 2, 4])
    params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=160), kernel_backend=backend)
    with GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 2, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *client.callbacks(), optional_params=params) as manager:
        assert manager.model_executor.runner.kernels.name == backend
        client.wait(120)
    beams = {}
    for i in PROMPTS:
        tensors, _, err = client.final(i)
        assert err == ""
        lengths = tensors[tensor_names.SEQUENCE_LENGTH][0].tolist()
        beams[i] = [tensors[tensor_names.OUTPUT_IDS][0, b, :n].tolist() for b, n in enumerate(lengths)]
    return beams


def test_mixed_workload_tokens_equal_torch(engine_dir):
    expected = run_manager(engine_dir, "torch")
    assert len(expected[3]) == 2 and all(len(b[0]) > len(PROMPTS[i]) for i, b in expected.items())
    assert run_manager(engine_dir, "emu") == expected
