"""Choosing the kernel backend: configuration over BATCH_MANAGER_KERNELS over the default (cuda
when a CUDA device and CuPy are present, torch otherwise); unknown or unavailable names fail
clearly; every entry point (ModelRunner, GptSession, GptManager) goes through the same choice."""
from __future__ import annotations

import pytest
import torch

import runtime.kernels as kernels_pkg
from runtime import Engine, ModelRunner
from runtime.kernels import KERNELS_ENV_VAR, KernelBackendError, TorchKernels, get_kernels
from runtime.kernels.cuda.cuda_backend import CudaKernels
from runtime.kernels.cuda.emu_backend import EmuKernels
from tests.factories import make_checkpoint
from tests.runtime.kernels.conftest import paged_case


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(KERNELS_ENV_VAR, raising=False)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend a CUDA device and CuPy exist; the backend then builds without compiling anything."""
    monkeypatch.setattr(kernels_pkg, "_cuda_available", lambda: True)
    monkeypatch.setattr(CudaKernels, "_compile_all", lambda self: {})


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_checkpoint(path, "llama")
    return Engine.from_dir(path, tokens_per_block=4)


def test_default_is_torch_without_cuda(no_env, monkeypatch):
    monkeypatch.setattr(kernels_pkg, "_cuda_available", lambda: False)
    assert type(get_kernels()) is TorchKernels


def test_default_is_cuda_with_a_device_and_cupy_and_keeps_cpu_runners_working(no_env, fake_cuda, emu, reference):
    backend = get_kernels()
    assert isinstance(backend, CudaKernels) and backend.cpu_fallback
    q, clean, _, table, lens = paged_case([9, 3], 4, 2, 16, 4, torch.float32)
    torch.testing.assert_close(backend.decode_attention(q, *clean, table, lens, 0.25, None),
                               reference.decode_attention(q, *clean, table, lens, 0.25, None))


def test_an_explicit_cuda_backend_refuses_cpu_tensors(no_env, fake_cuda):
    backend = get_kernels("cuda")
    assert not backend.cpu_fallback
    q, clean, _, table, lens = paged_case([9], 4, 2, 16, 4, torch.float32)
    with pytest.raises(AssertionError, match="expected cuda"):
        backend.decode_attention(q, *clean, table, lens, 0.25, None)


def test_environment_variable_chooses(monkeypatch, emu):
    monkeypatch.setenv(KERNELS_ENV_VAR, "emu")
    assert isinstance(get_kernels(), EmuKernels)
    monkeypatch.setenv(KERNELS_ENV_VAR, "torch")
    assert type(get_kernels()) is TorchKernels


def test_configuration_wins_over_the_environment(monkeypatch, emu):
    monkeypatch.setenv(KERNELS_ENV_VAR, "torch")
    assert isinstance(get_kernels("emu"), EmuKernels)


def test_unknown_backend_names_its_origin(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV_VAR, "triton")
    with pytest.raises(KernelBackendError, match=f"'triton' \\(from {KERNELS_ENV_VAR}\\)"):
        get_kernels()
    with pytest.raises(ValueError, match="'tpu' \\(from configuration\\).*known: torch, cuda, emu"):
        get_kernels("tpu")


def test_unavailable_cuda_is_an_error_not_a_fallback(monkeypatch):
    monkeypatch.setattr(kernels_pkg, "_cuda_available", lambda: False)
    monkeypatch.setenv(KERNELS_ENV_VAR, "cuda")
    with pytest.raises(KernelBackendError, match="'cuda' .*unavailable.*CUDA device and CuPy"):
        get_kernels()


def test_unavailable_emu_is_an_error(monkeypatch):
    monkeypatch.setattr("runtime.kernels.cuda.emu_backend.compiler_available", lambda: False)
    with pytest.raises(KernelBackendError, match="'emu' .*unavailable.*compiler"):
        get_kernels("emu")


def test_model_runner_and_session_honour_configuration_and_environment(monkeypatch, engine, emu):
    from runtime import GptSession, WorldConfig
    monkeypatch.setenv(KERNELS_ENV_VAR, "emu")
    assert ModelRunner(engine, 4).kernels.name == "emu"
    assert ModelRunner(engine, 4, kernels="torch").kernels.name == "torch"
    session = GptSession(GptSession.Config(1, 1, 16), engine.model_config, WorldConfig(), engine)
    assert session.runner.kernels.name == "emu"
    monkeypatch.setenv(KERNELS_ENV_VAR, "torch")
    session = GptSession(GptSession.Config(1, 1, 16), engine.model_config, WorldConfig(), engine, kernels="emu")
    assert session.runner.kernels.name == "emu"
