"""PEFT adapter directories written by hand (no model): alpha_pattern / rank_pattern keys are
module names or dotted suffixes matched literally, never run as regexes, and every bad directory
is a ValueError naming the key or the file."""
from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runtime.adapters.lora import LORA_MODULE_IDS
from runtime.adapters.peft_adapter import load_peft_adapter

PREFIX = "base_model.model.model.layers"
MODULES = {"q_proj": ("self_attn", 8, 8), "down_proj": ("mlp", 12, 8)}   # name -> (parent, in, out)


def write_adapter(directory: Path, rank: int = 2, dtype=torch.float32, **config) -> dict[str, torch.Tensor]:
    """Two layers of q_proj and down_proj with A = 1 and B = 1 (so a row's B part is its scaling)."""
    tensors = {}
    for layer in (0, 1):
        for module, (parent, fan_in, fan_out) in MODULES.items():
            key = f"{PREFIX}.{layer}.{parent}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.ones(rank, fan_in, dtype=dtype)
            tensors[f"{key}.lora_B.weight"] = torch.ones(fan_out, rank, dtype=dtype)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 4, **config}))
    return tensors


def scalings(directory: Path) -> dict[tuple[str, int], float]:
    """(module, layer) -> the scaling folded into the row's B."""
    weights, config = load_peft_adapter(directory)
    names = {v: k for k, v in LORA_MODULE_IDS.items()}
    out = {}
    for row, (module_id, layer, rank) in zip(weights, config.tolist()):
        fan_in = 8 if names[module_id] == "attn_q" else 12
        out[(names[module_id], layer)] = float(row[rank * fan_in])
    return out


def test_plain_alpha_pattern_keys_match_module_names_and_dotted_suffixes(tmp_path):
    write_adapter(tmp_path, alpha_pattern={"q_proj": 8, "layers.1.mlp.down_proj": 6, "proj": 100})
    assert scalings(tmp_path) == {("attn_q", 0): 4.0, ("attn_q", 1): 4.0,                 # 8 / 2
                                  ("mlp_4h_to_h", 0): 2.0, ("mlp_4h_to_h", 1): 3.0}       # lora_alpha 4 / 2; 6 / 2


@pytest.mark.parametrize("field", ["alpha_pattern", "rank_pattern"])
@pytest.mark.parametrize("key", ["(", "^q_proj$", ".*q_proj", "q_proj|k_proj", "[qk]_proj", "", "a..b"])
def test_regex_keys_are_refused_naming_the_key(tmp_path, field, key):
    write_adapter(tmp_path, **{field: {key: 2}})
    with pytest.raises(ValueError, match=re.escape(f"{field} key {key!r} is not a module name")):
        load_peft_adapter(tmp_path)


def test_a_catastrophic_pattern_cannot_stall_the_loader(tmp_path):
    """Run in a child process: before the fix this pattern backtracked for ever holding the GIL."""
    write_adapter(tmp_path, alpha_pattern={"([a-z_.0-9]+)+Z": 2})
    code = ("import sys\nfrom runtime.adapters.peft_adapter import load_peft_adapter\ntry:\n    load_peft_adapter(sys.argv[1])\n"
            "except ValueError as e:\n    print(e)\n")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, cwd=root)
    assert "alpha_pattern key '([a-z_.0-9]+)+Z'" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("config, message", [
    (dict(alpha_pattern=["q_proj"]), "alpha_pattern must be an object"),
    (dict(alpha_pattern={"q_proj": "8"}), "alpha_pattern['q_proj'] must be a finite number, got '8'"),
    (dict(alpha_pattern={"q_proj": True}), "alpha_pattern['q_proj'] must be a finite number, got True"),
    (dict(alpha_pattern={"q_proj": float("nan")}), "alpha_pattern['q_proj'] must be a finite number, got nan"),
    (dict(rank_pattern={"q_proj": 0}), "rank_pattern['q_proj'] must be a positive integer, got 0"),
    (dict(rank_pattern={"q_proj": 2.5}), "rank_pattern['q_proj'] must be a positive integer, got 2.5"),
    (dict(lora_alpha=float("inf")), "lora_alpha must be a finite number, got inf"),
])
def test_bad_pattern_values_name_the_key(tmp_path, config, message):
    write_adapter(tmp_path, **config)
    with pytest.raises(ValueError) as e:
        load_peft_adapter(tmp_path)
    assert message in str(e.value)


def test_plain_rank_pattern_is_accepted(tmp_path):
    write_adapter(tmp_path, rank_pattern={"q_proj": 2, "layers.0.mlp.down_proj": 2})
    assert len(scalings(tmp_path)) == 4


def test_a_rank_0_adapter_is_refused_naming_the_tensor(tmp_path):
    write_adapter(tmp_path, rank=0)
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj\.lora_A\.weight'.*rank 0"):
        load_peft_adapter(tmp_path)


def test_complex_factors_are_refused_naming_the_tensor(tmp_path):
    write_adapter(tmp_path, dtype=torch.complex64)
    with pytest.raises(ValueError, match=r"q_proj\.lora_A\.weight'.*expected float tensors, got torch\.complex64"):
        load_peft_adapter(tmp_path)


def test_a_header_claiming_more_bytes_than_the_file_holds_names_the_file(tmp_path):
    write_adapter(tmp_path)
    header = json.dumps({f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": {
        "dtype": "F32", "shape": [1 << 18, 1 << 20], "data_offsets": [0, 1 << 40]}}).encode()
    (tmp_path / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors: not a readable safetensors file"):
        load_peft_adapter(tmp_path)
