"""llama.cpp's block formats on the native CPU layer (kernels/cpu/blocks.py over quants_blocks.h,
linear_blocks*.h and format_table.h): the row de-quantization bit for bit gguf.quants.dequantize on
random blocks and on quantizers' blocks; the input quantization exactly the reference's (and the
int8-activation mode's for q8x32); every dot kernel on every tier this CPU runs against the reference,
exactly where the inputs make the float part exact and to float rounding elsewhere, over ggml's
layout and the 8-row interleaved one (x8: its byte positions and round trip); the K formats' tiers
and layouts bit for bit alike; the driver's shapes, bias, accumulate, row strides and threads; bad
arguments."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from runtime.config import ConfigError
from runtime.kernels.cpu import isa as isa_tiers
from runtime.kernels.cpu import library
from runtime.kernels.cpu.act_quant import act_quant_ops
from runtime.kernels.cpu.blocks import (BLOCK_FORMATS, HIGH_BITS_BYTES, X8_HALF_FIELDS, BlockOps, block_geometry,
                                        block_ops, input_type, repack_x8, unpack_x8)
from runtime.kernels.cpu.isa import Isa
from runtime.kernels.torch_kernels.block_reference import (block_linear_reference, dequantize_blocks,
                                                         dequantize_input, quantize_input)
from runtime.quantization import k_quants, native_codes

OPS = block_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="the native CPU kernels cannot be built or run here")
# Random inputs: the kernel sums k / block float32 terms fl(isum) * fl(d_w * d_x) per lane in its
# own order, the reference one float64 matmul of the float32 de-quantized values (q4_1 and the K
# formats round d * code + m there): float32 rounding over <= 72 block terms (~72 * 6e-8 = 4e-6 at
# worst), relative to the sum of |x_j * w_j|. Integer mistakes are caught exactly by
# test_integer_part_is_exact (a wrong code of q8_0 could hide below this tolerance).
RTOL = 1e-5
# byte offsets of each format's float16 fields in a block (d; q4_1's m; the K formats' dmin)
HALF_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2),
               "q6_k": (208,)}
TIERS = [Isa.SCALAR, Isa.AVX2, Isa.AVXVNNI, Isa.AVX512VNNI]
LAYOUTS = ["ggml", "x8"]   # the weight as the file holds it, or repacked 8 rows interleaved (BlockOps.bind)
K_FORMATS = [fmt for fmt in BLOCK_FORMATS if block_geometry(fmt)[0] == 256]
OUTPUTS = 37   # not a multiple of the 16-output tile; x8: 4 whole groups and 5 rows in ggml's layout


def columns(fmt: str) -> list[int]:
    return [256, 512, 2304] + ([32, 96] if block_geometry(fmt)[0] == 32 else [])


def require(tier: Isa, fmt: str) -> None:
    if tier not in OPS.tiers(fmt):
        pytest.skip(f"this CPU or build lacks {fmt}'s {tier.name.lower()} tier")


def linear_of(fmt: str, tier: Isa, layout: str, blocks: torch.Tensor, k: int, bias=None):
    """x -> y on `tier` over `blocks` in `layout` (x8: skipped where the tier has no such kernel)."""
    require(tier, fmt)
    if layout == "ggml":
        return lambda x: OPS.linear(x, blocks, fmt, k, bias, isa=tier)
    bound = OPS.bind(blocks, fmt, k, bias, isa=tier)
    if bound.layout != "x8":
        pytest.skip(f"{fmt} has no kernel over the x8 layout on {tier.name.lower()} here")
    return bound


def random_blocks(fmt: str, n: int, k: int, rng: np.random.Generator, halves: np.ndarray | None = None) -> torch.Tensor:
    """uint8 [n, row_bytes]: random bytes, the float16 fields `halves` (default: finite random
    values over the whole float16 range, subnormals included)."""
    elems, size = block_geometry(fmt)
    blocks = rng.integers(0, 256, size=(n, k // elems, size), dtype=np.uint8)
    for offset in HALF_FIELDS[fmt]:
        if halves is None:
            bits = rng.integers(0, 1 << 16, size=(n, k // elems), dtype=np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF   # exponent 31 (inf / NaN) -> a finite one
            field = bits.view(np.float16)
        else:
            field = rng.choice(halves, size=(n, k // elems)).astype(np.float16)
        blocks[..., offset:offset + 2] = field.view(np.uint8).reshape(n, k // elems, 2)
    return torch.from_numpy(blocks.reshape(n, -1))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_the_table_rows_agree_with_gguf_and_the_declared_codes(fmt):
    lib, info = OPS._lib, (ctypes.c_int32 * 5)()
    assert lib.bm_blk_format_info(native_codes.weight_code(fmt), info) == 0
    assert (info[0], info[1]) == block_geometry(fmt) and native_codes.INPUT_TYPES[info[2]] == input_type(fmt)
    assert info[3] == 1 and info[4] & (1 << Isa.SCALAR)
    assert lib.bm_blk_format_info(len(native_codes.WEIGHT_FORMATS), info) == -1   # one row per code


@pytest.mark.parametrize("name, dtype", [("float32", torch.float32), ("bf16", torch.bfloat16)])
def test_the_float_rows_de_quantize_through_the_same_table(name, dtype):
    w = torch.randn(6, 40).to(dtype)
    out = torch.empty(3, 40)
    raw = w.view(torch.uint8) if dtype == torch.float32 else w.view(torch.int16)
    assert OPS._lib.bm_blk_dequant(native_codes.weight_code(name), raw.data_ptr(), 2, 5, 40, out.data_ptr(), 1) == 0
    assert torch.equal(out, w[2:5].float())
    assert OPS._lib.bm_blk_dequant(native_codes.weight_code("int8"), raw.data_ptr(), 0, 1, 40, out.data_ptr(), 1) == -1


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_dequantize_random_blocks_bit_for_bit(fmt):
    rng = np.random.default_rng(1)
    for k in columns(fmt):
        blocks = random_blocks(fmt, 9, k, rng)
        expected = dequantize_blocks(blocks, fmt, k)
        assert same_bits(OPS.dequantize(blocks, fmt, k, 0, 9), expected), k
        assert same_bits(OPS.dequantize(blocks, fmt, k, 3, 7), expected[3:7]), k


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_dequantize_quantizer_blocks_bit_for_bit(fmt):
    """Blocks as gguf.quants.quantize (32-element formats) and k_quants (K formats) write them."""
    values = np.random.default_rng(2).standard_normal((70, 2304)).astype(np.float32) * 0.1
    values[3] *= 1e-3   # a row of small magnitudes
    values[4, :256] = 0   # an all-zero block
    blocks = torch.from_numpy(np.ascontiguousarray(k_quants.quantize(values, fmt.upper())))
    torch.set_num_threads(2)   # 70 x 2304 runs the rows over threads
    assert same_bits(OPS.dequantize(blocks, fmt, 2304, 0, 70), dequantize_blocks(blocks, fmt, 2304))


@pytest.mark.parametrize("fmt", ["q4_0", "q4_k"])
def test_dequantize_into_out_and_bad_ranges(fmt):
    blocks = random_blocks(fmt, 5, 256, np.random.default_rng(3))
    out = torch.empty(2, 256)
    assert OPS.dequantize(blocks, fmt, 256, 1, 3, out=out) is out
    assert same_bits(out, dequantize_blocks(blocks, fmt, 256)[1:3])
    with pytest.raises(ValueError, match="start, stop"):
        OPS.dequantize(blocks, fmt, 256, 3, 6)
    with pytest.raises(ValueError, match="^out:"):
        OPS.dequantize(blocks, fmt, 256, 0, 3, out=out)


@pytest.mark.parametrize("fmt", ["q4_0", "q6_k"])
def test_input_quantization_is_the_references(fmt):
    x = torch.randn(5, 512) * torch.logspace(-3, 2, 512)
    x[1, :256] = 0   # zero blocks: d == 0
    x[2, 7] = 1e4    # one outlier
    native, reference = OPS.quantize_activations(x, fmt), quantize_input(x, fmt)
    assert native.input_type == reference.input_type == input_type(fmt)
    for a, b in [(native.q, reference.q), (native.d, reference.d), (native.sums, reference.sums)]:
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_input_quantization_of_an_avx2_build_is_the_references():
    """quants_blocks.h's quantize_block has an AVX-512 and an AVX2 body, chosen at compile time: an
    AVX-512 CPU's own build never runs the AVX2 one, so it is built here for Haswell (AVX2, FMA,
    F16C: any CPU these kernels run on) and held to the reference too."""
    if Isa.AVX2 not in isa_tiers.cpu_tiers():
        pytest.skip("this CPU lacks AVX2")
    flags = tuple(f for f in library.CXX_FLAGS if f != "-march=native") + ("-march=haswell",)
    ops = BlockOps(library.bind(library.build(flags, name="cpu-native-haswell")))
    x = torch.randn(5, 512) * torch.logspace(-3, 2, 512)
    x[1, :256] = 0
    x[2, 7] = 1e4
    x[3, 32:64] = torch.arange(32) - 15.5   # ties at half steps once divided by d
    for fmt in ("q8_0", "q4_k"):
        native, reference = ops.quantize_activations(x, fmt), quantize_input(x, fmt)
        for a, b in [(native.q, reference.q), (native.d, reference.d), (native.sums, reference.sums)]:
            assert a.dtype == b.dtype and torch.equal(a, b), fmt


def test_q8x32_is_the_int8_activation_modes_quantization():
    aq = act_quant_ops()
    if aq is None:
        pytest.skip("the int8-activation kernels cannot run here")
    x = torch.randn(3, 576)
    ours = OPS.quantize_activations(x, "q8_0")
    q, d, s = aq.quantize(x)
    assert torch.equal(ours.q, q.reshape(ours.q.shape)) and torch.equal(ours.d, d.reshape(ours.d.shape))
    assert torch.equal(ours.sums, s.reshape(ours.sums.shape).to(torch.int32))


def exact_input(rows: int, k: int, fmt: str, gen: torch.Generator) -> torch.Tensor:
    """Integers |x| <= 8 with one +-127 per input block (d == 1 exactly, q == x); row 0's first
    block zero (d == 0)."""
    block = 256 if input_type(fmt) == "q8k" else 32
    x = torch.randint(-8, 9, (rows, k // block, block), generator=gen).float()
    x[:, :, 5] = 127 * torch.where(torch.rand(rows, k // block, generator=gen) < 0.5, -1.0, 1.0)
    x[0, 0] = 0
    return x.reshape(rows, k)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tier", TIERS, ids=lambda t: t.name.lower())
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_integer_part_is_exact(fmt, tier, layout):
    """Power-of-two float16 fields and exact input blocks: every float operation of the kernel is
    exact, so it equals the reference bit for bit."""
    rng, gen = np.random.default_rng(4), torch.Generator().manual_seed(4)
    halves = np.array([2.0 ** -e * s for e in range(3, 7) for s in (1, -1)])
    for k in (256, 512, 2304):
        blocks = random_blocks(fmt, OUTPUTS, k, rng, halves)
        linear = linear_of(fmt, tier, layout, blocks, k)
        for rows in (1, 3, 8, 17):
            x = exact_input(rows, k, fmt, gen)
            assert torch.equal(dequantize_input(quantize_input(x, fmt)), x.double())
            assert torch.equal(linear(x), block_linear_reference(x, blocks, fmt, k)), (k, rows)


def close(y: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, fmt: str, k: int, bias=None) -> None:
    expected = block_linear_reference(x, blocks, fmt, k, bias).double()
    magnitude = dequantize_input(quantize_input(x, fmt)).abs() @ dequantize_blocks(blocks, fmt, k).double().abs().T
    error = (y.double() - expected).abs()
    assert (error <= RTOL * magnitude + 1e-30).all(), float((error / magnitude.clamp_min(1e-30)).max())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tier", TIERS, ids=lambda t: t.name.lower())
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_linear_matches_the_reference(fmt, tier, layout):
    rng, gen = np.random.default_rng(5), torch.Generator().manual_seed(5)
    halves = np.float16(np.random.default_rng(6).standard_normal(64) * 0.01)
    for k in columns(fmt):
        blocks = random_blocks(fmt, OUTPUTS, k, rng, halves)
        linear = linear_of(fmt, tier, layout, blocks, k)
        for rows in (1, 3, 8, 17):
            x = torch.randn(rows, k, generator=gen)
            close(linear(x), x, blocks, fmt, k)


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_the_k_formats_give_the_same_bits_on_every_tier_and_layout(fmt):
    """The K formats' kernels share one float order (linear_blocks.h): scalar, avx2 and avx2 over
    the x8 layout agree bit for bit on random blocks (float16 fields over their whole range) and
    random inputs, and a bias and an accumulated output too."""
    rng, gen = np.random.default_rng(13), torch.Generator().manual_seed(13)
    for k in (256, 512, 2304):
        blocks = random_blocks(fmt, OUTPUTS, k, rng)
        bias = torch.randn(OUTPUTS, generator=gen)
        kernels = [linear_of(fmt, Isa.SCALAR, "ggml", blocks, k, bias)]
        kernels += [linear_of(fmt, Isa.AVX2, layout, blocks, k, bias) for layout in LAYOUTS]
        for rows in (1, 3, 8, 17):
            x = torch.randn(rows, k, generator=gen) * torch.logspace(-2, 2, k)
            first, *others = [kernel(x) for kernel in kernels]
            assert torch.isfinite(first).all()
            for other in others:
                assert same_bits(other, first), (k, rows)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_the_vnni_tier_gives_the_avx2_tiers_bits(fmt, layout):
    """vpdpbusd sums the same exact integers as vpmaddubsw + vpmaddwd (linear_blocks_avx2.h; the K
    formats over the x8 layout then vpmulld by the sub-block scales, linear_blocks_avx2_k.h; over
    ggml's layout their VNNI tier runs the AVX2 kernel), and the float order is the same: random
    blocks (float16 fields over their whole range), random inputs."""
    runnable = [tier for tier in (Isa.AVX512VNNI, Isa.AVXVNNI) if tier in isa_tiers.compiled_tiers(OPS._lib)]
    if not runnable:
        pytest.skip("this CPU or build lacks a vnni tier")
    vnni = [tier for tier in runnable if tier in OPS.tiers(fmt)]
    assert vnni, f"{fmt} offers no vnni tier where the library has one"   # every block format has one
    rng, gen = np.random.default_rng(14), torch.Generator().manual_seed(14)
    for k in columns(fmt):
        blocks = random_blocks(fmt, OUTPUTS, k, rng)
        bias = torch.randn(OUTPUTS, generator=gen)
        reference = linear_of(fmt, Isa.AVX2, layout, blocks, k, bias)
        kernel = linear_of(fmt, vnni[0], layout, blocks, k, bias)
        for rows in (1, 3, 8, 17):
            x = torch.randn(rows, k, generator=gen) * torch.logspace(-2, 2, k)
            expected = reference(x)
            assert torch.isfinite(expected).all()
            assert same_bits(kernel(x), expected), (k, rows)


@pytest.mark.parametrize("fmt", ["q4_1", "q5_k"])
def test_bias_accumulate_and_row_strides(fmt):
    k, rows = 512, 6
    blocks = random_blocks(fmt, OUTPUTS, k, np.random.default_rng(7), np.float16([0.01, -0.02, 0.005]))
    wide_x = torch.randn(rows, k + 64)
    x, bias = wide_x[:, 32:32 + k], torch.randn(OUTPUTS)
    wide_out = torch.randn(rows, OUTPUTS + 5)
    out, before = wide_out[:, 2:2 + OUTPUTS], wide_out.clone()
    assert OPS.linear(x, blocks, fmt, k, bias=bias, out=out, accumulate=True) is out
    close(out - before[:, 2:2 + OUTPUTS], x, blocks, fmt, k, bias)
    assert torch.equal(wide_out[:, :2], before[:, :2]) and torch.equal(wide_out[:, -3:], before[:, -3:])
    overwritten = OPS.linear(x, blocks, fmt, k, bias=bias, out=torch.full((rows, OUTPUTS), 7.0))
    assert torch.equal(overwritten, OPS.linear(x.contiguous(), blocks, fmt, k, bias=bias))
    bound = OPS.bind(blocks, fmt, k, bias)   # q4_1: the x8 layout (its own summation order) on avx2
    plain = bound(x)
    close(plain, x, blocks, fmt, k, bias)
    again = torch.ones(rows, OUTPUTS)
    assert bound(x, again, accumulate=True) is again and torch.equal(again, 1 + plain)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q6_k"])
@pytest.mark.parametrize("rows", [1, 9])
def test_threads_split_outputs_without_changing_them(fmt, rows):
    """The threads split the outputs, and before them the input's quantization (even ranges of its
    blocks: 3 threads cut 9 rows mid-row; 1 row, below quants_blocks.h's kShareMinInputs, is
    quantized before the parallel region): the same bits."""
    k, n = 512, 300   # 300: a 16-output tile straddles the last whole 8-row group (296) of the x8 layout
    blocks = random_blocks(fmt, n, k, np.random.default_rng(8), np.float16([0.01, -0.03]))
    x, bound = torch.randn(rows, k), OPS.bind(blocks, fmt, k)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, bound_one = OPS.linear(x, blocks, fmt, k), bound(x)
        for num_threads in (2, 3):
            torch.set_num_threads(num_threads)
            assert torch.equal(OPS.linear(x, blocks, fmt, k), one) and torch.equal(bound(x), bound_one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_the_x8_layout_interleaves_8_rows_and_round_trips(fmt):
    """Byte positions: per block, the 8 rows' float16 fields field by field (q6_k's trailing d too),
    q5_0's fifth bits spread, then every other byte of the block in its order, 4 bytes a row at a time."""
    k, n = 512, 19   # two whole groups, 3 rows left in ggml's layout
    blocks = random_blocks(fmt, n, k, np.random.default_rng(11))
    packed = repack_x8(blocks, fmt, k)
    assert packed.shape == blocks.shape and torch.equal(unpack_x8(packed, fmt, k), blocks)
    assert torch.equal(packed[16:], blocks[16:])
    elems, size = block_geometry(fmt)
    fields, high, rows = HALF_FIELDS[fmt], HIGH_BITS_BYTES.get(fmt, 0), blocks.view(n, k // elems, size)
    assert X8_HALF_FIELDS[fmt] == fields
    head = 2 * len(fields)
    high_at = range(fields[-1] + 2, fields[-1] + 2 + high)
    rest = [b for b in range(size) if b not in high_at and all(not 0 <= b - f < 2 for f in fields)]
    assert len(rest) == size - head - high and len(rest) % 4 == 0
    for g, i, r in [(0, 0, 0), (0, 1, 5), (1, 1, 7), (1, 0, 3)]:   # group, block, row in the group
        block = packed[8 * g:8 * g + 8].flatten()[i * 8 * size:(i + 1) * 8 * size]
        source = rows[8 * g + r, i]
        for field, offset in enumerate(fields):   # the 8 rows' float16 fields, field by field
            assert torch.equal(block[16 * field + 2 * r:16 * field + 2 * r + 2], source[offset:offset + 2])
        if high:   # q5_0: row r's 4 bytes, byte b bit t = the fifth bit of element 4t + b
            word = int.from_bytes(bytes(source[list(high_at)].tolist()), "little")
            spread = block[8 * head + 4 * r:8 * head + 4 * r + 4].tolist()
            assert all((spread[b] >> t) & 1 == (word >> (4 * t + b)) & 1 for t in range(8) for b in range(4))
        for c in range(len(rest) // 4):   # chunk c: the 8 rows' bytes rest[4c .. 4c + 3]
            at = 8 * (head + high) + 32 * c + 4 * r
            assert torch.equal(block[at:at + 4], source[rest[4 * c:4 * c + 4]])


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_bind_holds_one_copy_in_the_layout_its_kernel_reads(fmt):
    k, n = 256, 37
    blocks = random_blocks(fmt, n, k, np.random.default_rng(12), np.float16([0.01, -0.02]))
    bound, scalar = OPS.bind(blocks, fmt, k), OPS.bind(blocks, fmt, k, isa=Isa.SCALAR)
    assert scalar.layout == "ggml" and scalar.blocks is blocks and (bound.n, bound.k, bound.fmt) == (n, k, fmt)
    original = blocks.clone()
    if Isa.AVX2 in OPS.tiers(fmt) and OPS.bind(blocks[:8], fmt, k).layout == "x8":   # AVX2 + F16C
        assert bound.layout == "x8" and bound.blocks.shape == blocks.shape
        assert torch.equal(bound.blocks, repack_x8(blocks, fmt, k))
        assert OPS.bind(blocks[:7], fmt, k).layout == "ggml"   # no whole group: nothing to repack
    else:
        assert bound.layout == "ggml" and bound.blocks is blocks
    del blocks   # the bound linear alone keeps its weight
    expected = dequantize_blocks(original, fmt, k)   # gguf.quants.dequantize of the file's bytes
    for start, stop in [(0, 37), (3, 5), (8, 16), (13, 35), (33, 37), (20, 20)]:
        assert same_bits(bound.dequantize(start, stop), expected[start:stop]), (start, stop)
    x = torch.randn(2, k)
    close(bound(x), x, original, fmt, k)


def test_bad_arguments_are_value_errors_naming_them():
    blocks = random_blocks("q4_k", 4, 512, np.random.default_rng(9))
    x = torch.randn(2, 512)
    with pytest.raises(ValueError, match="^fmt: unknown block format 'q3_k'"):
        OPS.linear(x, blocks, "q3_k", 512)
    with pytest.raises(ValueError, match="^k: 288 is not a positive multiple of q4_k's block of 256"):
        OPS.linear(torch.randn(2, 288), blocks, "q4_k", 288)
    with pytest.raises(ValueError, match=r"^blocks: torch.uint8 \(4, 288\) is not uint8 \[n, 144\]"):
        OPS.linear(torch.randn(2, 256), blocks, "q4_k", 256)
    with pytest.raises(ValueError, match="^blocks:"):
        OPS.linear(x, blocks.view(torch.int8), "q4_k", 512)
    with pytest.raises(ValueError, match="^blocks: must be a contiguous CPU tensor at an even address"):
        OPS.linear(x, blocks.flatten()[1:1 + 4 * 288 - 288].view(3, 288), "q4_k", 512)
    with pytest.raises(ValueError, match="^blocks:"):
        OPS.dequantize(blocks[:, :200], "q4_k", 512, 0, 1)
    with pytest.raises(ValueError, match="^x:"):
        OPS.linear(torch.randn(2, 256), blocks, "q4_k", 512)
    with pytest.raises(ValueError, match="^bias:"):
        OPS.linear(x, blocks, "q4_k", 512, bias=torch.randn(5))
    with pytest.raises(ValueError, match="^accumulate:"):
        OPS.linear(x, blocks, "q4_k", 512, accumulate=True)
    with pytest.raises(ValueError, match="^bias:"):
        OPS.bind(blocks, "q4_k", 512, bias=torch.randn(4, dtype=torch.float64))


def test_a_tier_the_cpu_lacks_is_a_config_error_naming_isa():
    missing = [tier for tier in Isa if tier not in isa_tiers.cpu_tiers()]
    if not missing:
        pytest.skip("this CPU has every tier")
    blocks = random_blocks("q8_0", 4, 64, np.random.default_rng(10))
    for isa in (missing[-1], int(missing[-1]), missing[-1].name.lower()):
        with pytest.raises(ConfigError, match="^isa="):
            OPS.linear(torch.randn(1, 64), blocks, "q8_0", 64, isa=isa)
    with pytest.raises(ConfigError, match="^isa: unknown ISA tier"):
        OPS.linear(torch.randn(1, 64), blocks, "q8_0", 64, isa=17)
