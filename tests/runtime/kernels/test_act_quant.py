"""The int8-activation kernels (kernels/cpu/linear_act_quant.h through kernels/cpu/act_quant) against the torch
reference: the quantizer exactly; each GEMV on every tier this CPU has, exactly where the inputs make
the float part exact (power-of-two block and weight scales) and to float rounding on random inputs."""
from __future__ import annotations

import pytest
import torch

from runtime.config import ConfigError
from runtime.kernels.cpu import act_quant, isa as isa_tiers, library
from runtime.kernels.cpu.isa import ENV_VAR as ISA_ENV_VAR
from runtime.kernels.cpu.act_quant import (TIERS, ActQuantOps, act_quant_ops,
                                       int8_act_linear_reference, pack, quantize_activations)
from runtime.quantization.int4 import quantize_int4
from runtime.quantization.int8 import quantize_int8

OPS = act_quant_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="the act-quant kernels cannot be built or run here")
# Random inputs: float32 sums of k/32 block terms in another order than the reference's (and FMA
# contraction); relative to the output's largest magnitude.
RTOL = 1e-5
# (format, group size, columns): columns multiples of 32 (and of gs) but not of 256.
FORMATS = [("int8", 0, 96), ("int8", 0, 576), ("int4", 32, 160), ("int4", 32, 576), ("int4", 64, 192),
           ("int4", 64, 576), ("int4", 128, 384), ("int4", 128, 640)]
OUTPUTS = 40   # not a multiple of the 16-output unit


ISAS = [tier.name.lower() for tier in TIERS]


def require(isa: str) -> None:
    if isa not in OPS.available_isas or isa_tiers.NAMES[isa] not in isa_tiers.cpu_tiers():
        pytest.skip(f"this CPU or build lacks the {isa} tier (has {', '.join(OPS.available_isas)})")


def exact_activations(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Integers in [-127, 127], each block's max |x| 127, times 2^e (e in -1..1) per block, so
    d = 2^e and x / d are exact; row 0's second block is zero (d == 0)."""
    q = torch.randint(-127, 128, (rows, k // 32, 32), generator=gen).float()
    q[:, :, 0] = 127 * torch.where(torch.rand(rows, k // 32, generator=gen) < 0.5, -1.0, 1.0)
    x = q * 2.0 ** torch.randint(-1, 2, (rows, k // 32, 1), generator=gen).float()
    if k >= 64:
        x[0, 1] = 0
    return x.reshape(rows, k)


def exact_weights(fmt: str, gs: int, n: int, k: int, gen: torch.Generator):
    """(weight, scale, minimum) with power-of-two scales and minimums in quarter steps."""
    if fmt == "int8":
        weight = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        return weight, 2.0 ** torch.randint(-3, 1, (n,), generator=gen).float(), None
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scale = 2.0 ** torch.randint(-3, 1, (n, k // gs), generator=gen).float()
    return packed, scale, torch.randint(-32, 1, (n, k // gs), generator=gen).float() / 4


def exact_float64(x, weight, scale, minimum, bias) -> torch.Tensor:
    """The reference's formula in float64: exact for the inputs above, so it checks that the
    float32 reference is exact too."""
    q, d, s = quantize_activations(x)
    rows, k = x.shape
    nib = weight if minimum is None else act_quant.unpack_int4(weight, k // scale.shape[1])
    isum = torch.einsum("rbj,obj->rob", q.double().reshape(rows, -1, 32), nib.double().reshape(nib.shape[0], -1, 32))
    if minimum is None:
        y = (isum * d.double()[:, None, :]).sum(dim=2) * scale.double()
    else:
        per_block = k // 32 // scale.shape[1]
        sc, mn = (t.double().repeat_interleave(per_block, dim=1) for t in (scale, minimum))
        y = ((sc * isum + mn * s.double()[:, None, :]) * d.double()[:, None, :]).sum(dim=2)
    return y + bias.double()


def test_quantizer_matches_reference_exactly():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 160, generator=gen) * torch.logspace(-6, 3, 5)[:, None]
    x[1, 32:64] = 0                                           # d == 0
    x[2, :32] = torch.arange(32) - 15.5                       # max 16.5: x / d lands near halves
    x[3, :32] = torch.tensor([127.0, 2.5, -2.5, 3.5, -0.5, 0.5] + [1.0] * 26)   # d == 1: ties to even
    q, d, s = quantize_activations(x)
    q_native, d_native, s_native = OPS.quantize(x)
    assert torch.equal(q, q_native) and torch.equal(d, d_native) and torch.equal(s, s_native)
    assert q[3, :6].tolist() == [127, 2, -2, 4, 0, 0]
    assert torch.equal(q[1, 32:64], torch.zeros(32, dtype=torch.int8)) and d[1, 1] == 0
    assert torch.equal(s, q.reshape(5, 5, 32).int().sum(dim=2))


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("fmt,gs,k", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17, 64, 65])
def test_integer_path_exact(isa, fmt, gs, k, rows):
    require(isa)
    gen = torch.Generator().manual_seed(rows * 1000 + k + gs)
    x = exact_activations(rows, k, gen)
    weight, scale, minimum = exact_weights(fmt, gs, OUTPUTS, k, gen)
    bias = torch.randint(-32, 33, (OUTPUTS,), generator=gen).float() / 4
    ref = int8_act_linear_reference(x, weight, scale, minimum, bias)
    assert torch.equal(ref.double(), exact_float64(x, weight, scale, minimum, bias))
    packed = pack(weight, scale, minimum)
    assert torch.equal(OPS.act_linear(x, packed, bias, isa=isa), ref)
    start = torch.randint(-32, 33, (rows, OUTPUTS), generator=gen).float() / 4
    out = start.clone()
    assert OPS.act_linear(x, packed, None, out=out, isa=isa) is out
    assert torch.equal(out, start + int8_act_linear_reference(x, weight, scale, minimum, None))


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("fmt,gs", [("int8", 0), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("rows", [17, 512])
def test_batch_panels_exact(isa, fmt, gs, rows):
    """At batch the units are taken in panels of kPanelBytes of weights, every row block per panel:
    31 units of 640 columns span three panels of int8 (two of int4); the last unit half empty."""
    require(isa)
    k, n = 640, 16 * 30 + 8
    gen = torch.Generator().manual_seed(rows + gs)
    x = exact_activations(rows, k, gen)
    weight, scale, minimum = exact_weights(fmt, gs, n, k, gen)
    bias = torch.randint(-32, 33, (n,), generator=gen).float() / 4
    ref = int8_act_linear_reference(x, weight, scale, minimum, bias)
    assert torch.equal(OPS.act_linear(x, pack(weight, scale, minimum), bias, isa=isa), ref)


@pytest.mark.parametrize("rows", [1, 9, 64])
def test_threads_share_the_quantization_without_changing_it(rows):
    """The threads quantize even ranges of the input's 32-column blocks (3 threads cut 9 rows of 20
    blocks mid-row; 1 row, below quants_blocks.h's kShareMinInputs, is quantized before the parallel
    region) before splitting the outputs: the same bits at any thread count."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 640, generator=gen)
    weight, scale, minimum = quantize_int4(torch.randn(16 * 30 + 8, 640, generator=gen), 32)
    packed = pack(weight, scale, minimum)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = OPS.act_linear(x, packed, None)
        for num_threads in (2, 3):
            torch.set_num_threads(num_threads)
            assert torch.equal(OPS.act_linear(x, packed, None), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("fmt,gs,k", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 64])
def test_random_to_float_rounding(isa, fmt, gs, k, rows):
    require(isa)
    gen = torch.Generator().manual_seed(rows * 1000 + k + gs + 1)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(OUTPUTS, k, generator=gen) * 0.1
    weight, scale, minimum = (*quantize_int8(w), None) if fmt == "int8" else quantize_int4(w, gs)
    bias = torch.randn(OUTPUTS, generator=gen)
    ref = int8_act_linear_reference(x, weight, scale, minimum, bias)
    y = OPS.act_linear(x, pack(weight, scale, minimum), bias, isa=isa)
    torch.testing.assert_close(y, ref, rtol=RTOL, atol=RTOL * ref.abs().max().item())


def test_strided_input_and_output_rows():
    gen = torch.Generator().manual_seed(7)
    weight, scale, minimum = quantize_int4(torch.randn(OUTPUTS, 160, generator=gen), 32)
    x = torch.randn(3, 200, generator=gen)[:, :160]
    out = torch.zeros(3, OUTPUTS + 8)[:, :OUTPUTS]
    OPS.act_linear(x, pack(weight, scale, minimum), None, out=out)
    ref = int8_act_linear_reference(x.contiguous(), weight, scale, minimum, None)
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=RTOL * ref.abs().max().item())


@pytest.mark.parametrize("value", ["avx9000", "sse"])
def test_unknown_isa_in_env_is_a_config_error(monkeypatch, value):
    monkeypatch.setenv(ISA_ENV_VAR, value)
    packed = pack(*quantize_int8(torch.randn(16, 32)), None)
    with pytest.raises(ConfigError, match=f"^{ISA_ENV_VAR}: unknown ISA tier {value!r}") as error:
        OPS.act_linear(torch.randn(1, 32), packed, None)
    assert all(name in str(error.value) for name in isa_tiers.NAMES)


def test_env_forces_a_tier(monkeypatch):
    monkeypatch.setenv(ISA_ENV_VAR, "scalar")
    assert OPS.isa_level() == 0
    monkeypatch.setenv(ISA_ENV_VAR, "AVX2")   # names are case-insensitive
    assert OPS.isa_level() == isa_tiers.Isa.AVX2
    monkeypatch.delenv(ISA_ENV_VAR)
    assert OPS.isa_level() == isa_tiers.NAMES[OPS.best_isa]
    with pytest.raises(ConfigError, match="^isa: unknown ISA tier 'bogus'"):
        OPS.isa_level("bogus")


def test_build_without_vnni_offers_avx2_and_scalar(monkeypatch):
    """The tiers' #ifdef guards: a build without VNNI offers and runs the AVX2 path, even under a
    VNNI cap (where the CPU has that tier; else the cap is a ConfigError naming the variable)."""
    if not library.cpu_supported():
        pytest.skip("needs AVX2")
    flags = (*library.CXX_FLAGS, "-mno-avx512vnni", "-mno-avxvnni")
    ops = ActQuantOps(library.bind(library.build(flags, name="cpu-native-novnni")))
    assert ops.available_isas == ("scalar", "avx2")
    monkeypatch.setenv(ISA_ENV_VAR, "avx512vnni")
    packed = pack(*quantize_int8(torch.randn(OUTPUTS, 96)), None)
    if isa_tiers.Isa.AVX512VNNI in isa_tiers.cpu_tiers():
        assert ops.isa_level() == isa_tiers.Isa.AVX2
    else:
        with pytest.raises(ConfigError, match=f"^{ISA_ENV_VAR}='avx512vnni': this CPU lacks"):
            ops.act_linear(torch.randn(1, 96), packed, None)
    monkeypatch.delenv(ISA_ENV_VAR)
    x = torch.randn(3, 96)
    assert torch.equal(ops.act_linear(x, packed, None), OPS.act_linear(x, packed, None, isa="avx2"))
