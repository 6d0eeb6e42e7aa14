"""samples.microbench.gemv_bandwidth runs end to end on a small shape: every format this machine
runs timed against the measured bandwidth."""
from __future__ import annotations

import pytest
import torch

from runtime.kernels.cpu.act_quant import act_quant_ops
from runtime.kernels.cpu.blocks import block_ops
from runtime.kernels.cpu.cpu_native import native_ops
from samples.microbench import gemv_bandwidth


def test_every_format_is_timed_against_the_bandwidth(capsys):
    results = gemv_bandwidth.main(["--threads", "1", "--shapes", "64x128", "--bandwidth-gib", "0.01",
                                   "--stream-mib", "1", "--repeats", "1"])
    expected = set()
    if native_ops() is not None:
        expected |= {"float32", "bf16", "int8", "int4"}
    if act_quant_ops() is not None:
        expected |= {"int8+a8", "int4+a8"}
    if block_ops() is not None:
        expected |= {"q8_0", "q4_0"}
    measured = results[1]
    assert measured["bandwidth"] > 0
    assert {name for _, name in measured["gemv"]} == expected
    assert all(row["ms"] > 0 and row["bytes_per_s"] > 0 for row in measured["gemv"].values())
    assert "of the bandwidth" in capsys.readouterr().out or not expected


def test_bf16_is_timed_with_bf16_inputs():
    """The bf16 weights' GEMV gets bf16 activations, as the eager bf16 model and the fused step give
    it (with AVX512-BF16 the dot-product kernel): a float32 x would time the kernel that widens the
    weights instead, which no generation step runs there."""
    kernels = gemv_bandwidth.format_kernels(64, 128, 32)
    if "bf16" not in kernels:
        pytest.skip("the native bf16 kernels cannot run here")
    assert {name: dtype for name, (_, dtype) in kernels.items() if dtype != torch.float32} == {"bf16": torch.bfloat16}
