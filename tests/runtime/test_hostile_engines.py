"""Engine directories and checkpoints with absurd or malicious contents fail at load with a clear
error: never an out-of-memory crash, never code execution. Each case runs in a subprocess capped
at 2 GiB of address space, so an attempted huge allocation fails the test instead of the machine."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime import build_engine
from tests.factories import make_checkpoint

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-hf")
    make_checkpoint(root / "hf", "llama")
    return root / "hf"


@pytest.fixture(scope="module")
def engine_dir(hf_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    build_engine(hf_dir, root / "engine", max_seq_len=64, max_input_len=32, tokens_per_block=4)
    return root / "engine"


def run_capped(code: str, limit_bytes: int = 3 << 30, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter with RLIMIT_AS = limit_bytes."""
    prelude = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({limit_bytes}, {limit_bytes}))
        sys.path.insert(0, {str(REPO)!r})
    """)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO)


def copy_engine(src: Path, dst: Path, edit_build=None, edit_model=None) -> Path:
    dst.mkdir()
    (dst / "weights.safetensors").write_bytes((src / "weights.safetensors").read_bytes())
    data = json.loads((src / "engine.json").read_text())
    if edit_build:
        data["build"].update(edit_build)
    if edit_model:
        data["model"].update(edit_model)
    (dst / "engine.json").write_text(json.dumps(data))
    return dst


def expect_clean_error(code: str, *fragments: str, timeout_s: float = 120) -> None:
    result = run_capped(code, timeout_s=timeout_s)
    assert result.returncode == 0, f"crashed or raised unexpectedly:\n{result.stdout}\n{result.stderr[-3000:]}"
    for fragment in fragments:
        assert fragment in result.stdout, result.stdout


LOAD_AND_RUN = """
    from runtime import Engine, GptSession, WorldConfig
    try:
        engine = Engine.from_dir({path!r})
        cfg = engine.build_config
        GptSession(GptSession.Config(cfg.max_batch_size, cfg.max_beam_width, cfg.max_seq_len),
                   engine.model_config, WorldConfig(), engine)
        print("LOADED")
    except ValueError as e:
        print("ERROR", e)
"""


@pytest.mark.parametrize("build, fragment", [
    (dict(max_batch_size=10 ** 9), "num_blocks"),
    (dict(max_seq_len=10 ** 10, max_input_len=10), "num_blocks"),
    (dict(tokens_per_block=10 ** 9), "num_blocks"),
    (dict(max_beam_width=10 ** 7), "num_blocks"),
    (dict(max_batch_size=-3), "max_batch_size"),
    (dict(max_num_tokens=0), "max_num_tokens"),
    (dict(tokens_per_block=2.5), "tokens_per_block"),
    (dict(dtype="float128"), "dtype"),
], ids=["batch", "seq-len", "block", "beam", "negative", "zero", "float", "dtype"])
def test_absurd_build_limits_fail_with_a_clear_error(engine_dir, tmp_path, build, fragment):
    path = copy_engine(engine_dir, tmp_path / "e", edit_build=build)
    expect_clean_error(LOAD_AND_RUN.format(path=str(path)), "ERROR", fragment)


@pytest.mark.parametrize("model, fragment", [
    (dict(vocab_size=10 ** 12), "embed_tokens"),
    (dict(hidden_size=1 << 30), "embed_tokens"),
    (dict(num_layers=10 ** 6), "layers.2"),
    (dict(num_kv_heads=3), "num_key_value_heads"),
    (dict(intermediate_size=-1), "intermediate_size"),
], ids=["vocab", "hidden", "layers", "kv-heads", "negative"])
def test_config_that_contradicts_the_weights_fails_at_load(engine_dir, tmp_path, model, fragment):
    path = copy_engine(engine_dir, tmp_path / "e", edit_model=model)
    expect_clean_error(LOAD_AND_RUN.format(path=str(path)), "ERROR", fragment)


def test_safetensors_header_claiming_a_terabyte_tensor(engine_dir, tmp_path):
    path = copy_engine(engine_dir, tmp_path / "e")
    header = json.dumps({"embed_tokens": {"dtype": "F32", "shape": [1 << 20, 1 << 20],
                                          "data_offsets": [0, 1 << 42]}}).encode()
    (path / "weights.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    expect_clean_error(LOAD_AND_RUN.format(path=str(path)), "ERROR")


def test_pickle_in_place_of_safetensors_is_never_executed(engine_dir, tmp_path):
    path = copy_engine(engine_dir, tmp_path / "e")
    marker = tmp_path / "executed"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (path / "weights.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    expect_clean_error(LOAD_AND_RUN.format(path=str(path)), "ERROR")
    (path / "weights.safetensors").write_bytes(pickle.dumps(Payload()))
    expect_clean_error(LOAD_AND_RUN.format(path=str(path)), "ERROR")
    assert not marker.exists()


def test_a_sane_engine_loads_under_the_same_cap(engine_dir):
    expect_clean_error(LOAD_AND_RUN.format(path=str(engine_dir)), "LOADED")


def _replace(path: Path, kind: str) -> None:
    """Make `path` a hostile non-regular or oversized file of the given kind."""
    path.unlink()
    if kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)   # no writer: a blocking open would wait forever
    elif kind == "directory":
        path.mkdir()
    elif kind == "oversized":   # valid JSON, 17 MiB of it
        path.write_bytes(b'{"pad": "' + b"x" * (17 << 20) + b'"}')
    elif kind == "nested":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "huge-int":   # over Python's int-from-string digit limit
        path.write_text('{"vocab_size": ' + "9" * 5000 + "}")
    elif kind == "not-utf8":
        path.write_bytes(b'{"model_type": "\xff\xfe"}')
    else:
        raise AssertionError(kind)


# kind -> a fragment of the error
HOSTILE_FILES = {"dev-zero": "not a regular file", "fifo": "not a regular file", "directory": "not a regular file",
                 "oversized": "16 MiB limit", "nested": "nested too deeply", "huge-int": "cannot parse",
                 "not-utf8": "cannot parse"}


@pytest.mark.parametrize("kind", sorted(HOSTILE_FILES))
@pytest.mark.parametrize("config_file", ["engine.json", "config.json"])
def test_hostile_config_file_is_a_config_error_naming_it(hf_dir, engine_dir, tmp_path, config_file, kind):
    if config_file == "engine.json":
        path = copy_engine(engine_dir, tmp_path / "e")
    else:
        path = Path(shutil.copytree(hf_dir, tmp_path / "hf"))
    _replace(path / config_file, kind)
    expect_clean_error(LOAD_AND_RUN.format(path=str(path)), "ERROR", config_file, HOSTILE_FILES[kind], timeout_s=60)


def test_hostile_safetensors_index_is_a_config_error_naming_it(hf_dir, tmp_path):
    path = Path(shutil.copytree(hf_dir, tmp_path / "hf"))
    (path / "model.safetensors.index.json").symlink_to("/dev/zero")
    expect_clean_error(LOAD_AND_RUN.format(path=str(path)), "ERROR", "model.safetensors.index.json",
                       "not a regular file", timeout_s=60)


def _copy_hf(hf_dir: Path, dst: Path, edit_config=None, edit_tensors=None) -> Path:
    from safetensors.torch import load_file, save_file
    shutil.copytree(hf_dir, dst)
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    if edit_tensors:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("theta", [0, -1.0, float("nan"), float("inf"), 10 ** 400])
def test_a_rope_theta_that_is_not_finite_and_positive_is_refused_at_load(hf_dir, engine_dir, tmp_path, theta):
    from runtime import ConfigError, Engine
    path = _copy_hf(hf_dir, tmp_path / "hf", edit_config=lambda c: c.update(rope_theta=theta, rope_parameters=None))
    with pytest.raises(ConfigError, match=r"config.json: rope_theta must be a finite number > 0"):
        Engine.from_dir(path)
    path = copy_engine(engine_dir, tmp_path / "e", edit_model=dict(
        rope=dict(theta=theta if theta != 10 ** 400 else float("inf"))))
    with pytest.raises(ConfigError, match=r"rope.theta: must be a finite number > 0"):
        Engine.from_dir(path)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_weight_is_refused_at_load_naming_the_tensor(hf_dir, tmp_path, value):
    from runtime import Engine, WeightError

    def poison(tensors):
        tensors["model.layers.0.mlp.down_proj.weight"][3, 5] = value

    path = _copy_hf(hf_dir, tmp_path / "hf", edit_tensors=poison)
    with pytest.raises(WeightError, match=r"tensor 'layers.0.mlp_out.weight' holds"):
        Engine.from_dir(path)


def test_a_float32_weight_past_float16_range_is_refused_in_float16(hf_dir, tmp_path):
    from runtime import Engine, WeightError

    def widen(tensors):
        tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = 1e6

    path = _copy_hf(hf_dir, tmp_path / "hf", edit_tensors=widen)
    Engine.from_dir(path)   # float32: fine
    with pytest.raises(WeightError, match=r"'layers.0.mlp_out.weight' holds 0 NaN and 1 infinite values \(as torch.float16\)"):
        Engine.from_dir(path, dtype="float16")


def test_a_non_finite_int4_scale_is_refused_at_load_naming_it(hf_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    from runtime import Engine, WeightError
    build_engine(hf_dir, tmp_path / "int4", max_seq_len=64, max_input_len=32, tokens_per_block=4, weight_only="int4")
    tensors = load_file(tmp_path / "int4" / "weights.safetensors")
    name = next(n for n in sorted(tensors) if n.endswith("_scale"))
    tensors[name].view(-1)[0] = float("inf")
    save_file(tensors, tmp_path / "int4" / "weights.safetensors", metadata={"format": "batch-manager-engine"})
    with pytest.raises(WeightError, match=rf"tensor '{name}' holds 0 NaN and 1 infinite"):
        Engine.from_dir(tmp_path / "int4")
