"""Hostile GGUF files: each damage to a valid tiny LLaMA file (truncation, magic, version, counts and
lengths past the file, unknown value or tensor types, offsets past the end, misshaped tensors,
metadata of the wrong type, an unknown architecture) is a ConfigError / WeightError (ValueErrors)
naming the field or tensor, found without reading past the file or allocating what it claims."""
from __future__ import annotations

import os
import struct

import gguf
import numpy as np
import pytest

from runtime import ConfigError, Engine, WeightError, save_gguf_tokenizer
from runtime.loading.gguf_file import GgufFile, read_header
from tests import factories
from tests.runtime.gguf_factories import write_gguf

HUGE = 1 << 62


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> bytes:
    model = factories.hf_model("llama", seed=1, num_hidden_layers=1)
    path = write_gguf(tmp_path_factory.mktemp("valid") / "valid.gguf", "llama", model)
    Engine.from_dir(path)   # it loads
    with open(path, "rb") as f:
        return f.read()


def after_key(data: bytes, key: str) -> int:
    """Offset of the value type that follows metadata key `key`."""
    needle = struct.pack("<Q", len(key)) + key.encode()
    return data.index(needle) + len(needle)


def after_tensor_name(data: bytes, name: str) -> int:
    """Offset of the n_dims field of tensor `name`'s info."""
    needle = struct.pack("<Q", len(name)) + name.encode()
    return data.index(needle) + len(needle)


def patch(data: bytes, offset: int, fmt: str, value) -> bytes:
    packed = struct.pack(fmt, value)
    return data[:offset] + packed + data[offset + len(packed):]


def tensor_field(data: bytes, name: str, field: str) -> int:
    """Offset of a tensor info's field: n_dims, ne0, ne1 (2-D tensors), type or offset."""
    at = after_tensor_name(data, name)
    num_dims = struct.unpack_from("<I", data, at)[0]
    fields = {"n_dims": at, "ne0": at + 4, "ne1": at + 12, "type": at + 4 + 8 * num_dims,
              "offset": at + 8 + 8 * num_dims}
    return fields[field]


Q_NAME = "blk.0.attn_q.weight"


def damage(name: str, data: bytes) -> bytes:
    tokens = after_key(data, "tokenizer.ggml.tokens")
    return {
        "empty": lambda: b"",
        "short_header": lambda: data[:20],
        "cut_in_metadata": lambda: data[:tokens + 100],
        "cut_in_tensor_infos": lambda: data[:after_tensor_name(data, Q_NAME) + 6],
        "cut_in_data": lambda: data[:-64],
        "magic": lambda: b"GGUX" + data[4:],
        "version": lambda: patch(data, 4, "<I", 99),
        "big_endian": lambda: patch(data, 4, ">I", 3),
        "tensor_count": lambda: patch(data, 8, "<Q", HUGE),
        "kv_count": lambda: patch(data, 16, "<Q", HUGE),
        "array_count": lambda: patch(data, tokens + 8, "<Q", HUGE),
        "string_length": lambda: patch(data, after_key(data, "general.architecture") + 4, "<Q", HUGE),
        "value_type": lambda: patch(data, after_key(data, "llama.block_count"), "<I", 99),
        "value_of_another_type": lambda: patch(data, after_key(data, "llama.block_count"), "<I", 6),  # float32
        "block_count": lambda: patch(data, after_key(data, "llama.block_count") + 4, "<I", 0xFFFFFFFF),
        "missing_key": lambda: data.replace(b"llama.embedding_length", b"llama.embedding_lengtX"),
        "architecture": lambda: data.replace(struct.pack("<Q", 5) + b"llama", struct.pack("<Q", 5) + b"mamba"),
        "tensor_type": lambda: patch(data, tensor_field(data, Q_NAME, "type"), "<I", 999),
        "integer_tensor_type": lambda: patch(data, tensor_field(data, Q_NAME, "type"), "<I", 26),   # I32
        "tensor_offset": lambda: patch(data, tensor_field(data, Q_NAME, "offset"), "<Q", HUGE),
        "unaligned_offset": lambda: patch(data, tensor_field(data, Q_NAME, "offset"), "<Q",
                                          struct.unpack_from("<Q", data, tensor_field(data, Q_NAME, "offset"))[0] + 4),
        "tensor_dims": lambda: patch(data, tensor_field(data, Q_NAME, "ne1"), "<Q", HUGE),
        "dims_overflowing_64_bits": lambda: patch(patch(data, tensor_field(data, Q_NAME, "ne0"), "<Q", 1 << 32),
                                                  tensor_field(data, Q_NAME, "ne1"), "<Q", 1 << 32),
        "too_many_dims": lambda: patch(data, tensor_field(data, Q_NAME, "n_dims"), "<I", 9),
        "misshaped_tensor": lambda: patch(data, tensor_field(data, Q_NAME, "ne1"), "<Q", 32),
        "freq_base_nan": lambda: patch(data, after_key(data, "llama.rope.freq_base") + 4, "<f", float("nan")),
        "freq_base_zero": lambda: patch(data, after_key(data, "llama.rope.freq_base") + 4, "<f", 0.0),
        "freq_base_negative": lambda: patch(data, after_key(data, "llama.rope.freq_base") + 4, "<f", -1.0),
        "freq_base_inf": lambda: patch(data, after_key(data, "llama.rope.freq_base") + 4, "<f", float("inf")),
        "norm_eps_nan": lambda: patch(data, after_key(data, "llama.attention.layer_norm_rms_epsilon") + 4, "<f",
                                      float("nan")),
        "head_count_over_embedding": lambda: patch(data, after_key(data, "llama.attention.head_count") + 4, "<I",
                                                   128),
        "nan_weight": lambda: patch(data, tensor_data(data, Q_NAME), "<f", float("nan")),
    }[name]()


def tensor_data(data: bytes, name: str) -> int:
    """Offset of the first byte of tensor `name`'s data."""
    _, tensors = read_header(data, len(data), "valid.gguf")
    return tensors[name].offset


# case -> (error class, text the message must hold)
CASES = {
    "empty": (ConfigError, "shorter than a GGUF header"),
    "short_header": (ConfigError, "shorter than a GGUF header"),
    "cut_in_metadata": (ConfigError, "'tokenizer.ggml.tokens'"),
    "cut_in_tensor_infos": (ConfigError, f"tensor '{Q_NAME}'"),
    "cut_in_data": (WeightError, "extend past the end of the file"),
    "magic": (ConfigError, "magic"),
    "version": (ConfigError, "version: unsupported 99"),
    "big_endian": (ConfigError, "big-endian"),
    "tensor_count": (ConfigError, "tensor_count"),
    "kv_count": (ConfigError, "kv_count"),
    "array_count": (ConfigError, "'tokenizer.ggml.tokens'"),
    "string_length": (ConfigError, "'general.architecture'"),
    "value_type": (ConfigError, "'llama.block_count': unknown value type 99"),
    "value_of_another_type": (ConfigError, "'llama.block_count': expected an integer"),
    "block_count": (ConfigError, "'llama.block_count': 4294967295 layers"),
    "missing_key": (ConfigError, "'llama.embedding_length': missing"),
    "architecture": (ConfigError, "general.architecture: unsupported 'mamba'"),
    "tensor_type": (WeightError, f"tensor '{Q_NAME}': unknown tensor type 999"),
    "integer_tensor_type": (WeightError, f"tensor '{Q_NAME}': type I32 cannot be de-quantized"),
    "tensor_offset": (WeightError, f"tensor '{Q_NAME}'"),
    "unaligned_offset": (WeightError, f"tensor '{Q_NAME}': offset"),
    "tensor_dims": (WeightError, f"tensor '{Q_NAME}'"),
    "dims_overflowing_64_bits": (WeightError, f"tensor '{Q_NAME}'"),
    "too_many_dims": (WeightError, f"tensor '{Q_NAME}': 9 dims"),
    "misshaped_tensor": (WeightError, f"tensor '{Q_NAME}' has shape [32, 64], expected [64, 64]"),
    "freq_base_nan": (ConfigError, "'llama.rope.freq_base': must be a finite number > 0, got nan"),
    "freq_base_zero": (ConfigError, "'llama.rope.freq_base': must be a finite number > 0, got 0.0"),
    "freq_base_negative": (ConfigError, "'llama.rope.freq_base': must be a finite number > 0, got -1.0"),
    "freq_base_inf": (ConfigError, "'llama.rope.freq_base': must be a finite number > 0, got inf"),
    "norm_eps_nan": (ConfigError, "norm_eps: must be in (0, 1), got nan"),
    "head_count_over_embedding": (ConfigError, "'llama.attention.head_count': 128 heads exceed"),
    "nan_weight": (WeightError, "tensor 'layers.0.qkv.weight' holds 1 NaN and 0 infinite values"),
}


@pytest.mark.parametrize("case", CASES)
def test_damage_is_an_error_naming_the_field_or_tensor(valid, tmp_path, case):
    error, text = CASES[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(damage(case, valid))
    with pytest.raises(error) as caught:
        Engine.from_dir(path)
    assert isinstance(caught.value, ValueError)
    assert text in str(caught.value)


def test_a_bad_alignment_is_refused(tmp_path):
    writer = gguf.GGUFWriter(os.fspath(tmp_path / "m.gguf"), "llama")
    writer.add_custom_alignment(64)
    writer.add_tensor("x.weight", np.zeros((2, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "m.gguf").write_bytes(patch(data, after_key(data, "general.alignment") + 4, "<I", 48))
    with pytest.raises(ConfigError, match="general.alignment: must be a uint32 power of two, got 48"):
        GgufFile(tmp_path / "m.gguf")


def test_unsupported_rope_tensors_split_files_and_bad_token_ids_are_named(tmp_path):
    model = factories.hf_model("llama", seed=1, num_hidden_layers=1)
    # (LLaMA 3's rope_freqs is read: tests/runtime/test_gguf_llama3.py)
    path = write_gguf(tmp_path / "rope.gguf", "llama", model, extra={"rope_factors_long.weight": np.ones(8, np.float32)})
    with pytest.raises(ConfigError, match="'rope_factors_long.weight'"):
        Engine.from_dir(path)
    path = write_gguf(tmp_path / "split.gguf", "llama", model, extra_keys={"split.count": 2})
    with pytest.raises(ConfigError, match="'split.count'"):
        Engine.from_dir(path)
    path = write_gguf(tmp_path / "ids.gguf", "llama", factories.hf_model("llama", seed=1, num_hidden_layers=1,
                                                                         eos_token_id=500))
    with pytest.raises(ConfigError, match="'tokenizer.ggml.eos_token_id': 500 is not a token id"):
        save_gguf_tokenizer(path, tmp_path / "tokenizer")


def test_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "fifo.gguf")
    with pytest.raises(ConfigError, match="not a regular file"):
        Engine.from_dir(tmp_path / "fifo.gguf")


def test_a_zero_byte_tensor_with_a_dim_past_int64_is_refused_naming_it(valid, tmp_path):
    data = patch(patch(valid, tensor_field(valid, Q_NAME, "ne0"), "<Q", 0), tensor_field(valid, Q_NAME, "ne1"),
                 "<Q", (1 << 64) - 1)
    (tmp_path / "bad.gguf").write_bytes(data)
    with pytest.raises(WeightError, match=rf"tensor '{Q_NAME}': dim 18446744073709551615 exceeds"):
        GgufFile(tmp_path / "bad.gguf")


@pytest.mark.parametrize("factor", [0.0, float("nan"), -2.0])
def test_a_linear_rope_factor_that_is_not_finite_and_positive_is_refused(tmp_path, factor):
    model = factories.hf_model("llama", seed=1, num_hidden_layers=1)
    path = write_gguf(tmp_path / "f.gguf", "llama", model, extra_keys={"llama.rope.scaling.type": "linear",
                                                                       "llama.rope.scaling.factor": factor})
    with pytest.raises(ConfigError, match=r"'llama.rope.scaling.factor': must be a finite number > 0"):
        Engine.from_dir(path)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_more_heads_than_embedding_width_is_refused_naming_the_key(valid, tmp_path, arch):
    """llama without rope.dimension_count divided by a head dim of 0 (ZeroDivisionError)."""
    if arch == "llama":
        data = valid.replace(b"llama.rope.dimension_count", b"llama.rope.dimension_counX")
    else:
        data = open(write_gguf(tmp_path / "h.gguf", arch, factories.hf_model(arch, seed=1, num_hidden_layers=1)),
                    "rb").read()
    (tmp_path / "h.gguf").write_bytes(patch(data, after_key(data, f"{arch}.attention.head_count") + 4, "<I", 4096))
    with pytest.raises(ConfigError, match=rf"'{arch}.attention.head_count': 4096 heads exceed '{arch}.embedding_length'"):
        Engine.from_dir(tmp_path / "h.gguf")


def _gguf_of_arrays(path, num_items: int) -> int:
    """A GGUF file of two metadata arrays of `num_items` each (6-byte strings, int32s); its size."""
    def key(name: str) -> bytes:
        return struct.pack("<Q", len(name)) + name.encode()
    strings = b"".join(struct.pack("<Q", 6) + b"t%05d" % (i % 100000) for i in range(num_items))
    ints = np.arange(num_items, dtype="<i4").tobytes()
    data = (b"GGUF" + struct.pack("<IQQ", 3, 0, 2)
            + key("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, num_items) + strings
            + key("tokenizer.ggml.token_type") + struct.pack("<IIQ", 9, 5, num_items) + ints)
    path.write_bytes(data)
    return len(data)


def test_metadata_arrays_take_about_their_file_size_in_memory(tmp_path):
    import tracemalloc
    size = _gguf_of_arrays(tmp_path / "a.gguf", 500_000)
    tracemalloc.start()
    try:
        file = GgufFile(tmp_path / "a.gguf")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * size, (peak, size)   # Python lists: 5x the strings' bytes, 9x the ints'
    assert file.num_items("tokenizer.ggml.tokens") == 500_000
    assert file.get_str_list("tokenizer.ggml.tokens")[123_456] == "t23456"
    assert file.get_int_list("tokenizer.ggml.token_type")[-1] == 499_999
    file.close()


def test_a_string_array_that_is_not_utf8_is_named_when_read(tmp_path):
    _gguf_of_arrays(tmp_path / "a.gguf", 3)
    data = (tmp_path / "a.gguf").read_bytes().replace(b"t00001", b"t\xff0001")
    (tmp_path / "a.gguf").write_bytes(data)
    with pytest.raises(ConfigError, match="'tokenizer.ggml.tokens': not UTF-8 text"):
        GgufFile(tmp_path / "a.gguf").get_str_list("tokenizer.ggml.tokens")


def test_a_file_truncated_while_loaded_is_an_error_not_a_sigbus(valid, tmp_path):
    """Run in a child: reading a mapped page past the end of a truncated file is SIGBUS."""
    import subprocess
    import sys
    import textwrap
    path = tmp_path / "m.gguf"
    path.write_bytes(valid)
    code = textwrap.dedent(f"""
        import os
        from runtime import WeightError
        from runtime.loading.gguf_file import GgufFile
        file = GgufFile({str(path)!r})
        os.truncate({str(path)!r}, 4096)
        try:
            file.read({Q_NAME!r})
        except WeightError as e:
            print("ERROR", e)
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert f"tensor '{Q_NAME}'" in result.stdout and "truncated while loaded" in result.stdout, result.stdout
