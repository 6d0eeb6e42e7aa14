"""GptManager over an int8 KV cache: the pool holds ~4x the blocks of a float32 one at the same
budget (and the stats say so); greedy and beam outputs equal GptSession's with the same cache,
with block reuse and chunked context too."""
from __future__ import annotations

import json

import pytest
import torch

from batch_manager import GptManager, KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType
from batch_manager import tensor_names
from batch_manager.scheduling.kv_sizing import HOST_KV_BUDGET_ENV, num_kv_blocks
from runtime import Engine, build_engine
from tests.batch_manager.conftest import Client, make_request
from tests.batch_manager.test_decoding import beam_outputs, session_beams

SYSTEM_PROMPT = [(5 * i + 7) % 120 + 3 for i in range(12)]   # 3 blocks of 4 tokens, shared
NUM_NEW = 8


@pytest.fixture(scope="module")
def int8_engine_dir(tiny_engine, tmp_path_factory):
    directory = tmp_path_factory.mktemp("int8") / "engine"
    build_engine(tiny_engine[0], directory, kv_cache_dtype="int8")
    return str(directory)


def test_an_int8_pool_holds_the_blocks_its_bytes_allow(tiny_engine, int8_engine_dir, monkeypatch):
    monkeypatch.setenv(HOST_KV_BUDGET_ENV, str(200 << 10))
    fp32, int8 = Engine.from_dir(tiny_engine[0]), Engine.from_dir(int8_engine_dir)
    cfg = int8.model_config
    config = KvCacheConfig(free_gpu_memory_fraction=0.5)
    blocks = {name: num_kv_blocks(e, config, 1000, torch.device("cpu")) for name, e in (("fp32", fp32), ("int8", int8))}
    # head_dim 16: 64 bytes per fp32 row, 16 + 4 (its scale) per int8 row: 3.2x (3.76x at head_dim 64)
    assert blocks == {"fp32": (100 << 10) // (cfg.num_layers * 2 * 4 * cfg.num_kv_heads * 64),
                      "int8": (100 << 10) // (cfg.num_layers * 2 * 4 * cfg.num_kv_heads * 20)}
    client = Client([make_request(0, [5, 6, 7], max_new_tokens=2)])
    params = TrtGptModelOptionalParams(kv_cache_config=config)
    with GptManager(int8_engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *client.callbacks(), optional_params=params) as manager:
        client.wait()
    assert manager.kv_cache_manager.num_blocks == blocks["int8"]
    assert json.loads(client.stats[-1])["Max KV cache blocks"] == blocks["int8"]


def greedy_through_the_manager(engine_dir, prompts, params) -> dict[int, list[int]]:
    client = Client([make_request(i, p, max_new_tokens=NUM_NEW) for i, p in prompts.items()],
                    [0, 0, 1, 2, 2, 4][:len(prompts)])
    with GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *client.callbacks(), optional_params=params) as manager:
        client.wait()
    kv = manager.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    out = {}
    for i, p in prompts.items():
        tensors, _, err = client.final(i)
        assert err == ""
        out[i] = tensors[tensor_names.OUTPUT_IDS][0, 0, len(p):len(p) + NUM_NEW].tolist()
    return out


@pytest.mark.parametrize("reuse, chunked", [(False, False), (True, False), (True, True)])
def test_greedy_with_int8_cache_equals_gpt_session(int8_engine_dir, prompts, reuse, chunked):
    chosen = {i: SYSTEM_PROMPT + prompts[i][:10] if i % 2 else prompts[i] for i in range(6)}
    extra = dict(enable_chunked_context=True, max_num_tokens=8) if chunked else {}
    params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=400, enable_block_reuse=reuse),
                                       **extra)
    got = greedy_through_the_manager(int8_engine_dir, chosen, params)
    for i, p in chosen.items():
        expected, _ = session_beams(int8_engine_dir, p, 1, NUM_NEW)
        assert got[i] == expected[0], f"request {i}"


def test_beams_with_int8_cache_equal_gpt_session(int8_engine_dir, prompts):
    """Beam search copies blocks (values and scales) when beams fork."""
    widths = {3: 2, 4: 3}
    requests = [make_request(i, prompts[i], max_new_tokens=NUM_NEW, beam_width=torch.tensor([k], dtype=torch.int32))
                for i, k in widths.items()]
    client = Client(requests)
    params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=400))
    with GptManager(int8_engine_dir, TrtGptModelType.InflightFusedBatching, 4, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *client.callbacks(), optional_params=params):
        client.wait()
    for i, k in widths.items():
        tensors, _, err = client.final(i)
        assert err == ""
        expected, _ = session_beams(int8_engine_dir, prompts[i], k, NUM_NEW)
        assert beam_outputs(tensors, len(prompts[i])) == expected, f"request {i}"
