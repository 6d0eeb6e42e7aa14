"""The quantized KV cache (BuildConfig.kv_cache_dtype "int8" / "fp8"): the row quantization, the
torch reference and the CPU fast paths over a quantized cache, the model against the
unquantized one, self-consistency over blocks / chunks / windows / copies, sizing and config."""
from __future__ import annotations

import json

import pytest
import torch

from runtime import BuildConfig, ConfigError, Engine, ModelRunner, build_engine
from runtime.kernels import TorchKernels
from runtime.kernels.torch_kernels import torch_attention
from runtime.kernels.kv_quant import dequantize, quantize_rows
from runtime.kernels.cuda.cuda_backend import CudaKernels
from runtime.precision import QuantMode
from tests.factories import make_checkpoints, step_inputs
from tests.runtime.test_paged_cache import one_shot_logits, random_tokens, shuffled_block_tables

SELF_ATOL = 1e-4      # a quantized runner against itself (same stored values, other paths)
# ... where the other path computes a key or value itself (a generation step's fused native call
# against the one-shot context's oneDNN GEMMs): the two float32 values may differ in the last bit
# and, rarely, round to neighbouring int8 steps (one such step moved these logits by 1.4e-3).
SELF_ROUNDING_ATOL = 5e-3
# The model with an int8 / fp8 cache against the float32 cache: the tiny random LLaMA's logits
# span about +-6; measured max |diff| 0.17 (int8) over these prompts, mean well under 0.05.
INT8_ATOL, FP8_ATOL, MEAN_ATOL = 0.4, 1.0, 0.08


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {arch: path for arch, (path, _) in make_checkpoints(tmp_path_factory).items()}


def engine_of(checkpoints, arch="llama", **build):
    return Engine.from_dir(checkpoints[arch], tokens_per_block=4, **build)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_row_quantization_round_trips_within_half_a_step(dtype):
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(0)) * torch.tensor([1e-3, 1.0, 50.0])[:, None]
    x[0, 0] = 0.0
    q, scales = quantize_rows(x, dtype)
    assert q.dtype == dtype and scales.shape == (5, 3) and scales[0, 0] == 0
    back = dequantize(q, scales)
    assert torch.equal(back[0, 0], torch.zeros(16))
    if dtype == torch.int8:
        assert int(q.abs().max()) == 127
        assert bool(((back - x).abs() <= scales[..., None] / 2 + 1e-7).all())
    else:   # e4m3: 3 mantissa bits, relative error <= 2^-4
        assert bool(((back - x).abs() <= x.abs() / 16 + scales[..., None] * 2 ** -9).all())


def quantized_cache(dtype, num_blocks=6, tpb=4, kv_heads=2, head_dim=16, seed=0):
    """(k_cache, v_cache, k_scales, v_scales) filled through write_kv, and the float32 caches holding
    what they de-quantize to."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks * tpb, kv_heads, head_dim, generator=g)
    v = torch.randn(num_blocks * tpb, kv_heads, head_dim, generator=g)
    caches = [torch.zeros(num_blocks, tpb, kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    scales = [torch.zeros(num_blocks, tpb, kv_heads) for _ in range(2)]
    slots = torch.randperm(num_blocks * tpb, generator=g)
    torch_attention.write_kv(*caches, k, v, slots, *scales)
    plain = [dequantize(c, s) for c, s in zip(caches, scales)]
    return caches, scales, plain


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("window, sink", [(None, 0), (5, 2)])
def test_attention_over_a_quantized_cache_equals_attention_over_its_values(dtype, window, sink):
    (k_cache, v_cache), (k_scales, v_scales), (k_plain, v_plain) = quantized_cache(dtype)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 16, generator=g)
    tables = torch.tensor([[5, 1, 3, 0], [2, 4, 0, 0], [0, 3, 1, 5]], dtype=torch.int32)
    lens = torch.tensor([13, 6, 16])
    expected = torch_attention.decode_attention(q, k_plain, v_plain, tables, lens, 0.25, window, sink)
    for backend in (torch_attention, TorchKernels(fast_paths=True), TorchKernels(fast_paths=True, native=True)):
        got = backend.decode_attention(q, k_cache, v_cache, tables, lens, 0.25, window, sink, None, k_scales, v_scales)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    qs = torch.randn(5, 4, 16, generator=g)
    expected = torch_attention.context_attention(qs, k_plain, v_plain, tables[2], 11, 0.25, window, sink)
    for backend in (torch_attention, TorchKernels(fast_paths=True)):
        got = backend.context_attention(qs, k_cache, v_cache, tables[2], 11, 0.25, window, sink, None,
                                        k_scales, v_scales)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_native_int8_decode_attention_equals_the_reference_with_gqa_and_mixed_lengths():
    from runtime.kernels.cpu.cpu_native import native_ops
    native = native_ops()
    if native is None:
        pytest.skip("native CPU kernels unavailable here")
    (k_cache, v_cache), (k_scales, v_scales), (k_plain, v_plain) = quantized_cache(torch.int8, num_blocks=9,
                                                                                 tpb=3, kv_heads=2, head_dim=24)
    q = torch.randn(4, 6, 24, generator=torch.Generator().manual_seed(2))
    tables = torch.tensor([[8, 1, 3, 0, 2, 4], [2, 4, 0, 0, 0, 0], [0, 3, 1, 5, 6, 7], [7, 0, 0, 0, 0, 0]],
                          dtype=torch.int32)
    lens = torch.tensor([17, 5, 18, 1])
    for window, sink in ((None, 0), (4, 1)):
        expected = torch_attention.decode_attention(q, k_plain, v_plain, tables, lens, 0.3, window, sink)
        got = native.decode_attention_int8(q, k_cache, v_cache, k_scales, v_scales, tables, lens, 0.3, window, sink)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def logits_of(engine, prompts, num_steps, seed=0):
    """Context logits of each prompt, then its logits over num_steps greedy-free forced tokens."""
    runner = ModelRunner(engine, 40)
    tables = shuffled_block_tables(40, 10, len(prompts), seed=seed)
    rows = [runner.forward(step_inputs([(p, 0, t) for p, t in zip(prompts, tables)], True))["context_logits"]]
    for step in range(num_steps):
        seqs = [([p[step % len(p)]], len(p) + step, t) for p, t in zip(prompts, tables)]
        rows.append(runner.forward(step_inputs(seqs))["logits"])
    return torch.cat(rows), runner


@pytest.mark.parametrize("kv_cache_dtype, atol", [("int8", INT8_ATOL), ("fp8", FP8_ATOL)])
def test_quantized_cache_model_stays_close_to_the_float32_cache(checkpoints, kv_cache_dtype, atol):
    prompts = [random_tokens(n, seed=n) for n in (11, 7, 20)]
    reference, _ = logits_of(engine_of(checkpoints), prompts, 8)
    got, runner = logits_of(engine_of(checkpoints, kv_cache_dtype=kv_cache_dtype), prompts, 8)
    assert runner.kv_pool.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_cache_dtype]
    assert runner.kv_scales.shape == runner.kv_pool.shape[:-1]
    diff = (got - reference).abs()
    assert float(diff.max()) < atol and float(diff.mean()) < MEAN_ATOL, (float(diff.max()), float(diff.mean()))
    agree = (got.argmax(-1) == reference.argmax(-1)).float().mean()
    assert agree >= 0.9, float(agree)


@pytest.mark.parametrize("arch", ["llama", "mistral"])   # mistral: a sliding window
def test_int8_incremental_decoding_over_shuffled_blocks_equals_its_one_shot(checkpoints, arch):
    engine = engine_of(checkpoints, arch, kv_cache_dtype="int8")
    prompts = [random_tokens(n, seed=n) for n in (5, 9)]
    continuations = [random_tokens(10, seed=100 + i) for i in range(2)]
    references = [one_shot_logits(engine, p + c) for p, c in zip(prompts, continuations)]
    runner = ModelRunner(engine, 16)
    tables = shuffled_block_tables(16, 5, 2, seed=4)
    logits = runner.forward(step_inputs([(p, 0, t) for p, t in zip(prompts, tables)]))["logits"]
    for step in range(11):
        for i, p in enumerate(prompts):
            torch.testing.assert_close(logits[i], references[i][len(p) - 1 + step], atol=SELF_ROUNDING_ATOL, rtol=0)
        if step < 10:
            seqs = [([c[step]], len(p) + step, t) for p, c, t in zip(prompts, continuations, tables)]
            logits = runner.forward(step_inputs(seqs))["logits"]


def test_int8_chunked_context_equals_its_one_shot(checkpoints):
    engine = engine_of(checkpoints, kv_cache_dtype="int8")
    a = random_tokens(25, seed=1)
    reference = one_shot_logits(engine, a)
    runner, table, past = ModelRunner(engine, 10), shuffled_block_tables(10, 7, 1, seed=3)[0], 0
    for n in (10, 1, 6, 8):
        out = runner.forward(step_inputs([(a[past:past + n], past, table)], context_logits=True))
        torch.testing.assert_close(out["context_logits"], reference[past:past + n], atol=SELF_ATOL, rtol=0)
        past += n


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_block_copy_copies_the_scales(checkpoints, kv_cache_dtype):
    """A sequence continued from copies of its blocks (beams, copy-on-write) equals the original."""
    engine = engine_of(checkpoints, kv_cache_dtype=kv_cache_dtype)
    prompt, nxt = random_tokens(10, seed=5), random_tokens(1, seed=6)
    runner = ModelRunner(engine, 8)
    runner.forward(step_inputs([(prompt, 0, [0, 1, 2])]))
    runner.copy_blocks([0, 1, 2], [5, 6, 7])
    assert torch.equal(runner.kv_scales[:, :, 5:8], runner.kv_scales[:, :, 0:3])
    original = runner.forward(step_inputs([(nxt, 10, [0, 1, 2])]))["logits"]
    copied = runner.forward(step_inputs([(nxt, 10, [5, 6, 7])]))["logits"]
    torch.testing.assert_close(copied, original, atol=0, rtol=0)


def test_reused_prefix_blocks_give_the_same_logits_as_a_fresh_prompt(checkpoints):
    engine = engine_of(checkpoints, kv_cache_dtype="int8")
    prefix, rest = random_tokens(8, seed=7), random_tokens(5, seed=8)
    reference = one_shot_logits(engine, prefix + rest)
    runner = ModelRunner(engine, 8)
    runner.forward(step_inputs([(prefix, 0, [3, 4])]))
    out = runner.forward(step_inputs([(rest, 8, [3, 4, 6, 7])], context_logits=True))
    torch.testing.assert_close(out["context_logits"], reference[8:], atol=SELF_ATOL, rtol=0)


def test_kv_bytes_count_values_and_scales(checkpoints):
    fp32, int8 = engine_of(checkpoints), engine_of(checkpoints, kv_cache_dtype="int8")
    cfg = fp32.model_config
    per_row = cfg.num_layers * 2 * cfg.num_kv_heads
    assert fp32.kv_bytes_per_token() == per_row * cfg.head_dim * 4
    assert int8.kv_bytes_per_token() == per_row * (cfg.head_dim + 4)
    assert engine_of(checkpoints, kv_cache_dtype="fp8").kv_bytes_per_token() == int8.kv_bytes_per_token()
    assert ModelRunner.kv_bytes_per_block(int8) == 4 * int8.kv_bytes_per_token()
    runner = ModelRunner(int8, 3)
    assert runner.kv_pool.nbytes + runner.kv_scales.nbytes == 3 * ModelRunner.kv_bytes_per_block(int8)


def test_int8_engine_dir_reloads_with_its_setting(checkpoints, tmp_path):
    engine = build_engine(checkpoints["llama"], tmp_path / "engine", tokens_per_block=4, kv_cache_dtype="int8")
    assert engine.build_config.kv_cache_scale == "token_head"
    recorded = json.loads((tmp_path / "engine" / "engine.json").read_text())["build"]
    assert (recorded["kv_cache_dtype"], recorded["kv_cache_scale"]) == ("int8", "token_head")
    again = Engine.from_dir(tmp_path / "engine")
    assert (again.build_config.kv_cache_dtype, again.build_config.kv_cache_scale) == ("int8", "token_head")
    assert QuantMode(again.model_config.quant_mode).has_int8_kv_cache()
    assert ModelRunner(again, 2).kv_pool.dtype == torch.int8


@pytest.mark.parametrize("fields, name", [
    ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
    ({"kv_cache_dtype": "int8", "kv_cache_scale": "per_tensor"}, "kv_cache_scale"),
    ({"kv_cache_dtype": "int8", "kv_cache_scale": "block_head"}, "kv_cache_scale"),
    ({"kv_cache_scale": "token_head"}, "kv_cache_scale"),
])
def test_bad_kv_cache_settings_are_config_errors_naming_the_field(checkpoints, fields, name):
    with pytest.raises(ConfigError, match=name):
        engine_of(checkpoints, **fields)


def test_backends_without_fp8_refuse_it_at_load(checkpoints):
    class CudaLike(TorchKernels):
        name = "cuda"
        kv_storage_dtypes = CudaKernels.kv_storage_dtypes
    engine = engine_of(checkpoints, kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        ModelRunner(engine, 2, kernels=CudaLike())
    assert BuildConfig(kv_cache_dtype="fp8").validated().kv_cache_dtype == "fp8"


def test_int8_draft_tokens_are_scored_as_the_one_shot(checkpoints):
    """A generation token plus drafts (speculative decoding) attends over the int8 past like a chunk."""
    engine = engine_of(checkpoints, kv_cache_dtype="int8")
    tokens = random_tokens(15, seed=9)
    reference = one_shot_logits(engine, tokens)
    runner = ModelRunner(engine, 8)
    runner.forward(step_inputs([(tokens[:11], 0, [7, 2, 5, 0])]))
    inputs = step_inputs([(tokens[11:], 11, [7, 2, 5, 0])])
    inputs["num_logits"] = torch.tensor([4], dtype=torch.int32)
    torch.testing.assert_close(runner.forward(inputs)["logits"], reference[11:], atol=SELF_ATOL, rtol=0)
