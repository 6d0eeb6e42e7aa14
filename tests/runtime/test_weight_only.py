"""Weight-only int8 / int4 kernels (kernels/weight_only_linear, kernels/cpu_weight_only) against the torch
reference (de-quantize, then F.linear), at SmolLM2-135M's shapes and odd ones, on every
instruction-set path the CPU has (the AVX2 and scalar paths forced on any CPU)."""
from __future__ import annotations

import pytest
import torch

from runtime.config import ConfigError
from runtime.kernels.cpu import isa as isa_tiers
from runtime.kernels.cpu.cpu_weight_only import weight_only_ops
from runtime.kernels.torch_kernels.torch_dense import dequantize, weight_only_linear as reference_linear
from runtime.kernels.torch_kernels.weight_only_linear import QuantizedLinear
from runtime.quantization.int4 import quantize_int4
from runtime.quantization.int8 import quantize_int8

OPS = weight_only_ops()
needs_native = pytest.mark.skipif(OPS is None, reason="the native weight-only kernels cannot run here")
ISAS = ["scalar", "avx2", "avx512", "amx"]   # amx: the int8 GEMM on AMX-BF16 tiles (avx512 elsewhere)
# float32 accumulation in another order than the reference's: relative to the output's scale.
RTOL = 2e-5


def quantized(mode: str, out: int, width: int, group_size: int = 32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, width, generator=gen) * 0.1
    if mode == "int8":
        return (*quantize_int8(weight), None)
    return quantize_int4(weight, group_size)


def assert_matches(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.shape == ref.shape
    tol = RTOL * max(ref.abs().max().item(), 1.0) * 8
    assert (y - ref).abs().max().item() <= tol


def test_int8_round_trip_error_is_within_half_a_step():
    weight = torch.randn(40, 96, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.shape == (40,)
    assert ((dequantize(q, scale) - weight).abs() <= scale[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip_and_packing(group_size):
    weight = torch.randn(24, 256, generator=torch.Generator().manual_seed(2))
    packed, scale, minimum = quantize_int4(weight, group_size)
    assert packed.shape == (24, 128) and packed.dtype == torch.uint8
    assert scale.shape == minimum.shape == (24, 256 // group_size)
    assert ((dequantize(packed, scale, minimum) - weight).abs() <= scale.repeat_interleave(group_size, 1) / 2
            + 1e-5).all()
    # Byte j of group 0 holds column j (low nibble) and column gs/2 + j (high), as GGUF Q4_1.
    col0 = torch.round((weight[:, 0] - minimum[:, 0]) / scale[:, 0])
    col_half = torch.round((weight[:, group_size // 2] - minimum[:, 0]) / scale[:, 0])
    assert torch.equal((packed[:, 0] & 15).float(), col0)
    assert torch.equal((packed[:, 0] >> 4).float(), col_half)


def test_constant_rows_quantize_exactly():
    weight = torch.zeros(3, 64)
    weight[1] = 0.5
    q, scale = quantize_int8(weight)
    torch.testing.assert_close(dequantize(q, scale), weight)
    torch.testing.assert_close(dequantize(*quantize_int4(weight, 32)), weight)


# (9, 4160): more groups in a row than the one-row int4 kernel converts at once (64), and row bytes
# past its last whole 64; int8's one row past kSequentialMaxColumns (4096) takes the tiles
SHAPES = [(1536, 576), (576, 1536), (13, 64), (70, 128), (49152, 576), (9, 4160)]


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode,group_size", [("int8", 32), ("int4", 32), ("int4", 64), ("int4", 128)])
@pytest.mark.parametrize("out,width", SHAPES)
def test_native_kernel_matches_reference(out, width, mode, group_size, isa):
    if isa_tiers.NAMES[isa] not in isa_tiers.cpu_tiers():
        pytest.skip(f"this CPU lacks {isa}")
    if mode == "int4" and width % group_size:
        pytest.skip("group does not divide the width")
    weight, scale, minimum = quantized(mode, out, width, group_size)
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(out, generator=gen)
    for rows in ((1, 3) if out > 10000 else (1, 2, 3, 5, 8, 17)):
        x = torch.randn(rows, width, generator=gen)
        ref = reference_linear(x, weight, scale, minimum, bias)
        if mode == "int8":
            y = OPS.int8_linear(x, weight, scale, bias, isa=isa)
        else:
            y = OPS.int4_linear(x, weight, scale, minimum, bias, isa=isa)
        assert_matches(y, ref)


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode,group_size", [("int8", 32), ("int4", 32), ("int4", 64), ("int4", 128)])
@pytest.mark.parametrize("rows", [16, 17, 64, 65, 512, 545])
def test_batch_gemm_matches_reference(rows, mode, group_size, isa):
    """The fused de-quantize-and-multiply GEMM (from bm_wo::kGemmMinRows = 16 rows) on every tier:
    outputs not a multiple of its 6-output tile nor of its 96-output chunk, columns a multiple of
    32 but not of 256 (its column blocks), rows not a multiple of its panel, more rows than one pass
    takes (kRowBlock = 512); with a bias, added into `out`, from strided rows."""
    if isa_tiers.NAMES[isa] not in isa_tiers.cpu_tiers():
        pytest.skip(f"this CPU lacks {isa}")
    out, width = 301, 640
    weight, scale, minimum = quantized(mode, out, width, group_size)
    gen = torch.Generator().manual_seed(rows)
    bias = torch.randn(out, generator=gen)
    x = torch.randn(rows, width + 32, generator=gen)[:, :width]
    ref = reference_linear(x, weight, scale, minimum, bias)
    if mode == "int8":
        y = OPS.int8_linear(x, weight, scale, bias, isa=isa)
    else:
        y = OPS.int4_linear(x, weight, scale, minimum, bias, isa=isa)
    assert_matches(y, ref)
    start = torch.randn(rows, out + 8, generator=gen)[:, :out]
    summed = start.clone()
    if mode == "int8":
        OPS.int8_linear(x, weight, scale, None, out=summed, isa=isa)
    else:
        OPS.int4_linear(x, weight, scale, minimum, None, out=summed, isa=isa)
    assert_matches(summed, start + reference_linear(x, weight, scale, minimum, None))


@needs_native
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_native_kernel_adds_into_out_and_takes_strided_rows(mode):
    weight, scale, minimum = quantized(mode, 37, 64)
    x = torch.randn(4, 128)[:, :64]   # row stride 128
    residual = torch.randn(4, 37)
    ref = residual + reference_linear(x, weight, scale, minimum, None)
    out = residual.clone()
    if mode == "int8":
        OPS.int8_linear(x, weight, scale, None, out=out)
    else:
        OPS.int4_linear(x, weight, scale, minimum, None, out=out)
    assert_matches(out, ref)


@needs_native
def test_the_int8_gemm_runs_on_amx_tiles_where_the_cpu_has_them():
    """Where the CPU has AMX-BF16 the library runs the int8 GEMM on tiles (its tier compiled in and
    permitted): its sums come in another order than the AVX-512 tiles' (not bit-equal), and with the
    input split into three bf16 parts it is as close to a float64 reference as they are (within 2x)."""
    if isa_tiers.Isa.AMX not in isa_tiers.cpu_tiers():
        pytest.skip("this CPU lacks AMX-BF16")
    assert isa_tiers.Isa.AMX in OPS.tiers and OPS.isa_level("amx") == isa_tiers.Isa.AMX
    weight, scale, _ = quantized("int8", 301, 640)
    x = torch.randn(67, 640, generator=torch.Generator().manual_seed(3)) * 10
    exact = (x.double() @ weight.double().T) * scale.double()
    tiles, vectors = (OPS.int8_linear(x, weight, scale, None, isa=isa) for isa in ("amx", "avx512"))
    assert not torch.equal(tiles, vectors)
    assert (tiles.double() - exact).abs().max() <= 2 * (vectors.double() - exact).abs().max()


@needs_native
def test_isa_env_var_forces_the_fallback(monkeypatch):
    weight, scale, _ = quantized("int8", 33, 72)   # 72: a tail after the last 16- and 8-wide step
    x = torch.randn(3, 72)
    ref = reference_linear(x, weight, scale, None, None)
    for isa in ("scalar", "avx2"):
        monkeypatch.setenv(isa_tiers.ENV_VAR, isa)
        assert OPS.isa_level(None) == isa_tiers.NAMES[isa]
        assert_matches(OPS.int8_linear(x, weight, scale, None), ref)
    monkeypatch.setenv(isa_tiers.ENV_VAR, "sse9")
    with pytest.raises(ConfigError, match=f"^{isa_tiers.ENV_VAR}: unknown ISA tier 'sse9'; known: scalar, avx2"):
        OPS.int8_linear(x, weight, scale, None)
    with pytest.raises(ConfigError, match="^isa: unknown ISA tier 'sse9'"):
        OPS.isa_level("sse9")


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("mode,group_size", [("int8", 32), ("int4", 64)])
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_matches_reference(rows, mode, group_size, native, dtype, monkeypatch):
    """Every path of QuantizedLinear: native (few rows), de-quantized tiles + GEMM (many rows),
    and without the native library; out channels not a multiple of 8 and over one tile."""
    if native and OPS is None:
        pytest.skip("no native kernels here")
    out, width = 300, 128
    weight, scale, minimum = quantized(mode, out, width, group_size)
    bias = torch.randn(out).to(dtype)
    linear = QuantizedLinear(weight, scale, minimum, bias)
    if not native:
        linear.ops = None
    x = torch.randn(rows, width).to(dtype)
    ref = reference_linear(x.float(), weight, scale, minimum, bias.float())
    y = linear(x)
    assert y.dtype == dtype and y.shape == (rows, out)
    tol = 1e-4 if dtype == torch.float32 else 0.05 * ref.abs().max().item()
    torch.testing.assert_close(y.float(), ref, atol=tol, rtol=0 if dtype == torch.float32 else 0.02)
    residual = torch.randn(rows, out).to(dtype)
    expected = residual.float() + ref
    torch.testing.assert_close(linear.add_to(x, residual.clone()).float(), expected, atol=tol,
                               rtol=0 if dtype == torch.float32 else 0.02)


@needs_native
def test_an_avx2_only_build_matches_reference(tmp_path):
    """The library as -march=native builds it on a CPU without AVX-512 (-march=haswell: no
    __AVX512F__ paths compiled in at all), loaded and held to the reference here."""
    from runtime.kernels.cpu import library
    from runtime.kernels.cpu.cpu_weight_only import WeightOnlyOps
    flags = tuple(f if f != "-march=native" else "-march=haswell" for f in library.CXX_FLAGS)
    ops = WeightOnlyOps(library.bind(library.build(flags, name="cpu-native-haswell", directory=tmp_path)))
    assert ops.max_isa == 1
    for mode, group_size in (("int8", 32), ("int4", 32), ("int4", 128)):
        weight, scale, minimum = quantized(mode, 45, 256, group_size)
        bias = torch.randn(45)
        for rows in (1, 2, 3, 4, 9):
            x = torch.randn(rows, 256)
            ref = reference_linear(x, weight, scale, minimum, bias)
            y = (ops.int8_linear(x, weight, scale, bias) if mode == "int8"
                 else ops.int4_linear(x, weight, scale, minimum, bias))
            assert_matches(y, ref)
