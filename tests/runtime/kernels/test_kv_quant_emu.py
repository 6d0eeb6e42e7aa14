"""The int8 KV cache on emu: the quantizing cache write equals the torch reference bit for bit,
block copies move int8 values and their scales, decode attention over int8 blocks equals the
reference, and a GptManager run with an int8 cache yields the torch backend's tokens. With a GPU
(skipped otherwise) the cuda backend's write and decode equal the reference too."""
from __future__ import annotations

import random

import pytest
import torch

from batch_manager import GptManager, KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType
from runtime import build_engine
from runtime.kernels.torch_kernels import torch_attention
from runtime.kernels.cuda.cuda_backend import CudaKernels, cuda_available
from tests.batch_manager.conftest import Client, make_request
from tests.factories import make_checkpoint

from .conftest import paged_case, tolerance


def int8_cache(num_blocks=6, tokens_per_block=4, num_kv_heads=2, head_dim=8):
    shape = (num_blocks, tokens_per_block, num_kv_heads, head_dim)
    return ([torch.zeros(shape, dtype=torch.int8) for _ in range(2)],
            [torch.zeros(shape[:3], dtype=torch.float32) for _ in range(2)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizing_write_equals_reference_bit_for_bit(emu, dtype):
    gen = torch.Generator().manual_seed(3)
    num_tokens = 9
    qkv = (torch.randn(num_tokens, 4 * 8, generator=gen) * 3).to(dtype)
    qkv[2, 8:16] = 0   # an all-zero K row: scale 0, values 0
    k, v = qkv[:, 8:24].view(num_tokens, 2, 8), qkv[:, 16:32].view(num_tokens, 2, 8)   # strided views
    slots = torch.randperm(24, generator=gen)[:num_tokens]
    slots[4] = -1   # skipped
    (caches, scales), (expected_caches, expected_scales) = int8_cache(), int8_cache()
    emu.write_kv(*caches, k, v, slots, *scales)
    keep = slots >= 0
    torch_attention.write_kv(*expected_caches, k[keep], v[keep], slots[keep], *expected_scales)
    for got, expected in zip(caches + scales, expected_caches + expected_scales):
        assert torch.equal(got, expected)


def test_copy_blocks_moves_int8_values_and_scales(emu, reference):
    gen = torch.Generator().manual_seed(4)
    pool = torch.randint(-127, 128, (2, 2, 6, 4, 2, 8), generator=gen, dtype=torch.int8)
    scales = torch.rand(2, 2, 6, 4, 2, generator=gen)
    src, dst = torch.tensor([0, 3]), torch.tensor([5, 1])
    for t in (pool, scales):
        expected = t.clone()
        reference.copy_blocks(expected, src, dst)
        emu.copy_blocks(t, src, dst)
        assert torch.equal(t, expected)


@pytest.mark.parametrize("seq_lens, heads, window, sink", [
    ([1, 7, 40], (4, 2), None, 0),      # GQA; 40 keys: several partitions and tiles on emu's config
    ([13, 30], (2, 2), 9, 2),           # window and sink tokens
])
def test_int8_decode_attention_equals_reference(emu, seq_lens, heads, window, sink):
    num_heads, num_kv_heads = heads
    q, (k_plain, v_plain), _, tables, lens = paged_case(seq_lens, num_heads, num_kv_heads, 16, 4, torch.float32,
                                                        window, sink, release=False)
    caches = [torch.zeros(k_plain.shape, dtype=torch.int8) for _ in range(2)]
    scales = [torch.zeros(k_plain.shape[:3]) for _ in range(2)]
    slots = torch.arange(k_plain.shape[0] * k_plain.shape[1])
    torch_attention.write_kv(*caches, k_plain.flatten(0, 1), v_plain.flatten(0, 1), slots, *scales)
    expected = torch_attention.decode_attention(q, *caches, tables, lens, 0.25, window, sink, None, *scales)
    got = emu.decode_attention(q, *caches, tables, lens, 0.25, window, sink, None, *scales)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)


@pytest.fixture(scope="module")
def int8_engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("manager_emu_int8")
    make_checkpoint(root / "hf", "llama")
    build_engine(root / "hf", root / "engine", tokens_per_block=4, max_batch_size=4, max_input_len=24,
                 max_seq_len=40, max_num_tokens=64, kv_cache_dtype="int8")
    return str(root / "engine")


def run_manager(engine_dir: str, backend: str, prompts: dict[int, list[int]]) -> dict[int, list[int]]:
    client = Client([make_request(i, p, max_new_tokens=6) for i, p in prompts.items()], [0, 0, 1, 3])
    params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=96), kernel_backend=backend)
    with GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.MAX_UTILIZATION,
                    *client.callbacks(), optional_params=params) as manager:
        assert manager.model_executor.runner.kv_pool.dtype == torch.int8
        client.wait(120)
    return dict(zip(prompts, client.final_output_ids(prompts)))


def test_gpt_manager_with_an_int8_cache_equals_torch(int8_engine_dir):
    rng = random.Random(6)
    prompts = {i: [rng.randrange(3, 128) for _ in range(rng.randrange(1, 16))] for i in range(4)}
    assert run_manager(int8_engine_dir, "emu", prompts) == run_manager(int8_engine_dir, "torch", prompts)


gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device and CuPy")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_int8_cache_write_and_decode_equal_reference(dtype):
    kernels, device = CudaKernels(), torch.device("cuda")
    q, (k_plain, v_plain), _, tables, lens = paged_case([5, 37, 130], 4, 2, 64, 16, torch.float32, release=False)
    rows = torch.cat([k_plain.flatten(0, 1), v_plain.flatten(0, 1)], 1).to(device, dtype)   # [slots, 4, 64]
    slots = torch.arange(rows.shape[0], device=device)
    results = []
    for backend in (kernels, torch_attention):
        caches = [torch.zeros(k_plain.shape, dtype=torch.int8, device=device) for _ in range(2)]
        scales = [torch.zeros(k_plain.shape[:3], device=device) for _ in range(2)]
        backend.write_kv(*caches, rows[:, :2], rows[:, 2:], slots, *scales)
        out = backend.decode_attention(q.to(device, dtype), *caches, tables.to(device), lens.to(device), 0.125,
                                       None, 0, None, *scales)
        results.append((caches, scales, out))
    (got_caches, got_scales, got), (want_caches, want_scales, want) = results
    for a, b in zip(got_caches + got_scales, want_caches + want_scales):
        assert torch.equal(a, b)
    torch.testing.assert_close(got.float(), want.float(), **tolerance(dtype))
