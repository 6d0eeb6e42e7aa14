"""The dense ops of the kernel interface (prepared linears, RMSNorm, silu * up): every backend
against the torch definitions, the cuda (and so emu) backend equal to the torch backend bit for
bit, the torch backend's fallbacks equal to the definitions bit for bit, and the model's dense
math reached only through its backend."""
from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from runtime import Engine, ModelRunner
from runtime.kernels import TorchKernels
from runtime.kernels.cpu import cpu_native
from runtime.kernels.torch_kernels import torch_dense
from runtime.kernels.cuda.cuda_backend import CudaKernels
from runtime.quantization.int4 import quantize_int4
from runtime.quantization.int8 import quantize_int8
from tests.factories import make_checkpoint, step_inputs

MODELS = Path(__file__).resolve().parents[3] / "runtime" / "models"
# The kernel modules behind the backend: the models name none of them.
FAST_PATH_MODULES = ("cpu_native", "cpu_native_bf16", "cpu_weight_only", "cpu_attention", "linear",
                     "weight_only_linear")
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def randn(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def backends(monkeypatch) -> dict:
    monkeypatch.setattr(CudaKernels, "_compile_all", lambda self: {})
    return {"torch": TorchKernels(), "torch_fast": TorchKernels(fast_paths=True, native=True),
            "cuda": CudaKernels(cpu_fallback=False)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 40])   # the native few-row kernels, then the GEMMs
def test_linear_and_linear_add_equal_f_linear(backends, dtype, rows):
    weight, bias = randn(24, 40, seed=1, dtype=dtype), randn(24, seed=2, dtype=dtype)
    x, residual = randn(rows, 40, seed=3, dtype=dtype), randn(rows, 24, seed=4, dtype=dtype)
    results = {}
    for name, backend in backends.items():
        prepared = backend.prepare_linear(weight, bias)
        y = backend.linear(x, prepared)
        assert y.shape == (rows, 24) and y.dtype == dtype
        torch.testing.assert_close(y.float(), F.linear(x, weight, bias).float(), **TOLERANCE[dtype])
        total = backend.linear_add(x, prepared, residual.clone())
        torch.testing.assert_close(total.float(), (residual + F.linear(x, weight, bias)).float(), **TOLERANCE[dtype])
        results[name] = (y, total)
    for name in ("torch_fast", "cuda"):
        assert all(torch.equal(a, b) for a, b in zip(results[name], results["torch"])), name


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 30])
def test_weight_only_linear_equals_the_reference(backends, mode, rows):
    weight = randn(40, 64, seed=5) * 0.1
    quantized = (*quantize_int8(weight), None) if mode == "int8" else quantize_int4(weight, 32)
    bias, x, residual = randn(40, seed=6), randn(rows, 64, seed=7), randn(rows, 40, seed=8)
    expected = torch_dense.weight_only_linear(x, *quantized, bias)
    results = []
    for backend in backends.values():
        prepared = backend.prepare_weight_only_linear(*quantized, bias)
        # the stored format as is, not repacked (held in huge pages on a CPU: kernels/cpu/weight_memory.py)
        assert prepared.weight.dtype == quantized[0].dtype and torch.equal(prepared.weight, quantized[0])
        results.append((backend.linear(x, prepared), backend.linear_add(x, prepared, residual.clone())))
        torch.testing.assert_close(results[-1][0], expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(results[-1][1], residual + expected, atol=1e-4, rtol=1e-4)
    assert all(torch.equal(a, b) for other in results[1:] for a, b in zip(other, results[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_silu_mul_equal_their_definitions(backends, dtype):
    x, weight = randn(7, 48, seed=9, dtype=dtype), randn(48, seed=10, dtype=dtype)
    gate_up = randn(7, 2 * 48, seed=11, dtype=dtype) * 4
    strided = randn(48, 7, seed=12, dtype=dtype).t()   # columns strided: the torch definitions run
    for backend in backends.values():
        torch.testing.assert_close(backend.rms_norm(x, weight, 1e-5).float(),
                                   torch_dense.rms_norm(x, weight, 1e-5).float(), **TOLERANCE[dtype])
        torch.testing.assert_close(backend.silu_mul(gate_up).float(), torch_dense.silu_mul(gate_up).float(),
                                   **TOLERANCE[dtype])
        assert torch.equal(backend.rms_norm(strided, weight, 1e-5), torch_dense.rms_norm(strided, weight, 1e-5))
        assert backend.rms_norm(x, weight, 1e-5).dtype == backend.silu_mul(gate_up).dtype == dtype
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(torch_dense.silu_mul(gate_up), F.silu(gate) * up)
    if dtype == torch.float32:
        assert torch.equal(torch_dense.rms_norm(x, weight, 1e-5), F.rms_norm(x, (48,), weight, 1e-5))


def test_the_switch_leaves_the_torch_definitions(monkeypatch):
    monkeypatch.setenv(cpu_native.ENV_VAR, "0")
    backend = TorchKernels(fast_paths=True, native=True)
    x, weight, gate_up = randn(3, 16, seed=13), randn(16, seed=14), randn(3, 32, seed=15)
    assert torch.equal(backend.rms_norm(x, weight, 1e-6), torch_dense.rms_norm(x, weight, 1e-6))
    assert torch.equal(backend.silu_mul(gate_up), torch_dense.silu_mul(gate_up))
    assert backend.native_dense_ops() == {}


class Recording(TorchKernels):
    """The CPU default backend, counting the model's calls of its dense ops."""

    def __init__(self):
        super().__init__(fast_paths=True, native=True)
        self.calls = collections.Counter()

    def prepare_linear(self, weight, bias, impl=None):
        self.calls["prepare_linear"] += 1
        return super().prepare_linear(weight, bias, impl)

    def linear(self, x, weight):
        self.calls["linear"] += 1
        return super().linear(x, weight)

    def linear_add(self, x, weight, residual):
        self.calls["linear_add"] += 1
        return super().linear_add(x, weight, residual)

    def rms_norm(self, x, weight, eps):
        self.calls["rms_norm"] += 1
        return super().rms_norm(x, weight, eps)

    def silu_mul(self, x):
        self.calls["silu_mul"] += 1
        return super().silu_mul(x)


def test_the_model_runs_its_dense_math_through_its_backend(tmp_path):
    """Every matmul weight prepared by the backend; every norm, matmul and gated product one of its ops."""
    make_checkpoint(tmp_path, "llama")
    engine = Engine.from_dir(tmp_path, tokens_per_block=4)
    recording = Recording()
    runner = ModelRunner(engine, num_blocks=8, kernels=recording)
    num_layers = engine.model_config.num_layers
    assert recording.calls == {"prepare_linear": 4 * num_layers + 1}
    assert all(linear.weight is runner.model.w[name + ".weight"] for name, linear in runner.model.linears.items())
    recording.calls.clear()
    runner.forward(step_inputs([([5, 6, 7], 0, [0])]))
    assert recording.calls == {"rms_norm": 2 * num_layers + 1, "linear": 2 * num_layers + 1,
                               "linear_add": 2 * num_layers, "silu_mul": num_layers}


@pytest.mark.parametrize("path", sorted(MODELS.glob("*.py")), ids=lambda p: p.name)
def test_the_models_import_no_kernel_fast_path(path):
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[-1])
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[-1] for alias in node.names)
    assert not imported & set(FAST_PATH_MODULES)
