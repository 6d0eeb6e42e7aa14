"""Streaming text of one generated sequence (samples.serve): incremental detokenization that never
emits a broken multi-byte character, and stop strings matched on the text across token
boundaries. One `TextStream` per sequence, fed on the handler's event loop; torch-free."""
from __future__ import annotations

from dataclasses import dataclass

REPLACEMENT = "\ufffd"   # what a tokenizer's decode makes of incomplete UTF-8


class IncrementalDetokenizer:
    """Text deltas of a growing token list, as TGI and vLLM make them: decode a short window
    ids[prefix_offset:] and emit what it adds past ids[prefix_offset:read_offset]. A window that
    ends in U+FFFD holds its text back: its last token(s) end inside a multi-byte character whose
    remaining bytes come with later tokens. The window (a few tokens before the new ones) keeps
    tokenizers whose decode depends on the neighbours (SentencePiece's leading spaces) right.

    Invariant: the concatenation of every delta plus `flush()` equals the decode of all ids,
    for tokenizers whose decode of a sequence is the concatenation of its windows' decodes at
    character boundaries (byte-level BPE, SentencePiece, word-level)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0   # start of the decode window
        self.read_offset = 0     # ids before this one have had their text emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; returns the text they complete ("" while a character is incomplete)."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if text.endswith(REPLACEMENT) or len(text) < len(prefix_text):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix_text):]

    def flush(self) -> str:
        """The held-back text at the end of the sequence (U+FFFD for bytes that never completed)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix_text):]


@dataclass(frozen=True)
class TextDelta:
    text: str               # new text, safe to send (complete characters, no part of a stop string)
    num_tokens: int         # tokens consumed by this call (< len(new_ids) when a stop string ended it)
    is_stopped: bool        # a stop string matched: the sequence is over, its text excludes the match
    token_offsets: tuple[int, ...] = ()   # per consumed token: characters of the sequence's text before it
    # per consumed token: the characters it completes ("" for one that ends inside a character,
    # whose bytes the next token completes): joined, the sequence's text, never a split character
    token_texts: tuple[str, ...] = ()
    # finish(): the characters the flush added (U+FFFD for bytes the last tokens left incomplete),
    # which belong to the sequence's last token
    flushed: str = ""


class TextStream:
    """Detokenized text of one sequence with stop strings (OpenAI's `stop`): the output ends
    before the first occurrence of any stop string, which is not included. The longest end of the
    text that begins some stop string is held back until the next characters complete the match
    or rule it out. Tokens are consumed one at a time, so the token that completes a stop string
    is the last one counted (usage counts it, as vLLM does)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop = stop
        self.max_held = max((len(s) for s in stop), default=1) - 1
        self.pending = ""        # decoded, not yet emitted (may hold the start of a stop string)
        self.num_emitted_chars = 0
        self.is_stopped = False

    def add(self, new_ids: list[int]) -> TextDelta:
        assert not self.is_stopped, "tokens after a stop string"
        out, offsets, texts = [], [], []
        for token in new_ids:
            offsets.append(self.num_emitted_chars + len(self.pending))
            texts.append(self.detokenizer.add([token]))
            self.pending += texts[-1]
            cut = self._first_stop()
            if cut is not None:
                self._emit(out, cut)
                self.pending, self.is_stopped = "", True
                break
            self._emit(out, len(self.pending) - self._num_to_hold())
        return TextDelta("".join(out), len(offsets), self.is_stopped, tuple(offsets), tuple(texts))

    def _emit(self, out: list[str], num_chars: int) -> None:
        """Move the first num_chars (if positive) of `pending` to `out`."""
        if num_chars > 0:
            out.append(self.pending[:num_chars])
            self.pending = self.pending[num_chars:]
            self.num_emitted_chars += num_chars

    def finish(self) -> TextDelta:
        """The rest of the text once the engine ended the sequence (a stop string can still
        match in the flushed tail)."""
        if self.is_stopped:
            return TextDelta("", 0, True)
        flushed = self.detokenizer.flush()
        self.pending += flushed
        cut = self._first_stop()
        out: list[str] = []
        self._emit(out, len(self.pending) if cut is None else cut)
        self.pending, self.is_stopped = "", cut is not None
        return TextDelta("".join(out), 0, self.is_stopped, flushed=flushed)

    def _num_to_hold(self) -> int:
        """Characters at the end of `pending` that begin a stop string (the longest such end)."""
        for k in range(min(self.max_held, len(self.pending)), 0, -1):
            tail = self.pending[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def _first_stop(self) -> int | None:
        """Index in `pending` of the earliest stop-string occurrence, or None. A match never
        begins in emitted text: its every prefix was held back while it was an end of the text."""
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None
