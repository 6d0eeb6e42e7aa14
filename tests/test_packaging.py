"""The wheel as a user installs it: built from this tree, installed into a fresh virtual
environment outside the checkout, then every module imported, the native CPU kernels compiled
from the installed source and a few greedy steps run through GptSession and the Executor.

The environment borrows this one's dependencies (torch, ...) through a path file, which adds the
directory to sys.path without running its path files: the checkout's editable install stays
invisible, so a module or data file missing from the wheel fails here.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY_PACKAGES = ("batch_manager", "runtime", "cuda_src")

# Runs inside the fresh environment: imports everything, compiles, generates; prints one JSON line.
PROBE = r"""
import importlib, json, os, pkgutil, sys
import torch
from safetensors.torch import save_file

root_dir = sys.argv[1]
modules = []
for package_name in ("batch_manager", "runtime", "cuda_src"):
    package = importlib.import_module(package_name)
    modules.append(package_name)
    for info in pkgutil.walk_packages(package.__path__, package_name + "."):
        importlib.import_module(info.name)
        modules.append(info.name)

from runtime.kernels.cpu import cpu_native
from runtime.kernels.cuda import sources
native_built = cpu_native.native_ops() is not None
cuda_sources = {name: len(sources.read(name)) for name in sources.source_names()}

# A tiny random LLaMA checkpoint, HF names.
vocab, hidden, inter, layers, heads, kv_heads = 96, 32, 64, 2, 4, 2
gen = torch.Generator().manual_seed(0)
rand = lambda *shape: torch.randn(*shape, generator=gen) * 0.3
kv = kv_heads * hidden // heads
tensors = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden),
           "lm_head.weight": rand(vocab, hidden)}
for i in range(layers):
    p = f"model.layers.{i}."
    tensors.update({p + "input_layernorm.weight": torch.ones(hidden),
                    p + "post_attention_layernorm.weight": torch.ones(hidden),
                    p + "self_attn.q_proj.weight": rand(hidden, hidden), p + "self_attn.k_proj.weight": rand(kv, hidden),
                    p + "self_attn.v_proj.weight": rand(kv, hidden), p + "self_attn.o_proj.weight": rand(hidden, hidden),
                    p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
                    p + "mlp.down_proj.weight": rand(hidden, inter)})
checkpoint = os.path.join(root_dir, "checkpoint")
os.makedirs(checkpoint, exist_ok=True)
save_file(tensors, os.path.join(checkpoint, "model.safetensors"))
with open(os.path.join(checkpoint, "config.json"), "w") as f:
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
               "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
               "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 128,
               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
               "bos_token_id": 1, "eos_token_id": 2}, f)

from runtime import Engine, GenerationInput, GenerationOutput, GptSession, SamplingConfig, WorldConfig
engine = Engine.from_dir(checkpoint)
session = GptSession(GptSession.Config(max_batch_size=1, max_beam_width=1, max_sequence_length=32),
                     engine.model_config, WorldConfig(), engine)
prompt = [5, 17, 33, 8]
inp = GenerationInput(95, 0, torch.tensor([prompt], dtype=torch.int32), torch.tensor([4], dtype=torch.int32),
                      packed=False)
inp.max_new_tokens = 6
out = GenerationOutput(ids=torch.empty(0, dtype=torch.int32), lengths=torch.empty(0, dtype=torch.int32))
session.generate(out, inp, SamplingConfig(beam_width=1))
session_tokens = out.ids[0, 0, 4:10].tolist()

from batch_manager.executor import Executor, ExecutorConfig, ModelType, Request
with Executor(checkpoint, ModelType.DECODER_ONLY, ExecutorConfig()) as executor:
    request_id = executor.enqueue_request(Request(prompt, 6))
    executor_tokens = []
    while True:
        responses = executor.await_responses(request_id, timeout=30.0)
        assert responses and not responses[-1].has_error(), responses
        executor_tokens = responses[-1].result.output_token_ids[0][4:]
        if responses[-1].result.is_final:
            break

import batch_manager
print(json.dumps({"cache_dir": os.environ["XDG_CACHE_HOME"], "package_file": batch_manager.__file__, "modules": modules, "native_built": native_built,
                  "cuda_sources": cuda_sources, "session_tokens": session_tokens,
                  "executor_tokens": executor_tokens}))
"""


def _tracked_modules() -> set[str]:
    """Dotted names of every module the checkout holds under the library packages."""
    names = set()
    for package in LIBRARY_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel path, the probe's JSON) — the wheel is built and installed once per run."""
    work = tmp_path_factory.mktemp("packaging")
    # NOTE: built from a copy of the source: setuptools builds through the tree's build/ directory
    # and keeps stale files there, so a module moved since an earlier build would ship twice.
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                                                 "__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(work / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (work / "dist").glob("batch_manager-*.whl")

    env_dir = work / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    env_python = env_dir / "bin" / "python"
    env_site = subprocess.run([str(env_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    dependency_dirs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(env_site, "dependencies.pth").write_text("\n".join(sorted(dependency_dirs)) + "\n")
    installed_wheel = subprocess.run([sys.executable, "-m", "pip", "--python", str(env_python), "install", "-q",
                                      "--no-deps", str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed_wheel.returncode == 0, installed_wheel.stderr[-3000:]

    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["XDG_CACHE_HOME"] = str(work / "cache")   # the native kernels compile afresh
    env.pop("BATCH_MANAGER_EMU_CACHE", None)
    run_dir = work / "run"                         # outside the checkout: no import from the tree
    run_dir.mkdir()
    probe = subprocess.run([str(env_python), "-c", PROBE, str(run_dir)], cwd=run_dir, env=env,
                           capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0, probe.stderr[-5000:]
    return wheel, json.loads(probe.stdout.strip().splitlines()[-1])


def installed_cache(report: dict) -> Path:
    return Path(report["cache_dir"])


def test_wheel_ships_every_module_and_runtime_file(installed):
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    for module in _tracked_modules():
        path = module.replace(".", "/")
        assert f"{path}.py" in names or f"{path}/__init__.py" in names, module
    data_files = [path.relative_to(ROOT).as_posix() for pattern in ("*.cu", "*.cuh", "*.h", "*.cpp")
                  for package in LIBRARY_PACKAGES for path in (ROOT / package).rglob(pattern)]
    assert "runtime/kernels/cpu/ops.cpp" in data_files and "runtime/kernels/cpu/vec.h" in data_files and "cuda_src/emu/shim.h" in data_files
    assert sorted(set(data_files) - names) == []
    assert not any(name.startswith(("tests/", "samples/")) for name in names)


def test_installed_package_imports_everything_outside_the_checkout(installed):
    _, report = installed
    assert not Path(report["package_file"]).resolve().is_relative_to(ROOT)
    assert set(report["modules"]) == _tracked_modules()
    assert set(report["cuda_sources"]) == {path.name for path in (ROOT / "cuda_src").glob("*.cu")}


def test_installed_package_compiles_native_kernels_and_generates(installed):
    _, report = installed
    from runtime.kernels.cpu import library
    from runtime.kernels.cuda import emu_backend
    assert report["native_built"] == (library.cpu_supported() and emu_backend.compiler_available())
    if report["native_built"]:   # compiled from the installed source into the fresh cache
        assert list((installed_cache(report) / "batch_manager" / "native").glob("cpu-native-*.so"))
    assert len(report["session_tokens"]) == 6
    assert report["executor_tokens"] == report["session_tokens"]
