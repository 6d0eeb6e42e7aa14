"""Guided decoding's user-facing types (API.md, "Beyond the seeds"): the per-request
`GuidedDecodingParams` and the engine's `GuidedDecodingConfig` (the tokenizer llguidance needs
once). The grammar machinery is runtime/decoding/guided.py."""
from __future__ import annotations

import enum
import json
import os
import tempfile
from dataclasses import dataclass

from runtime.decoding.guided import GrammarCompiler, make_tokenizer
from runtime.loading.gguf_tokenizer import save_gguf_tokenizer


class GuideType(enum.Enum):
    JSON = "json"                   # any JSON object
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    EBNF_GRAMMAR = "ebnf_grammar"   # Lark or GBNF text (llguidance's grammar format)


@dataclass
class GuidedDecodingParams:
    guide_type: GuideType
    guide: str | None = None        # the schema / regex / grammar text (JSON: optional schema)

    GuideType = GuideType


@dataclass
class GuidedDecodingConfig:
    """backend "llguidance" (the only one); tokenizer_str: the Hugging Face tokenizer.json text;
    stop_token_ids: the tokens that end a completed guide (default: the tokenizer's end token);
    encoded_vocab: optional, checked against the tokenizer's size when given."""
    backend: str = "llguidance"
    encoded_vocab: list[str] | None = None
    tokenizer_str: str | None = None
    stop_token_ids: list[int] | None = None

    @classmethod
    def from_tokenizer(cls, directory: str | os.PathLike) -> "GuidedDecodingConfig":
        """From a Hugging Face tokenizer directory (tokenizer.json, and tokenizer_config.json's
        eos_token for the stop token), or a `.gguf` file (the tokenizer its metadata describes)."""
        if os.fspath(directory).endswith(".gguf"):
            with tempfile.TemporaryDirectory() as tokenizer_dir:
                save_gguf_tokenizer(directory, tokenizer_dir)
                return cls.from_tokenizer(tokenizer_dir)
        with open(os.path.join(directory, "tokenizer.json"), encoding="utf-8") as f:
            tokenizer_str = f.read()
        stop = None
        config_path = os.path.join(directory, "tokenizer_config.json")
        if os.path.exists(config_path):
            with open(config_path, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            spec = json.loads(tokenizer_str)
            vocab = (spec.get("model") or {}).get("vocab")
            ids = dict(vocab) if isinstance(vocab, dict) else {}
            ids.update({t["content"]: t["id"] for t in spec.get("added_tokens", [])})
            if eos in ids:
                stop = [ids[eos]]
        return cls(tokenizer_str=tokenizer_str, stop_token_ids=stop)

    def build_compiler(self, vocab_size: int) -> GrammarCompiler:
        """The engine's grammar compiler; ValueError naming the field for a bad config."""
        if self.backend != "llguidance":
            raise ValueError(f"GuidedDecodingConfig.backend: {self.backend!r} not supported (\"llguidance\")")
        if not isinstance(self.tokenizer_str, str) or not self.tokenizer_str:
            raise ValueError("GuidedDecodingConfig.tokenizer_str: required (a tokenizer.json text)")
        stop = self.stop_token_ids
        if stop is not None and (not isinstance(stop, (list, tuple)) or not stop
                                 or not all(isinstance(t, int) and 0 <= t < vocab_size for t in stop)):
            raise ValueError(f"GuidedDecodingConfig.stop_token_ids: expected token ids in [0, {vocab_size}), "
                             f"got {stop!r}")
        tokenizer = make_tokenizer(self.tokenizer_str, vocab_size, list(stop) if stop else None)
        if self.encoded_vocab is not None and len(self.encoded_vocab) > vocab_size:
            raise ValueError(f"GuidedDecodingConfig.encoded_vocab: {len(self.encoded_vocab)} tokens exceed the "
                             f"model's vocabulary of {vocab_size}")
        return GrammarCompiler(tokenizer, list(stop) if stop else None)


def parse_guide(params, compiler: GrammarCompiler | None, name: str) -> tuple[str, str | None] | None:
    """-> (guide type, text) for `compiler.compile`, or None without params (ValueError naming `name`)."""
    if params is None:
        return None
    if not isinstance(params, GuidedDecodingParams):
        raise ValueError(f"{name}: expected a GuidedDecodingParams, got {type(params).__name__}")
    if compiler is None:
        raise ValueError(f"{name}: the engine has no guided_decoding_config (set it to use guided decoding)")
    try:
        guide_type = GuideType(params.guide_type)
    except ValueError:
        raise ValueError(f"{name}.guide_type: {params.guide_type!r} is not a GuideType") from None
    if params.guide is not None and not isinstance(params.guide, str):
        raise ValueError(f"{name}.guide: expected a string, got {type(params.guide).__name__}")
    if guide_type != GuideType.JSON and not params.guide:
        raise ValueError(f"{name}.guide: required for {guide_type.name}")
    return guide_type.value, params.guide
