"""The directory a Dynamo worker registers as its model (`WorkerConfig.model_name`): what the
frontend reads to tokenize, template and stop. Dynamo's frontend needs a Hugging Face
`config.json` with an architecture and a context window (`max_position_embeddings`), the
`tokenizer.json`, and a `tokenizer_config.json` with the chat template; an engine directory has
the tokenizer files but no `config.json`. The card is written beside the engine's tokenizer files
(copied), its `config.json` from the engine's own config, so the frontend's context window is the
engine's max_seq_len."""
from __future__ import annotations

import json
import os
import shutil

CARD_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "gpt2": "GPT2LMHeadModel", "gemma": "GemmaForCausalLM", "phi3": "Phi3ForCausalLM"}


def read_engine_config(engine_dir: str) -> dict:
    with open(os.path.join(engine_dir, "engine.json")) as f:
        return json.load(f)


def hf_config(engine_config: dict) -> dict:
    """The config.json the frontend reads: architecture, vocabulary, special ids, context window."""
    model, build = engine_config["model"], engine_config["build"]
    architecture = model.get("architecture", "llama")
    return {"architectures": [ARCHITECTURES.get(architecture, "LlamaForCausalLM")], "model_type": architecture,
            "vocab_size": model["vocab_size"], "hidden_size": model["hidden_size"],
            "num_hidden_layers": model["num_layers"], "num_attention_heads": model["num_heads"],
            "num_key_value_heads": model.get("num_kv_heads", model["num_heads"]),
            "max_position_embeddings": build["max_seq_len"], "bos_token_id": model.get("bos_token_id"),
            "eos_token_id": model.get("eos_token_id"), "pad_token_id": model.get("pad_token_id"),
            "torch_dtype": build.get("dtype", "float32")}


def write_model_card(engine_dir: str, tokenizer_dir: str | None, card_dir: str) -> str:
    """Write the card into `card_dir` (replacing what is there); -> card_dir. ValueError naming
    the tokenizer directory when it lacks tokenizer.json (the frontend tokenizes with it)."""
    source = tokenizer_dir or engine_dir
    if not os.path.isfile(os.path.join(source, "tokenizer.json")):
        raise ValueError(f"tokenizer_dir: {source!r} has no tokenizer.json (Dynamo's frontend tokenizes with it; "
                         "pass --tokenizer-dir)")
    os.makedirs(card_dir, exist_ok=True)
    for name in CARD_FILES:
        if os.path.isfile(os.path.join(source, name)):
            copy = lambda tmp, name=name: shutil.copyfile(os.path.join(source, name), tmp)   # noqa: E731
            _replace(os.path.join(card_dir, name), copy)
    config = hf_config(read_engine_config(engine_dir))
    _replace(os.path.join(card_dir, "config.json"), lambda tmp: _write_json(tmp, config))
    return card_dir


def _write_json(path: str, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)


def _replace(path: str, write) -> None:
    """write(tmp) then rename over `path`: workers sharing a card never read half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    os.replace(tmp, path)


def end_ids_of(card_dir: str) -> tuple[int, ...]:
    """The model's end ids (generation_config.json's, else config.json's eos_token_id)."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(card_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (eos,)
    return ()
