"""KV pool sizing: max_tokens, free_gpu_memory_fraction of the host budget on CPU, both -> the
minimum; the stats report the pool's size."""
from __future__ import annotations

import json
import math

import pytest
import torch

from batch_manager import GptManager, KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType
from batch_manager.scheduling.kv_sizing import HOST_KV_BUDGET_ENV, host_budget_bytes, num_kv_blocks
from runtime import Engine, ModelRunner
from tests.batch_manager.conftest import Client, make_request, inject_faults

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return Engine.from_dir(tiny_engine[0])


def test_bytes_per_block_is_layers_kv_tokens_heads_dim_dtype(engine):
    cfg = engine.model_config
    assert ModelRunner.kv_bytes_per_block(engine) == cfg.num_layers * 2 * 4 * cfg.num_kv_heads * cfg.head_dim * 4
    assert ModelRunner.kv_bytes_per_block(engine) == 2 * 2 * 4 * 2 * 16 * 4   # tiny LLaMA: 1 KiB


@pytest.mark.parametrize("budget, fraction, max_tokens, expected", [
    (200 << 10, None, None, 90),      # 0.9 of 200 KiB in 2 KiB blocks
    (200 << 10, 0.5, None, 50),
    (200 << 10, 0.5, 400, 50),        # both: the minimum (100 blocks from max_tokens)
    (200 << 10, 0.5, 120, 30),        # both: the minimum (30 blocks from max_tokens)
    (200 << 10, None, 121, 31),       # max_tokens rounds up to whole blocks
    (1 << 30, None, None, 8 * 24),    # no max_tokens: at most max_num_sequences full sequences
    (1 << 30, 1.0, 10_000, 2500),     # max_tokens alone may exceed that cap
])
def test_pool_size(engine, monkeypatch, budget, fraction, max_tokens, expected):
    monkeypatch.setenv(HOST_KV_BUDGET_ENV, str(budget))
    config = KvCacheConfig(max_tokens=max_tokens, free_gpu_memory_fraction=fraction)
    assert num_kv_blocks(engine, config, max_num_sequences=8, device=CPU) == expected


@pytest.mark.parametrize("config, field", [
    (KvCacheConfig(free_gpu_memory_fraction=0.0), "free_gpu_memory_fraction"),
    (KvCacheConfig(free_gpu_memory_fraction=1.5), "free_gpu_memory_fraction"),
    (KvCacheConfig(free_gpu_memory_fraction="0.5"), "free_gpu_memory_fraction"),
    (KvCacheConfig(max_tokens=0), "max_tokens"),
    (KvCacheConfig(max_tokens=3.5), "max_tokens"),
])
def test_bad_sizes_are_refused(engine, monkeypatch, config, field):
    monkeypatch.setenv(HOST_KV_BUDGET_ENV, str(1 << 20))
    with pytest.raises(ValueError, match=field):
        num_kv_blocks(engine, config, 8, CPU)


def test_a_budget_without_room_for_one_block_is_refused(engine, monkeypatch):
    monkeypatch.setenv(HOST_KV_BUDGET_ENV, "1000")
    with pytest.raises(ValueError, match="no room for a single block"):
        num_kv_blocks(engine, KvCacheConfig(), 8, CPU)


@pytest.mark.parametrize("value", ["abc", "0", "-5"])
def test_bad_host_budget_variable_is_refused(monkeypatch, value):
    monkeypatch.setenv(HOST_KV_BUDGET_ENV, value)
    with pytest.raises(ValueError, match=HOST_KV_BUDGET_ENV):
        host_budget_bytes()


def test_default_host_budget_is_bounded(monkeypatch):
    monkeypatch.delenv(HOST_KV_BUDGET_ENV, raising=False)
    assert 0 < host_budget_bytes() <= 4 << 30


def test_stats_report_the_pool_size(tiny_engine, prompts, monkeypatch):
    monkeypatch.setenv(HOST_KV_BUDGET_ENV, str(200 << 10))
    client = Client([make_request(0, prompts[0])])
    params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=200, free_gpu_memory_fraction=0.3))
    with GptManager(tiny_engine[0], TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *client.callbacks(), optional_params=params) as manager:
        client.wait()
    stats = json.loads(client.stats[0])
    assert stats["Max KV cache blocks"] == manager.kv_cache_manager.num_blocks == min(50, math.floor(0.3 * 200 / 2)) == 30
    assert stats["Tokens per KV cache block"] == 4
    assert stats["Free KV cache blocks"] + stats["Used KV cache blocks"] == 30
    assert manager.model_executor.runner.kv_pool.shape[2] == 30
