"""Engine directories (build_engine, the `python -m runtime.build` CLI, HF-dir defaults) and the
errors a bad checkpoint or engine directory raises."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import runtime
from runtime import BuildConfig, ConfigError, Engine, ModelRunner, WeightError, build_engine
from tests.factories import make_checkpoint

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARCHS = ("gpt2", "llama", "mistral", "qwen2")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> checkpoint dir (tiny factory models, max_position_embeddings 256)."""
    paths = {}
    for seed, arch in enumerate(ARCHS):
        paths[arch] = tmp_path_factory.mktemp(arch)
        make_checkpoint(paths[arch], arch, seed=seed)
    return paths


@pytest.fixture
def llama_copy(checkpoints, tmp_path):
    """A private copy of the llama checkpoint that a test may damage."""
    path = tmp_path / "llama"
    shutil.copytree(checkpoints["llama"], path)
    return path


def context_logits(engine: Engine, num_tokens: int = 20) -> torch.Tensor:
    tokens = torch.randint(0, 128, (num_tokens,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    tpb = engine.build_config.tokens_per_block
    num_blocks = -(-num_tokens // tpb)
    return ModelRunner(engine, num_blocks).forward({
        "input_ids": tokens, "input_lengths": torch.tensor([num_tokens], dtype=torch.int32),
        "past_lengths": torch.zeros(1, dtype=torch.int32),
        "block_tables": torch.arange(num_blocks, dtype=torch.int32)[None],
        "return_context_logits": torch.ones(1, dtype=torch.bool)})["context_logits"]


def assert_same_weights(a: Engine, b: Engine) -> None:
    assert a.weights.keys() == b.weights.keys()
    for name in a.weights:
        assert a.weights[name].dtype == b.weights[name].dtype, name
        assert torch.equal(a.weights[name], b.weights[name]), name


# --- build_engine and engine directories ------------------------------------------------------

BUILD_FIELDS = dict(max_batch_size=8, max_input_len=40, max_seq_len=100, max_num_tokens=256, dtype="float32",
                    tokens_per_block=16, gather_context_logits=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_build_engine_round_trip(checkpoints, tmp_path, arch):
    built = build_engine(checkpoints[arch], tmp_path / "engine", **BUILD_FIELDS)
    expected = BuildConfig(**BUILD_FIELDS)
    assert built.build_config == expected
    assert sorted(os.listdir(tmp_path / "engine")) == ["engine.json", "weights.safetensors"]
    loaded = Engine.from_dir(tmp_path / "engine")
    assert loaded.build_config == expected
    assert loaded.model_config == Engine.from_dir(checkpoints[arch]).model_config
    assert_same_weights(loaded, built)
    assert ("lm_head" in loaded.weights) == (arch in ("llama", "mistral"))
    torch.testing.assert_close(context_logits(loaded), context_logits(Engine.from_dir(checkpoints[arch])),
                               atol=0, rtol=0)


def test_build_engine_converts_on_its_own_thread(checkpoints, tmp_path, monkeypatch):
    """The caller's thread keeps no OpenMP pool of the conversion (runtime.engine.build_engine's
    NOTE): the work runs on another thread, its errors are raised on the caller's."""
    import threading
    threads = []
    save = Engine.save
    monkeypatch.setattr(Engine, "save", lambda self, d: (threads.append(threading.get_ident()), save(self, d))[1])
    build_engine(checkpoints["llama"], tmp_path / "engine")
    assert threads and threads[0] != threading.get_ident()
    with pytest.raises(ConfigError, match="max_batch_size"):
        build_engine(checkpoints["llama"], tmp_path / "bad", max_batch_size=0)


def test_engine_json_records_both_configs(checkpoints, tmp_path):
    built = build_engine(checkpoints["mistral"], tmp_path, **BUILD_FIELDS)
    data = json.loads((tmp_path / "engine.json").read_text())
    assert data["format"] == "batch-manager-engine" and data["version"] == 1
    assert data["build"] == BuildConfig(**BUILD_FIELDS).to_dict()
    assert data["model"]["sliding_window"] == 8 and data["model"]["num_kv_heads"] == 2
    assert data["model"] == built.model_config.to_dict()


@pytest.mark.parametrize("dtype,alias", [("float16", "fp16"), ("bfloat16", "bf16")])
def test_build_engine_stores_the_build_dtype(checkpoints, tmp_path, dtype, alias):
    build_engine(checkpoints["llama"], tmp_path, dtype=alias)
    with safe_open(os.fspath(tmp_path / "weights.safetensors"), framework="pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"F16" if dtype == "float16" else "BF16"}
    loaded = Engine.from_dir(tmp_path)
    assert loaded.build_config.dtype == dtype
    assert_same_weights(loaded, Engine.from_dir(checkpoints["llama"], dtype=dtype))


def test_engine_dir_overrides_replace_recorded_limits(checkpoints, tmp_path):
    build_engine(checkpoints["qwen2"], tmp_path, **BUILD_FIELDS)
    loaded = Engine.from_dir(tmp_path, max_batch_size=2, tokens_per_block=4)
    assert loaded.build_config == BuildConfig(**dict(BUILD_FIELDS, max_batch_size=2, tokens_per_block=4))
    with pytest.raises(ConfigError, match="max_input_len"):
        Engine.from_dir(tmp_path, max_input_len=101)  # > the recorded max_seq_len 100


# --- HF directory defaults (runtime/config.py default_build_config) ---------------------------

def test_hf_dir_defaults(checkpoints):
    engine = Engine.from_dir(checkpoints["gpt2"])
    assert engine.build_config == BuildConfig(max_seq_len=256, max_input_len=255, dtype="float32")
    assert engine.source_dir == os.fspath(checkpoints["gpt2"])


def test_hf_dir_defaults_cap_max_seq_len_at_2048(tmp_path):
    make_checkpoint(tmp_path, "llama", max_position_embeddings=4096)
    assert Engine.from_dir(tmp_path).build_config == BuildConfig(max_seq_len=2048, max_input_len=2047)


def test_hf_dir_overrides(checkpoints):
    engine = Engine.from_dir(checkpoints["llama"], max_seq_len=100, max_batch_size=3, dtype="half")
    assert engine.build_config == BuildConfig(max_seq_len=100, max_input_len=99, max_batch_size=3,
                                              dtype="float16")


def test_half_precision_checkpoint_loads_in_float32_by_default(checkpoints, tmp_path):
    tensors = load_file(os.path.join(checkpoints["llama"], "model.safetensors"))
    save_file({name: t.half() for name, t in tensors.items()}, os.fspath(tmp_path / "model.safetensors"))
    config = json.loads((checkpoints["llama"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, dtype="float16")))
    engine = Engine.from_dir(tmp_path)
    assert engine.build_config.dtype == "float32"
    assert torch.equal(engine.weights["embed_tokens"], tensors["model.embed_tokens.weight"].half().float())


def test_learned_positions_bound_max_seq_len(checkpoints):
    with pytest.raises(ConfigError, match="max_seq_len"):
        Engine.from_dir(checkpoints["gpt2"], max_seq_len=257)  # n_positions is 256


def test_unsupported_dtype(checkpoints):
    with pytest.raises(ConfigError, match="dtype.*float64"):
        Engine.from_dir(checkpoints["llama"], dtype="float64")


# --- the CLI ----------------------------------------------------------------------------------

def run_build_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.build", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


def test_build_cli_writes_engine(checkpoints, tmp_path):
    out = tmp_path / "engine"
    result = run_build_cli("--checkpoint", os.fspath(checkpoints["llama"]), "--output", os.fspath(out),
                           "--dtype", "bfloat16", "--max-batch-size", "3", "--max-seq-len", "128",
                           "--max-num-tokens", "512", "--tokens-per-block", "8", "--gather-all-token-logits")
    assert result.returncode == 0, result.stderr
    expected = BuildConfig(max_batch_size=3, max_seq_len=128, max_input_len=127, max_num_tokens=512,
                           dtype="bfloat16", tokens_per_block=8, gather_context_logits=True,
                           gather_generation_logits=True)
    loaded = Engine.from_dir(out)
    assert loaded.build_config == expected
    assert_same_weights(loaded, Engine.from_dir(checkpoints["llama"], dtype="bfloat16"))


def test_build_cli_reports_errors_without_traceback(tmp_path):
    result = run_build_cli("--checkpoint", os.fspath(tmp_path / "missing"), "--output", os.fspath(tmp_path / "out"))
    assert result.returncode == 2
    assert "error:" in result.stderr and "not a directory" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


# --- checkpoint errors ------------------------------------------------------------------------

def test_unknown_architecture(llama_copy):
    config = json.loads((llama_copy / "config.json").read_text())
    config.update(model_type="bert", architectures=["BertModel"])
    (llama_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="bert") as info:
        Engine.from_dir(llama_copy)
    assert "supported: gpt2, llama, mistral, qwen2" in str(info.value)


@pytest.mark.parametrize("field,value", [("num_attention_heads", 0), ("hidden_size", "64"), ("vocab_size", 12.5)])
def test_config_field_not_a_positive_integer(llama_copy, field, value):
    config = json.loads((llama_copy / "config.json").read_text())
    config[field] = value
    (llama_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"{field} must be a positive integer"):
        Engine.from_dir(llama_copy)


def test_gpt2_zero_heads(checkpoints, tmp_path):
    shutil.copytree(checkpoints["gpt2"], tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, n_head=0)))
    with pytest.raises(ConfigError, match="n_head"):
        Engine.from_dir(tmp_path)


def rewrite_tensors(directory, edit) -> None:
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_missing_tensor(llama_copy):
    rewrite_tensors(llama_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        Engine.from_dir(llama_copy)


@pytest.mark.parametrize("name,shape,reported", [
    ("model.norm.weight", (63,), "final_norm.weight"),
    ("model.layers.0.self_attn.o_proj.weight", (64, 60), "layers.0.out.weight"),
    # Parts fused at load time are named as the checkpoint names them.
    ("model.layers.1.self_attn.k_proj.weight", (32, 60), "model.layers.1.self_attn.k_proj.weight"),
    ("model.layers.1.self_attn.v_proj.weight", (33, 64), "model.layers.1.self_attn.v_proj.weight"),
    ("model.layers.0.mlp.gate_proj.weight", (96, 63), "model.layers.0.mlp.gate_proj.weight"),
])
def test_misshaped_tensor(llama_copy, name, shape, reported):
    rewrite_tensors(llama_copy, lambda t: t.update({name: torch.zeros(shape)}))
    with pytest.raises(WeightError, match=f"'{reported}' has shape {list(shape)}".replace("[", r"\[")):
        Engine.from_dir(llama_copy)


def test_gpt2_conv1d_weight_with_wrong_rank(checkpoints, tmp_path):
    shutil.copytree(checkpoints["gpt2"], tmp_path, dirs_exist_ok=True)
    rewrite_tensors(tmp_path, lambda t: t.update({"transformer.h.0.attn.c_attn.weight": torch.zeros(2, 64, 192)}))
    with pytest.raises(WeightError, match="transformer.h.0.attn.c_attn.weight"):
        Engine.from_dir(tmp_path)


def test_integer_tensor(llama_copy):
    rewrite_tensors(llama_copy, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}))
    with pytest.raises(WeightError, match="final_norm.weight.*dtype"):
        Engine.from_dir(llama_copy)


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe\x00garbage"], ids=["syntax", "array", "bytes"])
def test_invalid_config_json(llama_copy, content):
    (llama_copy / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match="config.json"):
        Engine.from_dir(llama_copy)


def test_unreadable_config_json(llama_copy):
    (llama_copy / "config.json").unlink()
    (llama_copy / "config.json").mkdir()  # exists, but cannot be read as a file
    with pytest.raises(ConfigError, match="config.json: cannot read"):
        Engine.from_dir(llama_copy)


class _CreatesMarkerWhenUnpickled:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_pickle_checkpoint_is_refused_and_never_unpickled(checkpoints, tmp_path):
    live = tmp_path / "live-marker"
    pickle.loads(pickle.dumps(_CreatesMarkerWhenUnpickled(os.fspath(live)))).close()
    assert live.exists()  # the payload really acts when unpickled

    directory, marker = tmp_path / "ckpt", tmp_path / "marker"
    directory.mkdir()
    shutil.copy(checkpoints["llama"] / "config.json", directory / "config.json")
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps(_CreatesMarkerWhenUnpickled(os.fspath(marker))))
    with pytest.raises(WeightError, match="pickle") as info:
        Engine.from_dir(directory)
    assert "pytorch_model.bin" in str(info.value)
    assert not marker.exists()


def test_nonexistent_directory(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        Engine.from_dir(tmp_path / "nowhere")


def test_directory_without_config(tmp_path):
    with pytest.raises(ConfigError, match="engine.json.*config.json"):
        Engine.from_dir(tmp_path)


def test_not_a_safetensors_file(llama_copy):
    (llama_copy / "model.safetensors").write_bytes(b"\x00" * 64 + b"definitely not safetensors")
    with pytest.raises(WeightError, match="model.safetensors: not a readable safetensors file"):
        Engine.from_dir(llama_copy)


def test_sharded_index_pointing_at_missing_shard(checkpoints, tmp_path):
    make_checkpoint(tmp_path, "llama", seed=1, max_shard_size="100KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(WeightError, match=shards[-1].name):
        Engine.from_dir(tmp_path)


# --- engine.json errors -----------------------------------------------------------------------

@pytest.fixture
def engine_dir(checkpoints, tmp_path):
    build_engine(checkpoints["llama"], tmp_path / "engine", max_seq_len=128)
    return tmp_path / "engine"


def edit_engine_json(directory, edit) -> None:
    data = json.loads((directory / "engine.json").read_text())
    edit(data)
    (directory / "engine.json").write_text(json.dumps(data))


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["build"].update(max_batch_size=-1), "max_batch_size: must be a positive integer, got -1"),
    (lambda d: d["build"].update(tokens_per_block=0), "tokens_per_block"),
    (lambda d: d["build"].update(max_queue_size=3), r"build config: unknown fields \['max_queue_size'\]"),
    (lambda d: d["model"].update(attention="flash"), r"model config: unknown fields \['attention'\]"),
    (lambda d: d["model"].update(architecture="bert"), "architecture: unsupported 'bert'"),
    (lambda d: d["model"].update(rope={"bogus": 1}), "bogus"),
    (lambda d: d.update(version=2), "unknown format/version"),
    (lambda d: d.update(build=[1]), "'model' and 'build' must be objects"),
], ids=["negative-batch", "zero-block", "unknown-build-field", "unknown-model-field", "architecture",
        "rope-field", "version", "build-not-object"])
def test_invalid_engine_json(engine_dir, edit, message):
    edit_engine_json(engine_dir, edit)
    with pytest.raises(ConfigError, match=message):
        Engine.from_dir(engine_dir)


def test_engine_dir_missing_weights(engine_dir):
    (engine_dir / "weights.safetensors").unlink()
    with pytest.raises(WeightError, match="no \\*.safetensors"):
        Engine.from_dir(engine_dir)


def test_engine_weights_missing_tensor(engine_dir):
    path = os.fspath(engine_dir / "weights.safetensors")
    tensors = load_file(path)
    del tensors["layers.1.qkv.weight"]
    save_file(tensors, path)
    with pytest.raises(WeightError, match="missing tensor 'layers.1.qkv.weight'"):
        Engine.from_dir(engine_dir)


def test_errors_are_value_errors():
    assert issubclass(runtime.ConfigError, ValueError) and issubclass(runtime.WeightError, ValueError)
