"""The declared kernel-backend interface: every backend class defines every operation itself (no
op silently inherited from another backend), with the Protocol's parameters, and every backend
`get_kernels` builds is a KernelBackend. The emu backend is the one declared exception: it is the
cuda backend's code on the CPU and overrides none of its ops."""
from __future__ import annotations

import inspect

import pytest
import torch

import runtime.kernels as kernels_pkg
from runtime.kernels import KERNEL_OPS, KernelBackend, TorchKernels, get_kernels
from runtime.kernels.cuda.cuda_backend import CudaKernels
from runtime.kernels.cuda.emu_backend import EmuKernels

EXPECTED_OPS = {"write_kv", "copy_blocks", "decode_attention", "context_attention", "dense_attention", "uniforms",
                "apply_penalties", "ban_tokens", "repeat_ngram_bans", "greedy", "log_softmax", "top_k_top_p_mask",
                "sample", "beam_candidates", "apply_token_bitmask", "apply_min_p", "top_log_probs",
                "prepare_linear", "prepare_weight_only_linear", "prepare_block_linear", "prepare_decode_step", "linear", "linear_add", "rms_norm",
                "silu_mul"}


def _parameters(function) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


def test_the_protocol_lists_every_op_with_a_docstring():
    assert set(KERNEL_OPS) == EXPECTED_OPS
    for op in KERNEL_OPS:
        assert inspect.getdoc(getattr(KernelBackend, op)), op


@pytest.mark.parametrize("backend_class", [TorchKernels, CudaKernels], ids=lambda c: c.__name__)
def test_each_backend_defines_every_op_itself(backend_class):
    assert isinstance(backend_class.name, str)
    missing = [op for op in KERNEL_OPS if op not in vars(backend_class)]
    assert not missing, f"{backend_class.__name__} inherits or lacks {missing}"
    for op in KERNEL_OPS:
        assert _parameters(getattr(backend_class, op)) == _parameters(getattr(KernelBackend, op)), op


def test_the_emu_backend_runs_the_cuda_ops_unchanged():
    assert issubclass(EmuKernels, CudaKernels) and EmuKernels.name == "emu"
    assert not [op for op in KERNEL_OPS if op in vars(EmuKernels)]


def test_the_cuda_backend_keeps_no_other_backend_as_a_base():
    assert CudaKernels.__mro__ == (CudaKernels, object)
    assert TorchKernels.__mro__ == (TorchKernels, object)


def test_every_built_backend_is_a_kernel_backend(monkeypatch, emu):
    monkeypatch.setattr(kernels_pkg, "_cuda_available", lambda: True)
    monkeypatch.setattr(CudaKernels, "_compile_all", lambda self: {})
    for name in ("torch", "cuda", "emu"):
        backend = get_kernels(name)
        assert isinstance(backend, KernelBackend) and backend.name == name
    assert get_kernels("torch").cpu_attention is not None


def test_the_cuda_backend_delegates_host_ops_to_the_torch_backend(monkeypatch):
    """The ops without a kernel run the reference on the caller's tensors, whatever cpu_fallback says."""
    monkeypatch.setattr(CudaKernels, "_compile_all", lambda self: {})
    backend = CudaKernels(cpu_fallback=False)
    tokens = torch.tensor([5, 6, 7, 5, 6])
    assert backend.repeat_ngram_bans(tokens, 3).tolist() == [7]
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    assert backend.top_k_top_p_mask(logits, torch.tensor([2]), torch.tensor([0.0])).tolist() == [[False, True, True,
                                                                                                   False]]
    q, k = torch.randn(3, 2, 4), torch.randn(3, 1, 4)
    torch.testing.assert_close(backend.dense_attention(q, k, k, 0, 0.5, None),
                               TorchKernels().dense_attention(q, k, k, 0, 0.5, None))
