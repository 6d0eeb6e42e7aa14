"""The native CPU kernels (cpu_native.py) against their torch definitions: small-row linear
(F.linear), RMSNorm (F.rms_norm), paged decode attention (torch_attention.decode_attention); the
routing of runtime.kernels.torch_kernels.linear and the torch backend to them; a whole model with and without them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import runtime.kernels.torch_kernels.linear as linear_module
from runtime import Engine, ModelRunner
from runtime.kernels.cpu import cpu_native
from runtime.kernels import get_kernels
from runtime.kernels.torch_kernels import torch_attention
from runtime.kernels.torch_kernels.linear import NATIVE_MAX_ROWS, Linear
from tests.factories import make_checkpoint

pytestmark = pytest.mark.skipif(cpu_native.native_ops() is None, reason="native CPU kernels cannot run here")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ops() -> cpu_native.NativeCpuOps:
    return cpu_native.native_ops()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 13])
@pytest.mark.parametrize("n,k", [(48, 40), (53, 37), (7, 3), (768, 512)])
def test_linear_equals_f_linear(ops, rows, n, k):
    """Every tile shape (rows % 4, outputs % tile) and a k that is no multiple of 8."""
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    torch.testing.assert_close(ops.linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ops.linear(x, w, None), F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_linear_accumulates_into_strided_rows(ops):
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(6, 40, generator=gen), torch.randn(24, 40, generator=gen)
    wide = torch.randn(6, 50, generator=gen)
    out, before = wide[:, 3:27], wide.clone()  # row stride 50
    ops.linear(x[:, :], w, None, out=out)
    torch.testing.assert_close(wide[:, 3:27], before[:, 3:27] + F.linear(x, w), atol=1e-4, rtol=1e-5)
    assert torch.equal(wide[:, :3], before[:, :3]) and torch.equal(wide[:, 27:], before[:, 27:])


def test_rms_norm_equals_f_rms_norm(ops):
    gen = torch.Generator().manual_seed(2)
    for rows, h in ((1, 512), (5, 37), (300, 256)):   # 300 x 256 takes the threaded branch
        x, w = torch.randn(rows, h + 3, generator=gen)[:, :h], torch.randn(h, generator=gen)
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (h,), w, 1e-5), atol=1e-5, rtol=1e-5)


def test_silu_mul_equals_the_gated_mlp_hidden(ops):
    gen = torch.Generator().manual_seed(6)
    for rows, n in ((1, 1536), (3, 37), (70, 1024)):   # 70 x 1024 takes the threaded branch
        x = torch.randn(rows, 2 * n + 5, generator=gen)[:, :2 * n] * 4
        gate, up = x.chunk(2, dim=-1)
        torch.testing.assert_close(ops.silu_mul(x), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("window,sink", [(None, 0), (10, 0), (10, 4), (1, 0)])
def test_decode_attention_equals_the_reference(ops, num_heads, num_kv_heads, window, sink):
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    num_blocks, tpb, head_dim = 24, 16, 32
    k_cache = torch.randn(num_blocks, tpb, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, tpb, num_kv_heads, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[:20].view(4, 5).int()
    seq_lens = torch.tensor([1, 37, 64, 80])
    if window is not None:  # blocks wholly outside every window and the sinks: released
        tables[3, 1:3] = -1
    q = torch.randn(4, num_heads, head_dim, generator=gen)
    want = torch_attention.decode_attention(q, k_cache, v_cache, tables.clamp(min=0), seq_lens, 0.2, window, sink)
    got = ops.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.2, window, sink)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
@pytest.mark.parametrize("window,sink", [(None, 0), (200, 5)])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 40), (2, 36), (8, 128)])
def test_decode_attention_over_key_chunks_is_the_same_on_any_thread_count(ops, kv_dtype, window, sink, num_kv_heads,
                                                                          head_dim):
    """Sequences from 1 to 1000 keys: 1 to 8 chunks (attention.h's chunk_keys), windows crossing
    their edges, a head_dim with columns past the last multiple of 8; 8 KV heads of 128 make a
    chunk's V rows too large to read with its K rows (kMaxEarlyValueBytes: float32 from 600 keys).
    Against the reference, and bit for bit the same on 1, 2 and 3 threads (the chunks depend on the
    number of keys only; ChunkPlan::thread_tasks splits them)."""
    from runtime.kernels import kv_quant
    gen = torch.Generator().manual_seed(11)
    num_blocks, tpb, num_heads = 140, 8, 3 * num_kv_heads
    k_cache = torch.randn(num_blocks, tpb, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, tpb, num_kv_heads, head_dim, generator=gen)
    seq_lens = torch.tensor([1, 15, 16, 17, 129, 250, 1000, 600])
    tables = torch.randperm(num_blocks, generator=gen).repeat(8)[:8 * 125].view(8, 125).int()
    q = torch.randn(8, num_heads, head_dim, generator=gen)
    if kv_dtype == "int8":
        kq, ks = kv_quant.quantize_rows(k_cache, torch.int8)
        vq, vs = kv_quant.quantize_rows(v_cache, torch.int8)
        k_ref, v_ref = kv_quant.dequantize(kq, ks), kv_quant.dequantize(vq, vs)

        def attend():
            return ops.decode_attention_int8(q, kq, vq, ks, vs, tables, seq_lens, 0.15, window, sink)
    else:
        k_ref, v_ref = k_cache, v_cache

        def attend():
            return ops.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.15, window, sink)
    want = torch_attention.decode_attention(q, k_ref, v_ref, tables, seq_lens, 0.15, window, sink)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(attend())
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(outs[0], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_the_default_torch_backend_attends_natively_and_equally():
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(8, 4, 2, 16, generator=gen), torch.randn(8, 4, 2, 16, generator=gen)
    tables, seq_lens = torch.tensor([[3, 1, 4], [0, 2, 5]], dtype=torch.int32), torch.tensor([9, 5])
    q = torch.randn(2, 4, 16, generator=gen)
    backend = get_kernels("torch")
    assert backend.cpu_attention.native is not None
    torch.testing.assert_close(backend.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25, None),
                               torch_attention.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25, None))
    assert "decode_plan" not in backend.cpu_attention.thread_state()  # the native kernel answered


def test_linear_routes_small_row_counts_to_the_native_kernel(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(24, 40, generator=gen), torch.randn(24, generator=gen)
    linear = Linear(weight, bias, CPU)
    calls = []
    native_linear = linear.native.linear
    monkeypatch.setattr(linear.native, "linear", lambda x, *a, **kw: calls.append(x.shape[0]) or native_linear(x, *a, **kw))
    x = torch.randn(2 * NATIVE_MAX_ROWS, 40, generator=gen)
    for rows in range(1, 2 * NATIVE_MAX_ROWS + 1):
        torch.testing.assert_close(linear(x[:rows]), F.linear(x[:rows], weight, bias), atol=1e-4, rtol=1e-5)
    assert calls == list(range(1, NATIVE_MAX_ROWS + 1))
    column_major = x[:5].t().contiguous().t()  # w_xt outputs are such views
    torch.testing.assert_close(linear(column_major), F.linear(x[:5], weight, bias), atol=1e-4, rtol=1e-5)
    residual = torch.randn(3, 24, generator=gen)
    expected = residual + F.linear(x[:3], weight, bias)
    torch.testing.assert_close(linear.add_to(x[:3], residual), expected, atol=1e-4, rtol=1e-5)
    many = torch.randn(NATIVE_MAX_ROWS + 1, 24, generator=gen)
    torch.testing.assert_close(linear.add_to(x[:NATIVE_MAX_ROWS + 1], many.clone()),
                               many + F.linear(x[:NATIVE_MAX_ROWS + 1], weight, bias), atol=1e-4, rtol=1e-5)


def test_the_switch_turns_the_native_kernels_off(monkeypatch):
    monkeypatch.setenv(cpu_native.ENV_VAR, "0")
    assert cpu_native.native_ops() is None
    assert Linear(torch.ones(4, 4), None, CPU).native is None
    assert get_kernels("torch").cpu_attention.native is None
    assert Linear(torch.ones(4, 4, dtype=torch.bfloat16), None, CPU).native is None
    monkeypatch.delenv(cpu_native.ENV_VAR)
    assert Linear(torch.ones(4, 4, dtype=torch.bfloat16), None, CPU).native is None  # float32 only
    assert linear_module.native_ops() is not None


def test_a_model_step_equals_itself_without_the_native_kernels(tmp_path, monkeypatch):
    """Context, then generation at batch 1 and 3 (native linear, norm and attention) against the
    same model built with the switch off."""
    make_checkpoint(tmp_path, "llama")
    engine = Engine.from_dir(tmp_path, tokens_per_block=4)
    native = ModelRunner(engine, num_blocks=16)
    monkeypatch.setenv(cpu_native.ENV_VAR, "0")
    plain = ModelRunner(engine, num_blocks=16)
    assert native.kernels.native_dense_ops() and plain.kernels.native_dense_ops() == {}
    gen = torch.Generator().manual_seed(5)
    vocab = engine.model_config.vocab_size
    tables = torch.arange(15, dtype=torch.int32).view(3, 5)
    prompt = torch.randint(0, vocab, (3 * 6,), generator=gen, dtype=torch.int32)
    steps = [dict(input_ids=prompt, input_lengths=torch.full((3,), 6, dtype=torch.int32),
                  past_lengths=torch.zeros(3, dtype=torch.int32), block_tables=tables)]
    for past in (6, 7):
        steps.append(dict(input_ids=torch.randint(0, vocab, (3,), generator=gen, dtype=torch.int32),
                          input_lengths=torch.ones(3, dtype=torch.int32),
                          past_lengths=torch.full((3,), past, dtype=torch.int32), block_tables=tables))
    steps.append(dict(input_ids=torch.randint(0, vocab, (1,), generator=gen, dtype=torch.int32),
                      input_lengths=torch.ones(1, dtype=torch.int32), past_lengths=torch.tensor([8], dtype=torch.int32),
                      block_tables=tables[:1]))
    for inputs in steps:
        torch.testing.assert_close(native.forward(inputs)["logits"], plain.forward(inputs)["logits"],
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("vocab, extra_words", [(1, 0), (31, 0), (32, 1), (1000, 0), (32000, 0)])
def test_token_bitmask_equals_the_reference(ops, vocab, extra_words):
    from runtime.kernels.torch_kernels.torch_decoder import apply_token_bitmask
    gen = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(-2 ** 31, 2 ** 31, (4, -(-vocab // 32) + extra_words), dtype=torch.int64,
                            generator=gen).to(torch.int32)
    bitmask[1] = -1                                    # a row that allows everything
    logits = torch.randn(6, vocab, generator=gen)
    rows = torch.tensor([5, 0, 2, 3])
    expected, got = logits.clone(), logits.clone()
    apply_token_bitmask(expected, rows, bitmask)
    ops.apply_token_bitmask(got, rows, bitmask)
    assert torch.equal(got, expected)
    through_backend = logits.clone()   # get_kernels("torch") takes this kernel for float32 CPU logits
    get_kernels("torch").apply_token_bitmask(through_backend, rows, bitmask)
    assert torch.equal(through_backend, expected)


@pytest.mark.parametrize("vocab", [1, 7, 8, 45, 49152])
def test_greedy_equals_the_reference(ops, vocab):
    """Tokens exactly torch_decoder.greedy's (first maximum; a row with a NaN: its first NaN; +inf: its
    first +inf; every logit -inf or NaN: NO_TOKEN), log probs within 2e-6 (exp8 against torch's exp;
    NaN / -inf where the reference has them), on strided rows (a wider tensor's columns)."""
    from runtime.kernels.interface import NO_TOKEN
    from runtime.kernels.torch_kernels.torch_decoder import greedy
    gen = torch.Generator().manual_seed(vocab)
    wide = torch.randn(9, vocab + 3, generator=gen) * 4
    logits = wide[:, :vocab]
    ninf, nan = float("-inf"), float("nan")
    logits[1] = ninf                                    # no allowed token
    logits[2] = nan                                     # no allowed token either (NaN is not > -inf)
    logits[3, vocab // 2] = nan                         # a NaN among finite logits
    logits[4, vocab - 1] = logits[4].max() + 1          # the maximum in the tail
    logits[5, :] = 0.5                                  # a tie everywhere: the first
    logits[6, vocab // 3:] = ninf                       # most of the row banned
    logits[7, vocab - 1] = float("inf")                 # +inf
    logits[8, ::2] = ninf
    tokens, log_probs = ops.greedy(logits, NO_TOKEN)
    expected_tokens, expected_log_probs = greedy(logits.clone())
    assert tokens.tolist() == expected_tokens.tolist()
    assert tokens[1] == tokens[2] == NO_TOKEN
    torch.testing.assert_close(log_probs, expected_log_probs, atol=2e-6, rtol=2e-6, equal_nan=True)


def test_the_torch_backend_selects_greedily_natively(monkeypatch):
    calls = []
    native = get_kernels("torch")._native
    monkeypatch.setattr(type(native), "greedy", lambda self, logits, no_token: calls.append(logits.shape) or
                        (torch.zeros(logits.shape[0], dtype=torch.int64), torch.zeros(logits.shape[0])))
    get_kernels("torch").greedy(torch.randn(2, 10))
    assert calls == [(2, 10)]
