"""KV writes through the slot mapping and block copies on emu equal the torch reference, bit for bit."""
from __future__ import annotations

import pytest
import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_cache(num_blocks=12, tokens_per_block=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, tokens_per_block, num_kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 4, 5, 17, 48])
def test_write_kv_equals_reference(emu, reference, dtype, num_tokens):
    k_cache, v_cache = random_cache(dtype=dtype, seed=num_tokens)
    gen = torch.Generator().manual_seed(100 + num_tokens)
    slots = torch.randperm(k_cache.shape[0] * k_cache.shape[1], generator=gen)[:num_tokens]
    k = torch.randn(num_tokens, 2, 8, generator=gen).to(dtype)
    v = torch.randn(num_tokens, 2, 8, generator=gen).to(dtype)
    expected = (k_cache.clone(), v_cache.clone())
    reference.write_kv(*expected, k, v, slots)
    emu.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])


def test_write_kv_from_a_fused_qkv_view(emu, reference):
    """K and V as strided views of one [T, q + 2 kv] projection (the GPT-2 path) are read in place."""
    num_tokens, num_heads, num_kv_heads, head_dim = 6, 4, 2, 8
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    _, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    k, v = k.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim)
    assert not k.is_contiguous()
    k_cache, v_cache = random_cache()
    expected = (k_cache.clone(), v_cache.clone())
    slots = torch.tensor([3, 4, 5, 6, 40, 41])
    reference.write_kv(*expected, k, v, slots)
    emu.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])


def test_write_kv_converts_to_the_cache_dtype(emu, reference):
    k_cache, v_cache = random_cache(dtype=torch.float16)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    expected = (k_cache.clone(), v_cache.clone())
    slots = torch.tensor([0, 9, 47])
    reference.write_kv(*expected, k, v, slots)
    emu.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])


def test_write_kv_skips_negative_slots_and_empty_steps(emu):
    k_cache, v_cache = random_cache()
    before = (k_cache.clone(), v_cache.clone())
    k = torch.randn(2, 2, 8)
    emu.write_kv(k_cache, v_cache, k, k, torch.tensor([-1, 5]))
    assert torch.equal(k_cache.view(-1, 2, 8)[5], k[1])
    k_cache.view(-1, 2, 8)[5] = before[0].view(-1, 2, 8)[5]
    v_cache.view(-1, 2, 8)[5] = before[1].view(-1, 2, 8)[5]
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    emu.write_kv(k_cache, v_cache, k[:0], k[:0], torch.zeros(0, dtype=torch.int64))
    assert torch.equal(k_cache, before[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pairs", [[(0, 1)], [(3, 7), (3, 8), (11, 0)], [(i, 12 + i) for i in range(12)]])
def test_copy_blocks_equals_reference(emu, reference, dtype, pairs):
    gen = torch.Generator().manual_seed(len(pairs))
    pool = torch.randn(3, 2, 24, 4, 2, 8, generator=gen).to(dtype)  # [layers, K/V, blocks, tpb, kvH, D]
    src = torch.tensor([s for s, _ in pairs])
    dst = torch.tensor([d for _, d in pairs])
    expected = pool.clone()
    reference.copy_blocks(expected, src, dst)
    emu.copy_blocks(pool, src, dst)
    assert torch.equal(pool, expected)


def test_copy_blocks_with_no_pairs_and_int32_ids(emu, reference):
    pool = torch.randn(1, 2, 6, 4, 1, 4)
    before = pool.clone()
    emu.copy_blocks(pool, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert torch.equal(pool, before)
    emu.copy_blocks(pool, torch.tensor([1], dtype=torch.int32), torch.tensor([4], dtype=torch.int32))
    reference.copy_blocks(before, torch.tensor([1]), torch.tensor([4]))
    assert torch.equal(pool, before)
