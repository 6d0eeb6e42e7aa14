"""How a client's value appears in samples.serve's error messages (`openai_protocol`, `params`):
a repr cut to a few levels, items and characters, so that showing a value the client nested
thousands deep, made megabytes long or wrote with thousands of digits costs microseconds and
cannot raise (repr() would raise RecursionError or ValueError, or copy it all)."""
from __future__ import annotations

import itertools
import reprlib

MAX_INT_BITS = 64   # a larger integer is shown by its size (repr() refuses over 4,300 digits)


class _ShortRepr(reprlib.Repr):
    """reprlib's cut repr; dicts in their own order (reprlib sorts all the keys first), large
    integers by their size."""

    def __init__(self):
        super().__init__()
        self.maxstring = self.maxother = 80

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > MAX_INT_BITS:
            return f"an integer of {x.bit_length()} bits"
        return super().repr_int(x, level)

    def repr_dict(self, x: dict, level: int) -> str:
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
                 for k, v in itertools.islice(x.items(), self.maxdict)]
        return "{" + ", ".join(items) + (", ..." if len(x) > self.maxdict else "") + "}"


_SHORT_REPR = _ShortRepr()


def short_repr(value, max_chars: int = 80) -> str:
    """At most max_chars characters of the value's (cut) repr."""
    return _SHORT_REPR.repr(value)[:max_chars]


def some_sorted(names, max_items: int = 16) -> list:
    """The names sorted, or max_items of them when there are more (sorting a million would hold
    the GIL for a second)."""
    if len(names) <= max_items:
        return sorted(names)
    return sorted(itertools.islice(names, max_items)) + ["..."]
