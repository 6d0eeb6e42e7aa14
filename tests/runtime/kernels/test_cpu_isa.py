"""One ISA tier enum and one setting for the native CPU layer (runtime/kernels/cpu/isa.py):
BATCH_MANAGER_CPU_ISA caps the tier of every kernel family; an unknown tier, or one this CPU lacks,
is a ConfigError naming the variable and the value. Every op family against its torch reference
with each tier this CPU has forced (higher tiers skip), at odd shapes: rows 1, 3, 8, 17; columns a
multiple of 32 but not of 256."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.config import ConfigError
from runtime.kernels.cpu import act_quant, cpu_native, isa
from runtime.kernels.cpu.cpu_native_bf16 import bf16_ops
from runtime.kernels.cpu.cpu_weight_only import weight_only_ops
from runtime.kernels.torch_kernels import torch_attention
from runtime.kernels.torch_kernels.torch_dense import weight_only_linear
from runtime.quantization.int4 import quantize_int4
from runtime.quantization.int8 import quantize_int8

pytestmark = pytest.mark.skipif(cpu_native.native_ops() is None, reason="the native CPU kernels cannot run here")
ROWS = (1, 3, 8, 17)
COLUMNS = (96, 160, 288)
OUTPUTS = 45   # not a multiple of any tile or unit
TIERS = [tier.name.lower() for tier in isa.Isa]


def force(monkeypatch, tier: str) -> None:
    if isa.NAMES[tier] not in isa.cpu_tiers():
        pytest.skip(f"this CPU lacks {tier} (has {', '.join(t.name.lower() for t in isa.cpu_tiers())})")
    monkeypatch.setenv(isa.ENV_VAR, tier)


def close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    assert got.shape == want.shape
    assert float((got.float() - want.float()).abs().max()) <= rtol * max(float(want.abs().max()), 1.0)


@pytest.mark.parametrize("tier", TIERS)
def test_linear_family_matches_its_references_under_each_tier(monkeypatch, tier):
    force(monkeypatch, tier)
    gen = torch.Generator().manual_seed(3)
    ops, bf16, wo, aq = cpu_native.native_ops(), bf16_ops(), weight_only_ops(), act_quant.act_quant_ops()
    assert wo.isa_level() <= isa.NAMES[tier] and aq.isa_level() <= isa.NAMES[tier]
    assert bf16.uses_dot_product == (isa.NAMES[tier] >= isa.Isa.AVX512BF16)
    for k in COLUMNS:
        weight, bias = torch.randn(OUTPUTS, k, generator=gen) * 0.1, torch.randn(OUTPUTS, generator=gen)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen)
            close(ops.linear(x, weight, bias), F.linear(x, weight, bias), 1e-5)
            xb, wb = x.bfloat16(), weight.bfloat16()
            close(bf16.linear(xb, wb, bias, out_dtype=torch.float32), F.linear(xb.float(), wb.float(), bias), 1e-5)
            q8, s8 = quantize_int8(weight)
            close(wo.int8_linear(x, q8, s8, bias), weight_only_linear(x, q8, s8, None, bias), 2e-5)
            q4, s4, m4 = quantize_int4(weight, 32)
            close(wo.int4_linear(x, q4, s4, m4, bias), weight_only_linear(x, q4, s4, m4, bias), 2e-5)
            for parts in ((q8, s8, None), (q4, s4, m4)):
                want = act_quant.int8_act_linear_reference(x, *parts, bias)
                close(aq.act_linear(x, act_quant.pack(*parts), bias), want, 1e-5)


@pytest.mark.parametrize("tier", TIERS)
def test_int8_weight_only_column_tails_under_each_tier(monkeypatch, tier):
    # int8 takes any column count: 3, 37 and 77 leave each tier's loops a remainder (the one-row
    # kernel's 4-vector step, its single vectors, the scalar tail; the tiles' vectors and tail)
    force(monkeypatch, tier)
    gen = torch.Generator().manual_seed(5)
    wo = weight_only_ops()
    for k in (3, 37, 77):
        weight, bias = torch.randn(OUTPUTS, k, generator=gen) * 0.1, torch.randn(OUTPUTS, generator=gen)
        q8, s8 = quantize_int8(weight)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen)
            close(wo.int8_linear(x, q8, s8, bias), weight_only_linear(x, q8, s8, None, bias), 2e-5)


@pytest.mark.parametrize("tier", TIERS)
def test_norm_activation_and_attention_match_their_references_under_each_tier(monkeypatch, tier):
    force(monkeypatch, tier)
    gen = torch.Generator().manual_seed(4)
    ops, bf16 = cpu_native.native_ops(), bf16_ops()
    for h in COLUMNS:
        for rows in ROWS:
            x, w = torch.randn(rows, 2 * h, generator=gen) * 3, torch.randn(h, generator=gen)
            close(ops.rms_norm(x[:, :h], w, 1e-5), F.rms_norm(x[:, :h], (h,), w, 1e-5), 1e-5)
            gate, up = x.chunk(2, dim=-1)
            close(ops.silu_mul(x), F.silu(gate) * up, 1e-5)
            close(bf16.silu_mul(x.bfloat16()), F.silu(gate.bfloat16().float()) * up.bfloat16().float(), 1e-2)
    num_blocks, tpb, kv_heads, head_dim = 16, 4, 2, 64
    k_cache = torch.randn(num_blocks, tpb, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, tpb, kv_heads, head_dim, generator=gen)
    for rows in ROWS:
        tables = torch.randint(0, num_blocks, (rows, 5), generator=gen).int()
        lens = torch.randint(1, 5 * tpb + 1, (rows,), generator=gen)
        q = torch.randn(rows, 6, head_dim, generator=gen)
        want = torch_attention.decode_attention(q, k_cache, v_cache, tables, lens, 0.125, None)
        close(ops.decode_attention(q, k_cache, v_cache, tables, lens, 0.125, None), want, 1e-5)
        kb, vb = k_cache.bfloat16(), v_cache.bfloat16()
        want_bf16 = torch_attention.decode_attention(q.bfloat16().float(), kb.float(), vb.float(), tables, lens,
                                                     0.125, None)
        close(bf16.decode_attention(q.bfloat16(), kb, vb, tables, lens, 0.125, None), want_bf16, 1e-2)


@pytest.mark.parametrize("value", ["sse9", "AVX-1024", " "])
def test_an_unknown_tier_is_a_config_error_naming_the_variable_and_value(monkeypatch, value):
    monkeypatch.setenv(isa.ENV_VAR, value)
    if not value.strip():   # blank: unset, the CPU's best
        assert weight_only_ops().isa_level() == max(weight_only_ops().tiers)
        return
    for call in (lambda: weight_only_ops().isa_level(), lambda: act_quant.act_quant_ops().isa_level(), bf16_ops):
        with pytest.raises(ConfigError, match=rf"^{isa.ENV_VAR}: unknown ISA tier {value!r}"):
            call()


def test_a_tier_this_cpu_lacks_is_a_config_error(monkeypatch):
    lacking = [tier for tier in isa.Isa if tier not in isa.cpu_tiers()]
    if not lacking:
        pytest.skip("this CPU has every tier")
    value = lacking[0].name.lower()
    monkeypatch.setenv(isa.ENV_VAR, value)
    for call in (lambda: weight_only_ops().isa_level(), lambda: act_quant.act_quant_ops().isa_level(), bf16_ops):
        with pytest.raises(ConfigError, match=rf"^{isa.ENV_VAR}={value!r}: this CPU lacks"):
            call()
    with pytest.raises(ConfigError, match=rf"^isa={value!r}: this CPU lacks"):
        weight_only_ops().isa_level(value)


def test_the_cap_picks_each_familys_best_tier_at_or_below_it():
    offered = (isa.Isa.SCALAR, isa.Isa.AVX2, isa.Isa.AVXVNNI, isa.Isa.AVX512VNNI)
    assert isa.best_at_or_below(isa.Isa.AVX512, offered) == isa.Isa.AVXVNNI
    assert isa.best_at_or_below(isa.Isa.AVX512BF16, offered) == isa.Isa.AVX512VNNI
    assert isa.best_at_or_below(isa.Isa.SCALAR, offered) == isa.Isa.SCALAR
    assert isa.best_at_or_below(isa.Isa.AVX512, (isa.Isa.SCALAR, isa.Isa.AVX2)) == isa.Isa.AVX2
