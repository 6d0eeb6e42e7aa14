"""bf16 on the CPU: the native bf16 kernels (kernels/cpu_native_bf16.py) against their torch
references, on both entry points (AVX512-BF16 where compiled, and the AVX2 shifting path forced),
at SmolLM2-135M's shapes and odd ones; a bf16 model against float32; GptManager against GptSession.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batch_manager import GptManager, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType
from runtime import Engine, GenerationOutput, ModelRunner, SamplingConfig, build_engine
from runtime.config import ConfigError
from runtime.kernels.cpu import cpu_native, cpu_native_bf16, isa as isa_tiers
from runtime.kernels.torch_kernels import torch_attention
from runtime.kernels.cpu.cpu_native_bf16 import bf16_ops
from runtime.kernels.torch_kernels.linear import NATIVE_MAX_ROWS_BF16, Linear, onednn_available
from runtime.precision import cpu_flags
from tests.batch_manager.conftest import Client, make_request
from tests.factories import make_checkpoint, step_inputs
from tests.runtime.test_model_parity import generation_input, make_session

pytestmark = pytest.mark.skipif(bf16_ops() is None, reason="native CPU kernels unavailable here")

CPU = torch.device("cpu")
ISAS = ["best", "avx2"]   # best: no cap (the CPU's best tier); avx2: BATCH_MANAGER_CPU_ISA=avx2
HIDDEN, INTERMEDIATE, VOCAB = 576, 1536, 49152   # SmolLM2-135M
# [out, in] of every distinct matmul of SmolLM2-135M, and widths that are no multiple of 16 (or 32)
MODEL_SHAPES = [(HIDDEN + 2 * 192, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE),
                (VOCAB, HIDDEN)]
ODD_SHAPES = [(19, 37), (50, 100), (7, 8), (33, 600)]
BF16_RTOL = 2 ** -7   # one bf16 rounding (8 significant bits)


def randn(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture(params=ISAS)
def ops(request, monkeypatch):
    """The kernels through the wrapper's choice of entry point: the best one, or the AVX2 path
    forced with the environment variable (whatever the CPU has)."""
    if request.param == "avx2":
        monkeypatch.setenv(isa_tiers.ENV_VAR, "avx2")
    else:
        monkeypatch.delenv(isa_tiers.ENV_VAR, raising=False)
    ops = bf16_ops()
    assert ops.uses_dot_product == (request.param == "best" and "avx512_bf16" in cpu_flags())
    return ops


def reference_linear(x, weight, bias):
    return x.float() @ weight.float().t() + (0 if bias is None else bias)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("shape", MODEL_SHAPES, ids=lambda s: f"{s[1]}to{s[0]}")
def test_linear_at_model_shapes(ops, shape, rows):
    n, k = shape
    weight, bias = randn(n, k, seed=1, dtype=torch.bfloat16), randn(n, seed=2)
    for x_dtype in (torch.bfloat16, torch.float32):
        x = randn(rows, k, seed=3, dtype=x_dtype)
        expected = reference_linear(x, weight, bias)
        torch.testing.assert_close(ops.linear(x, weight, bias, out_dtype=torch.float32), expected, atol=2e-4, rtol=1e-5)
        got = ops.linear(x, weight, bias, out_dtype=torch.bfloat16)
        torch.testing.assert_close(got.float(), expected, atol=1e-3, rtol=BF16_RTOL)


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: f"{s[1]}to{s[0]}")
def test_linear_at_odd_shapes_strides_and_accumulation(ops, shape, rows):
    n, k = shape
    weight = randn(n, k, seed=4, dtype=torch.bfloat16)
    x = randn(rows, k + 5, seed=5, dtype=torch.bfloat16)[:, 2:k + 2]   # rows not contiguous with each other
    torch.testing.assert_close(ops.linear(x, weight, None, out_dtype=torch.float32), reference_linear(x, weight, None),
                               atol=1e-4, rtol=1e-5)
    for out_dtype in (torch.float32, torch.bfloat16):
        residual = randn(rows, n, seed=6, dtype=out_dtype)
        expected = residual.float() + reference_linear(x, weight, None)
        got = ops.linear(x, weight, None, out=residual.clone())
        torch.testing.assert_close(got.float(), expected, atol=2e-2 if out_dtype == torch.bfloat16 else 1e-4,
                                   rtol=BF16_RTOL if out_dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("width", [HIDDEN, 37])
def test_rms_norm(ops, rows, width):
    x, weight = randn(rows, width, seed=7, dtype=torch.bfloat16), randn(width, seed=8, dtype=torch.bfloat16)
    h = x.float()
    expected = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()).bfloat16()
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), expected, atol=1e-6, rtol=BF16_RTOL)


@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("width", [INTERMEDIATE, 37])
def test_silu_mul(ops, rows, width):
    x = randn(rows, 2 * width, seed=9, dtype=torch.bfloat16) * 3
    x[0, :4] = torch.tensor([100.0, -100.0, 1e4, -1e4])   # exp's clamped range, both ends
    gate, up = x.float().chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(x), (F.silu(gate) * up).bfloat16(), atol=1e-5, rtol=BF16_RTOL)


def paged_cache(num_blocks: int, tpb: int, num_kv_heads: int, head_dim: int, seed: int):
    k = randn(num_blocks, tpb, num_kv_heads, head_dim, seed=seed, dtype=torch.bfloat16)
    v = randn(num_blocks, tpb, num_kv_heads, head_dim, seed=seed + 1, dtype=torch.bfloat16)
    return k, v


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 40), (8, 2, 17)],
                         ids=["smollm2", "mha_d40", "gqa_d17"])
@pytest.mark.parametrize("window,sink", [(None, 0), (5, 2)], ids=["full", "window_sink"])
def test_decode_attention_against_the_reference(ops, heads, kv_heads, head_dim, window, sink):
    tpb, seq_lens = 4, [1, 3, 17, 30]
    k_cache, v_cache = paged_cache(40, tpb, kv_heads, head_dim, seed=10)
    blocks = torch.randperm(40, generator=torch.Generator().manual_seed(11))[:4 * 8].view(4, 8).to(torch.int32)
    lens = torch.tensor(seq_lens)
    q = randn(4, heads, head_dim, seed=12, dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    got = ops.decode_attention(q, k_cache, v_cache, blocks, lens, scale, window, sink)
    expected = torch_attention.decode_attention(q, k_cache, v_cache, blocks, lens, scale, window, sink)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-3, rtol=BF16_RTOL)


# --- wiring -----------------------------------------------------------------------------------------

def test_linear_takes_the_native_kernel_up_to_its_rows_then_the_gemm(monkeypatch):
    monkeypatch.setenv(isa_tiers.ENV_VAR, "avx2")
    weight, bias = randn(40, 24, seed=13, dtype=torch.bfloat16), randn(40, seed=14, dtype=torch.bfloat16)
    linear = Linear(weight, bias, CPU)
    assert linear.native_bf16 is not None and not linear.native_bf16.uses_dot_product
    for rows in (1, NATIVE_MAX_ROWS_BF16, NATIVE_MAX_ROWS_BF16 + 1, 40):
        x = randn(rows, 24, seed=rows, dtype=torch.bfloat16)
        got = linear(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), F.linear(x, weight, bias).float(), atol=2e-2, rtol=2 * BF16_RTOL)
        residual = randn(rows, 40, seed=15, dtype=torch.bfloat16)
        torch.testing.assert_close(linear.add_to(x, residual.clone()).float(),
                                   (residual + F.linear(x, weight, bias)).float(), atol=3e-2, rtol=2 * BF16_RTOL)


def test_the_switch_turns_the_bf16_kernels_off_and_a_bad_isa_is_refused(monkeypatch):
    monkeypatch.setenv(cpu_native.ENV_VAR, "0")
    assert bf16_ops() is None
    assert Linear(torch.ones(4, 4, dtype=torch.bfloat16), None, CPU).native_bf16 is None
    monkeypatch.delenv(cpu_native.ENV_VAR)
    monkeypatch.setenv(isa_tiers.ENV_VAR, "sse2")
    with pytest.raises(ConfigError, match="^BATCH_MANAGER_CPU_ISA: unknown ISA tier 'sse2'"):
        bf16_ops()


def test_onednn_bf16_gemm_matches_f_linear():
    if not onednn_available(torch.bfloat16):
        pytest.skip("no oneDNN bf16 linear in this torch build")
    weight = randn(3072, HIDDEN, seed=16, dtype=torch.bfloat16)
    linear = Linear(weight, None, CPU, "onednn")
    x = randn(64, HIDDEN, seed=17, dtype=torch.bfloat16)
    torch.testing.assert_close(linear(x).float(), F.linear(x, weight).float(), atol=2e-2, rtol=2 * BF16_RTOL)


# --- the model ------------------------------------------------------------------------------------

PROMPTS = [[5, 9, 22, 17, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52], [7], [90, 80, 70, 60]]
NUM_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_checkpoint(path, "llama", seed=3)
    return path


def context_then_generation(engine: Engine) -> tuple[torch.Tensor, torch.Tensor]:
    """(context logits [26, V] of a 26-token prompt (the GEMM path), logits [3, V] of a
    3-sequence generation step (the native kernels))."""
    runner = ModelRunner(engine, num_blocks=32)
    prompt = PROMPTS[1] * 2
    context = runner.forward(step_inputs([(prompt, 0, list(range(7)))], context_logits=True))["context_logits"]
    for seq, blocks in ((PROMPTS[0], [8, 9]), (PROMPTS[3], [12, 13])):
        runner.forward(step_inputs([(seq, 0, blocks)]))
    generation = runner.forward(step_inputs([([11], 26, list(range(7))), ([12], 5, [8, 9]), ([13], 4, [12, 13])]))
    return context, generation["logits"]


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_model_stays_close_to_float32(checkpoint, monkeypatch, isa):
    """Logits (|logits| up to ~6) within 0.25 absolute (mean 0.05) of the float32 model's, in float32,
    with the weights, activations and KV cache in bf16 and the native kernels on."""
    if isa == "avx2":
        monkeypatch.setenv(isa_tiers.ENV_VAR, isa)
    engine = Engine.from_dir(checkpoint, dtype="bfloat16", tokens_per_block=4)
    runner = ModelRunner(engine, num_blocks=4)
    assert runner.kv_pool.dtype == torch.bfloat16
    assert isinstance(runner.kernels.native_dense_ops()[torch.bfloat16], cpu_native_bf16.NativeBf16Ops)
    assert all(linear.native_bf16 is not None for linear in runner.model.linears.values())
    expected = context_then_generation(Engine.from_dir(checkpoint, tokens_per_block=4))
    for got, want in zip(context_then_generation(engine), expected):
        assert got.dtype == torch.float32
        err = (got - want).abs()
        assert 0 < err.max() < 0.25 and err.mean() < 0.05, (err.max().item(), err.mean().item())
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_bf16_native_kernels_agree_with_torch_bf16(checkpoint, monkeypatch):
    """The bf16 model with the native kernels against the same model on torch's bf16 ops alone."""
    engine = Engine.from_dir(checkpoint, dtype="bfloat16", tokens_per_block=4)
    native = context_then_generation(engine)
    monkeypatch.setenv(cpu_native.ENV_VAR, "0")
    plain = context_then_generation(engine)
    for got, want in zip(native, plain):
        err = (got - want).abs()
        assert err.max() < 0.1 and err.mean() < 0.02, (err.max().item(), err.mean().item())


def run_manager(engine_dir, prompts: list[list[int]]) -> list[list[int]]:
    client = Client([make_request(i, p, max_new_tokens=NUM_NEW_TOKENS) for i, p in enumerate(prompts)])
    with GptManager(str(engine_dir), TrtGptModelType.InflightFusedBatching, 4, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *client.callbacks(), optional_params=TrtGptModelOptionalParams()):
        client.wait(120)
    return client.final_output_ids(range(len(prompts)))


def test_manager_equals_session_greedy_in_bf16(checkpoint, tmp_path):
    engine = build_engine(checkpoint, tmp_path, dtype="bfloat16", tokens_per_block=4, max_batch_size=4,
                          max_input_len=32, max_seq_len=64)
    assert engine.model_config.dtype == "bfloat16"
    output = GenerationOutput()
    inp = generation_input(PROMPTS, False, -1, 0)
    inp.max_new_tokens = NUM_NEW_TOKENS
    make_session(engine).generate(output, inp, SamplingConfig())
    expected = [output.ids[i, 0, :len(p) + NUM_NEW_TOKENS].tolist() for i, p in enumerate(PROMPTS)]
    assert run_manager(tmp_path, PROMPTS) == expected
