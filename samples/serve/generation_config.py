"""What samples.serve reads beside the weights: the end ids of the model's generation config
(generation_config.json's `eos_token_id`, an id or a list: Llama 3 ends on several), and the
grammar engine's view of the tokenizer (tools and guided replies need it)."""
from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"


def end_ids(directories: list[str | None], tokenizer, vocab_size: int) -> tuple[int, ...]:
    """The first generation_config.json's eos_token_id(s) among `directories`, else the
    tokenizer's eos id; ids outside the vocabulary dropped, each once, in order."""
    ids: list = []
    for directory in filter(None, directories):
        path = os.path.join(directory, GENERATION_CONFIG_FILE)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                value = json.load(f).get("eos_token_id")
            ids = value if isinstance(value, list) else [value]
            break
    if not any(isinstance(i, int) for i in ids):
        ids = [getattr(tokenizer, "eos_token_id", None)]
    out: list[int] = []
    for token in ids:
        if isinstance(token, int) and not isinstance(token, bool) and 0 <= token < vocab_size and token not in out:
            out.append(token)
    return tuple(out)


def guided_decoding_config(tokenizer_dir: str | None, stop_token_ids: tuple[int, ...], vocab_size: int):
    """The engine's GuidedDecodingConfig from a tokenizer directory with a tokenizer.json (a
    completed grammar ends on any of `stop_token_ids`), or None without one, or when llguidance
    cannot take that tokenizer (a word-level one without a decoder, say): tools and guided
    requests are then refused by name, and the server runs without them (logged)."""
    if tokenizer_dir is None or not os.path.exists(os.path.join(tokenizer_dir, "tokenizer.json")):
        return None
    from batch_manager import GuidedDecodingConfig
    config = GuidedDecodingConfig.from_tokenizer(tokenizer_dir)
    if stop_token_ids:
        config.stop_token_ids = list(stop_token_ids)
    try:
        config.build_compiler(vocab_size)   # what the engine would do at start (a fraction of a second)
    except Exception as e:  # noqa: BLE001 - any reason the grammar engine cannot use this tokenizer
        logger.warning("tools and guided decoding are off: the grammar engine cannot use the tokenizer in %s: %s",
                       tokenizer_dir, e)
        return None
    return config
