"""The native causal attention of a context step (runtime/kernels/cpu/attention_dense.h) against
torch_attention.dense_attention: query tiles of 8 tokens (1, 3, 8, 13, 17 and 100 tokens), register
tiles of 6 rows (groups 1, 3, 4, 6 give every remainder), head sizes 16-128, a prompt alone and a
chunk after cached keys, queries and values as strided views of a fused qkv row; the same bits at
any thread count; CpuAttention's routing (window, ALiBi, other head sizes and dtypes stay on SDPA)."""
from __future__ import annotations

import pytest
import torch

from runtime.kernels.cpu import cpu_native
from runtime.kernels.torch_kernels import torch_attention
from runtime.kernels.torch_kernels.cpu_attention import CpuAttention

OPS = cpu_native.native_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="native CPU kernels cannot run here")
# float32 softmax-weighted sums of values ~N(0, 1), summed in another order than SDPA's (and the
# scale folded into the queries): observed <= 1.5e-6
ATOL, RTOL = 5e-6, 1e-5


def problem(n: int, past: int, heads: int, kv_heads: int, head_dim: int, seed: int):
    """(q, k, v): q [n, H, D] and the chunk's v views into a fused qkv row; k, v [past + n, kvH, D]."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, heads + 2 * kv_heads, head_dim, generator=gen)
    k = torch.randn(past + n, kv_heads, head_dim, generator=gen)
    v = torch.randn(past + n, kv_heads, head_dim, generator=gen)
    k[past:] = qkv[:, heads:heads + kv_heads]
    if past == 0:   # a fresh prompt: values straight from the qkv row, as the model passes them
        return qkv[:, :heads], k, qkv[:, heads + kv_heads:]
    v[past:] = qkv[:, heads + kv_heads:]
    return qkv[:, :heads], k, v


@pytest.mark.parametrize("n", [1, 3, 8, 13, 17, 100])
@pytest.mark.parametrize("past", [0, 5, 40])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2), (6, 1)])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_matches_the_reference(n, past, heads, kv_heads, head_dim):
    q, k, v = problem(n, past, heads, kv_heads, head_dim, seed=n * 1000 + past * 10 + heads)
    scale = head_dim ** -0.5
    ref = torch_attention.dense_attention(q, k, v, past, scale, None)
    torch.testing.assert_close(OPS.dense_attention(q, k, v, scale), ref, atol=ATOL, rtol=RTOL)


def test_same_bits_at_any_thread_count():
    q, k, v = problem(100, 7, 9, 3, 64, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = OPS.dense_attention(q, k, v, 0.125)
        for num_threads in (2, 3):
            torch.set_num_threads(num_threads)
            assert torch.equal(OPS.dense_attention(q, k, v, 0.125), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("case", ["native", "window", "alibi", "head_dim_40", "bfloat16"])
def test_cpu_attention_routes_what_the_kernel_covers(monkeypatch, case):
    """Native where it applies; SDPA (the reference itself) for a window, ALiBi, a head size off the
    16-column tiles, other dtypes: each result equals the reference's."""
    head_dim = 40 if case == "head_dim_40" else 64
    q, k, v = problem(17, 5, 9, 3, head_dim, seed=11)
    if case == "bfloat16":
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    window = 6 if case == "window" else None
    slopes = torch.linspace(0.1, 0.9, 9) if case == "alibi" else None
    calls = []
    native = CpuAttention(use_native=True)
    monkeypatch.setattr(native.native, "dense_attention",
                        lambda *args: calls.append(1) or cpu_native.NativeCpuOps.dense_attention(OPS, *args))
    out = native.dense_attention(q, k, v, 5, 0.125, window, 0, slopes)
    ref = torch_attention.dense_attention(q, k, v, 5, 0.125, window, 0, slopes)
    assert calls == ([1] if case == "native" else [])
    if case == "native":
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    else:
        assert torch.equal(out, ref)
