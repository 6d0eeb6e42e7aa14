"""Tool calls in a reply's text, as it streams (samples.serve): the reply side of `tool_calls`.
One `ToolCallParser` per choice turns text deltas into content text and `ToolCallDelta`s in
OpenAI's streamed shape (a call's first delta: index, id, name and "" arguments; later ones:
pieces of the arguments' JSON text, which joined are exactly what the model wrote). Torch-free.

Under "auto" a reply is text unless it begins with `<tool_call>` (the grammar makes that the
only way to call); the text is held back only while it could still be that prefix."""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from samples.serve.tool_calls import CALL_START

_HEAD = re.compile(r'\s*<tool_call>\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:')
_TAIL = re.compile(r"\s*\}\s*</tool_call>")


@dataclass(frozen=True)
class ToolCallDelta:
    index: int                  # the call's position among the choice's calls
    arguments: str              # the next piece of its arguments' JSON text
    id: str | None = None       # on its first delta only, with the name
    name: str | None = None

    def openai(self) -> dict:
        delta: dict = {"index": self.index}
        if self.id is not None:
            delta |= {"id": self.id, "type": "function",
                      "function": {"name": self.name, "arguments": self.arguments}}
        else:
            delta["function"] = {"arguments": self.arguments}
        return delta


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class _JsonValueEnd:
    """Where one JSON value ends in text fed piece by piece (strings and escapes respected)."""

    def __init__(self):
        self.depth, self.in_string, self.escaped, self.started, self.kind = 0, False, False, False, ""

    def feed(self, text: str) -> tuple[int, int, bool]:
        """-> (characters of `text` before the value starts, characters of the value in `text`
        after those, whether the value is complete)."""
        skipped = i = 0
        if not self.started:
            stripped = text.lstrip()
            skipped = len(text) - len(stripped)
            if not stripped:
                return len(text), 0, False
            self.started, self.kind = True, stripped[0]
            i = skipped
        while i < len(text):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:   # a string value ends here
                        return skipped, i + 1 - skipped, True
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                if self.depth == 0:       # the enclosing object closes: a number or literal ended
                    return skipped, i - skipped, True
                self.depth -= 1
                if self.depth == 0:
                    return skipped, i + 1 - skipped, True
            elif self.depth == 0 and self.kind not in "{[\"" and c in ", \t\r\n":
                return skipped, i - skipped, True
            i += 1
        return skipped, len(text) - skipped, False


@dataclass
class ToolCallParser:
    is_forced: bool                       # required / named: the reply is calls
    calls: list[ToolCall] = field(default_factory=list)
    is_text: bool = False                 # the reply turned out to be text
    _buffer: str = ""
    _value: _JsonValueEnd | None = None   # inside a call's arguments
    _awaiting_tail: bool = False          # a call's arguments ended: its closing text comes next

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """-> (content text, call deltas) for the next piece of the reply."""
        if self.is_text:
            return text, []
        self._buffer += text
        if not self.is_forced and not self.calls and self._value is None:
            head = self._buffer.lstrip()
            if len(head) < len(CALL_START) and CALL_START.startswith(head):
                return "", []     # it may still become a call
            if not head.startswith(CALL_START.rstrip("\n")):
                self.is_text = True
                content, self._buffer = self._buffer, ""
                return content, []
        return "", self._parse()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the reply's end: text still held back (an unfinished call's text stays unparsed)."""
        if self.is_text or not self.calls and self._value is None:
            content, self._buffer = self._buffer, ""
            self.is_text = self.is_text or bool(content.strip())
            return content, []
        return "", []

    def _parse(self) -> list[ToolCallDelta]:
        deltas = []
        while self._buffer:
            if self._value is None:
                tail = _TAIL.match(self._buffer)
                if tail is not None and self.calls and self._awaiting_tail:
                    self._buffer, self._awaiting_tail = self._buffer[tail.end():], False
                    continue
                head = _HEAD.match(self._buffer)
                if head is None:
                    break
                call = ToolCall("call_" + secrets.token_hex(12), _unescape(head.group(1)))
                self.calls.append(call)
                deltas.append(ToolCallDelta(len(self.calls) - 1, "", call.id, call.name))
                self._buffer, self._value = self._buffer[head.end():], _JsonValueEnd()
                continue
            skipped, num_chars, done = self._value.feed(self._buffer)
            piece = self._buffer[skipped:skipped + num_chars]
            self._buffer = self._buffer[skipped + num_chars:]
            if piece:
                self.calls[-1].arguments += piece
                deltas.append(ToolCallDelta(len(self.calls) - 1, piece))
            if not done:
                break
            self._value, self._awaiting_tail = None, True
        return deltas


def _unescape(name: str) -> str:
    try:
        return json.loads(f'"{name}"')
    except ValueError:
        return name
