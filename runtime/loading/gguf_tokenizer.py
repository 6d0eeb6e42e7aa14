"""Tokenizer files from a GGUF file's metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`):
`tokenizer.json` (a Hugging Face fast tokenizer, built by transformers' GGUF converter, which is
imported here only), `tokenizer_config.json` (special tokens, chat template) and
`generation_config.json` (end ids). `save_gguf_tokenizer` writes them; `runtime.build` writes them
into the engine directory of a GGUF checkpoint. The chat template is kept as text, never run.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from ..config import ConfigError

if TYPE_CHECKING:
    from .gguf_file import GgufFile

# tokenizer_config.json name -> the `tokenizer.ggml.*` key of its token id
SPECIAL_TOKEN_KEYS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                      "pad_token": "padding_token_id"}
# llama.cpp's end-of-generation tokens (generation_config.json's eos_token_id, in this order)
END_TOKEN_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id")


def _token_id(file: GgufFile, key: str, num_tokens: int) -> int | None:
    value = file.get_int(f"tokenizer.ggml.{key}")
    if value is not None and not 0 <= value < num_tokens:
        raise ConfigError(f"{file.path}: metadata 'tokenizer.ggml.{key}': {value} is not a token id "
                          f"(the vocabulary has {num_tokens} tokens)")
    return value


def _same_length(file: GgufFile, key: str, values: list | None, num_tokens: int) -> list | None:
    if values is not None and len(values) != num_tokens:
        raise ConfigError(f"{file.path}: metadata {key!r}: {len(values)} entries for {num_tokens} tokens")
    return values


def _tokenizer_dict(file: GgufFile) -> dict[str, Any]:
    """What transformers' converter reads (its names), checked (ConfigError naming the key)."""
    kind = file.get_str("tokenizer.ggml.model")
    tokens = file.get_str_list("tokenizer.ggml.tokens")
    for key, value in (("tokenizer.ggml.model", kind), ("tokenizer.ggml.tokens", tokens)):
        if not value:
            raise ConfigError(f"{file.path}: metadata {key!r}: missing (the file has no tokenizer)")
    merges = file.get_str_list("tokenizer.ggml.merges")
    bad = next((m for m in merges or () if len(m.split(" ")) != 2), None)
    if bad is not None:
        raise ConfigError(f"{file.path}: metadata 'tokenizer.ggml.merges': {bad!r} is not two tokens")
    out = {"tokenizer_type": kind, "pre_tokenizer_type": file.get_str("tokenizer.ggml.pre"), "tokens": tokens,
           "scores": _same_length(file, "tokenizer.ggml.scores", file.get_float_list("tokenizer.ggml.scores"),
                                  len(tokens)),
           "token_type": _same_length(file, "tokenizer.ggml.token_type",
                                      file.get_int_list("tokenizer.ggml.token_type"), len(tokens)),
           "merges": merges, "add_prefix_space": file.get_bool("tokenizer.ggml.add_space_prefix")}
    for name, key in SPECIAL_TOKEN_KEYS.items():
        out[f"{name}_id"] = _token_id(file, key, len(tokens))   # bos_token_id, ..., unk_token_id, pad_token_id
    return {name: value for name, value in out.items() if value is not None}


def _tokenizer_json(file: GgufFile, tokenizer: dict[str, Any], config: dict[str, Any]) -> str:
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer
    except ImportError:
        try:   # transformers 4
            from transformers.integrations.ggml import convert_gguf_tokenizer
        except ImportError:
            raise ImportError("building a tokenizer from GGUF metadata needs the transformers package "
                              "(pip install transformers)") from None
    try:
        backend, _ = convert_gguf_tokenizer(file.get_str("general.architecture") or "", dict(tokenizer))
    except Exception as e:   # NOTE: the tokenizers library raises plain Exception (a merge of unknown tokens)
        raise ConfigError(f"{file.path}: metadata 'tokenizer.ggml.*': cannot build a "
                          f"{tokenizer['tokenizer_type']!r} tokenizer: {e}") from None
    _add_special_tokens_around(backend, tokenizer, config)
    # NOTE: the converter adds its class's default specials (GPT-2's <|endoftext|>) where the vocabulary
    # lacks them; a token past the file's vocabulary is one the model cannot produce: dropped.
    spec = json.loads(backend.to_str())
    spec["added_tokens"] = [t for t in spec.get("added_tokens", []) if t["id"] < len(tokenizer["tokens"])]
    return json.dumps(spec, ensure_ascii=False)


def _add_special_tokens_around(backend, tokenizer: dict[str, Any], config: dict[str, Any]) -> None:
    """BOS / EOS around each text where the file asks for them, in tokenizer.json itself (as
    transformers' update_post_processor does), so that any loader of the file adds them."""
    add_bos = config["add_bos_token"] and "bos_token" in config
    add_eos = config["add_eos_token"] and "eos_token" in config
    if not add_bos and not add_eos:
        return
    from tokenizers import processors
    bos, eos = config.get("bos_token"), config.get("eos_token")
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    special = ([(bos, tokenizer["bos_token_id"])] if add_bos else []) + \
        ([(eos, tokenizer["eos_token_id"])] if add_eos else [])
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _tokenizer_config(file: GgufFile, tokenizer: dict[str, Any]) -> dict[str, Any]:
    tokens = tokenizer["tokens"]
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for name, key in SPECIAL_TOKEN_KEYS.items():
        token_id = _token_id(file, key, len(tokens))
        if token_id is not None:
            config[name] = tokens[token_id]
    add_bos = file.get_bool("tokenizer.ggml.add_bos_token")
    # llama.cpp adds BOS to a SentencePiece ("llama") vocabulary that does not say otherwise.
    config["add_bos_token"] = add_bos if add_bos is not None else tokenizer["tokenizer_type"] == "llama"
    config["add_eos_token"] = bool(file.get_bool("tokenizer.ggml.add_eos_token"))
    context_length = file.get_int(f"{file.get_str('general.architecture')}.context_length")
    if context_length:
        config["model_max_length"] = context_length
    template = file.get_str("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return config


def _generation_config(file: GgufFile, num_tokens: int) -> dict[str, Any]:
    end_ids = []
    for key in END_TOKEN_KEYS:
        token_id = _token_id(file, key, num_tokens)
        if token_id is not None and token_id not in end_ids:
            end_ids.append(token_id)
    config = {"bos_token_id": _token_id(file, "bos_token_id", num_tokens),
              "eos_token_id": end_ids[0] if len(end_ids) == 1 else (end_ids or None),
              "pad_token_id": _token_id(file, "padding_token_id", num_tokens)}
    return {name: value for name, value in config.items() if value is not None}


def tokenizer_files(file: GgufFile) -> dict[str, str]:
    """file name -> text of the three tokenizer files, built in memory (ConfigError naming the key)."""
    tokenizer = _tokenizer_dict(file)
    config = _tokenizer_config(file, tokenizer)
    return {"tokenizer.json": _tokenizer_json(file, tokenizer, config),
            "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
            "generation_config.json": json.dumps(_generation_config(file, len(tokenizer["tokens"])), indent=2)}


def write_files(files: dict[str, str], directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            f.write(text)


def save_gguf_tokenizer(gguf_path: str | os.PathLike, directory: str | os.PathLike) -> None:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json for a GGUF file (or a
    directory holding one) into `directory`, which Hugging Face tokenizers then load."""
    from .gguf_checkpoint import find_gguf
    from .gguf_file import GgufFile
    path = find_gguf(gguf_path)
    if path is None:
        raise ConfigError(f"gguf_path: not a .gguf file or a directory holding one: {os.fspath(gguf_path)!r}")
    with GgufFile(path) as file:
        files = tokenizer_files(file)
    write_files(files, os.fspath(directory))
