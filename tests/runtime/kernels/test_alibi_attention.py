"""ALiBi in every attention kernel: the slopes equal BLOOM's; the torch reference (dense, context over
cached blocks, paged decode) and the CPU fast paths equal an explicit float64 computation; the paged
decode kernel of cuda_src/paged_attention.cu on emu (and on a GPU, where one is present) equals the
torch reference, with windows, sinks, GQA / MQA, 16-bit storage and several partitions."""
from __future__ import annotations

import math

import pytest
import torch

from runtime.models.alibi import alibi_slopes
from runtime.kernels import TorchKernels
from runtime.kernels.torch_kernels import torch_attention
from runtime.kernels.cuda.cuda_backend import cuda_available
from runtime.kernels.cuda.emu_backend import EmuKernels
from runtime.kernels.cuda.launchers import LaunchConfig
from tests.runtime.kernels.conftest import paged_case, tolerance, visible

WINDOWS = [(None, 0), (5, 0), (9, 2), (13, 4)]


@pytest.mark.parametrize("num_heads", [*range(1, 34), 48, 64, 71, 112])
def test_slopes_equal_bloom_for_powers_of_two_and_not(num_heads):
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    assert torch.equal(alibi_slopes(num_heads), _get_alibi_slopes(num_heads, torch.device("cpu")))


def test_slopes_refuse_a_bad_head_count():
    with pytest.raises(ValueError, match="num_heads: must be a positive integer, got 0"):
        alibi_slopes(0)


def explicit_attention(q, k, v, query_pos, scale, window, sink, slopes):
    """float64 loops: q [n, H, D] at positions query_pos, k, v [L, kvH, D] at positions 0 .. L - 1."""
    n, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(n):
        keys = [p for p in range(k.shape[0]) if visible(p, query_pos[i] + 1, window, sink)]
        for h in range(num_heads):
            kh, vh = k[keys, h // group].double(), v[keys, h // group].double()
            bias = torch.tensor([float(slopes[h]) * (p - query_pos[i]) for p in keys], dtype=torch.float64)
            weights = torch.softmax(scale * (kh @ q[i, h].double()) + bias, dim=0)
            out[i, h] = weights @ vh
    return out


def paged(k: torch.Tensor, v: torch.Tensor, tokens_per_block: int, seed: int):
    """k, v [L, kvH, D] -> caches [num_blocks, tpb, kvH, D] and a shuffled block table int32 [nb + 1]."""
    num_blocks = -(-k.shape[0] // tokens_per_block)
    ids = torch.randperm(num_blocks + 3, generator=torch.Generator().manual_seed(seed))[:num_blocks]
    caches = [torch.zeros(num_blocks + 3, tokens_per_block, *k.shape[1:]) for _ in range(2)]
    slots = ids.repeat_interleave(tokens_per_block)[:k.shape[0]] * tokens_per_block + \
        torch.arange(k.shape[0]) % tokens_per_block
    torch_attention.write_kv(caches[0], caches[1], k, v, slots)
    return caches, torch.cat([ids, torch.tensor([-1])]).to(torch.int32)


@pytest.mark.parametrize("window,sink", WINDOWS)
@pytest.mark.parametrize("past_len", [0, 7])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 2), (4, 4), (8, 1)])
def test_dense_and_context_attention_equal_the_explicit_sum(num_heads, num_kv_heads, past_len, window, sink):
    gen = torch.Generator().manual_seed(num_heads + past_len)
    n, head_dim = 9, 8
    total = past_len + n
    q = torch.randn(n, num_heads, head_dim, generator=gen)
    k, v = torch.randn(2, total, num_kv_heads, head_dim, generator=gen)
    slopes, scale = alibi_slopes(num_heads), 1 / math.sqrt(head_dim)
    expected = explicit_attention(q, k, v, list(range(past_len, total)), scale, window, sink, slopes)
    dense = torch_attention.dense_attention(q, k, v, past_len, scale, window, sink, slopes)
    torch.testing.assert_close(dense.double(), expected, atol=1e-5, rtol=1e-5)
    (k_cache, v_cache), table = paged(k, v, tokens_per_block=4, seed=past_len)
    for backend in (TorchKernels(), TorchKernels(fast_paths=True)):
        got = backend.context_attention(q, k_cache, v_cache, table, past_len, scale, window, sink, slopes)
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    # The bias must matter here, or the comparison could not fail.
    plain = torch_attention.dense_attention(q, k, v, past_len, scale, window, sink)
    assert (plain - dense).abs().max() > 1e-2


@pytest.mark.parametrize("window,sink", WINDOWS)
def test_decode_reference_and_fast_paths_equal_the_explicit_sum(window, sink):
    seq_lens = [1, 4, 9, 30, 75, 76]  # block counts far apart: the fast path splits them into groups
    num_heads, num_kv_heads, head_dim = 6, 2, 8
    q, (k_cache, v_cache), _, table, lens = paged_case(seq_lens, num_heads, num_kv_heads, head_dim, 4,
                                                       torch.float32, window, sink)
    slopes, scale = alibi_slopes(num_heads), 1 / math.sqrt(head_dim)
    reference = TorchKernels().decode_attention(q, k_cache, v_cache, table, lens, scale, window, sink, slopes)
    fast_kernels = TorchKernels(fast_paths=True)
    for _ in range(2):  # the second call reuses the step's plan
        fast = fast_kernels.decode_attention(q, k_cache, v_cache, table, lens, scale, window, sink, slopes)
        torch.testing.assert_close(fast, reference, atol=1e-6, rtol=1e-5)
    # Another slope set must not reuse the plan built for the first.
    other = fast_kernels.decode_attention(q, k_cache, v_cache, table, lens, scale, window, sink, slopes * 2)
    torch.testing.assert_close(other, TorchKernels().decode_attention(q, k_cache, v_cache, table, lens, scale,
                                                                      window, sink, slopes * 2), atol=1e-6, rtol=1e-5)
    for row, n in enumerate(seq_lens):
        k = torch_attention.gather_kv(k_cache, table[row:row + 1], n)[0]
        v = torch_attention.gather_kv(v_cache, table[row:row + 1], n)[0]
        expected = explicit_attention(q[row:row + 1], k, v, [n - 1], scale, window, sink, slopes)
        torch.testing.assert_close(reference[row:row + 1].double(), expected, atol=1e-5, rtol=1e-5)


def check_emu(kernels, seq_lens, num_heads, num_kv_heads, dtype, window, sink, head_dim=16, seed=0):
    q, clean, poisoned, table, lens = paged_case(seq_lens, num_heads, num_kv_heads, head_dim, 4, dtype, window, sink,
                                                 seed=seed)
    slopes, scale = alibi_slopes(num_heads), 1 / math.sqrt(head_dim)
    expected = TorchKernels().decode_attention(q, *clean, table, lens, scale, window, sink, slopes)
    got = kernels.decode_attention(q, *poisoned, table, lens, scale, window, sink, slopes)
    assert got.dtype == dtype and not got.isnan().any(), "read a slot no query may see"
    torch.testing.assert_close(got.float(), expected.float(), **tolerance(dtype))
    without = TorchKernels().decode_attention(q, *clean, table, lens, scale, window, sink)
    assert (without.float() - expected.float()).abs().max() > 1e-2  # the bias matters


@pytest.mark.parametrize("window,sink", WINDOWS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_emu_decode_equals_torch(emu, num_heads, num_kv_heads, window, sink):
    check_emu(emu, [1, 8, 9, 10, 30, 75], num_heads, num_kv_heads, torch.float32, window, sink)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_emu_decode_equals_torch_in_16_bit_storage(emu, dtype):
    check_emu(emu, [3, 40, 70], 6, 2, dtype, 13, 4, seed=1)


def test_emu_refuses_slopes_that_are_not_one_per_query_head(emu):
    q, clean, _, table, lens = paged_case([5], 4, 2, 16, 4, torch.float32)
    with pytest.raises(ValueError, match=r"alibi_slopes: expected one slope per query head, shape \[4\], got \[2\]"):
        emu.decode_attention(q, *clean, table, lens, 0.25, None, 0, alibi_slopes(2))
    # float64 slopes are converted, not refused
    torch.testing.assert_close(emu.decode_attention(q, *clean, table, lens, 0.25, None, 0, alibi_slopes(4).double()),
                               TorchKernels().decode_attention(q, *clean, table, lens, 0.25, None, 0, alibi_slopes(4)))


@pytest.mark.parametrize("window,sink", [(None, 0), (20, 3)])
def test_emu_partitions_merge_with_the_bias(window, sink):
    """Many partitions and tiles per sequence: each partition's maximum includes the bias."""
    kernels = EmuKernels(LaunchConfig(attention_threads=64, threads_per_key=4, partition_size=8, tile_size=3,
                                      max_partitions=64, copy_threads=32))
    check_emu(kernels, [5, 33, 90], 4, 2, torch.float32, window, sink, seed=2)


@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device and CuPy")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window,sink", [(None, 0), (37, 4)])
def test_cuda_decode_equals_torch_on_the_device(dtype, window, sink):
    from runtime.kernels.cuda.cuda_backend import CudaKernels
    q, clean, poisoned, table, lens = paged_case([1, 16, 17, 700, 1500], 12, 4, 64, 16, dtype, window, sink)
    slopes, scale = alibi_slopes(12), 1 / math.sqrt(64)
    expected = TorchKernels().decode_attention(q.float(), *(c.float() for c in clean), table, lens, scale, window,
                                               sink, slopes)
    got = CudaKernels().decode_attention(q.cuda(), *(p.cuda() for p in poisoned), table.cuda(), lens.cuda(), scale,
                                         window, sink, slopes.cuda())
    torch.testing.assert_close(got.cpu().float(), expected, **tolerance(dtype))
