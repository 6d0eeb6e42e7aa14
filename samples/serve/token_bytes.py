"""Each token's own bytes (samples.serve's log probs: OpenAI's `bytes`), for byte-level BPE
(GPT-2's byte-to-unicode alphabet), SentencePiece (U+2581 for a space, `<0xNN>` byte pieces) and
special or added tokens (their text). Cached per id; torch-free."""
from __future__ import annotations

import functools
import re

SENTENCEPIECE_SPACE = "\u2581"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def byte_level_decoder() -> dict[str, int]:
    """GPT-2's `bytes_to_unicode` inverted: the character standing for each byte -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return {c: b for b, c in enumerate(chars)}


class TokenBytes:
    """token id -> its bytes. The text of a token that holds part of a character is not
    well-formed alone; its bytes are (joined over a sequence: the UTF-8 of its text, special
    tokens aside)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.is_byte_level = type(decoder).__name__ == "ByteLevel"
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._bytes(token_id)
        return cached

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self.special_ids:
            return piece.encode("utf-8")
        if self.is_byte_level:
            table = byte_level_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode("utf-8")   # an added token outside the byte alphabet
        match = _BYTE_PIECE.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace(SENTENCEPIECE_SPACE, " ").encode("utf-8")

    def text(self, token_id: int) -> str:
        """A token's text alone: its bytes as UTF-8, or OpenAI's `bytes:\\xNN...` form where they
        are not well-formed alone (part of a character)."""
        raw = self(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
