"""`Request.allotted_time_ms`: each request's deadline (monotonic seconds), from enqueue until its
final result, and the ids that passed theirs (whose final result then says TIMED_OUT).
Thread-safe: enqueue adds, the worker polls and forgets."""
from __future__ import annotations

import math
import threading
import time


def check_allotted_time_ms(value) -> float | None:
    """ValueError naming the field unless None or a finite number > 0."""
    return check_milliseconds("allotted_time_ms", value)


def check_milliseconds(field: str, value) -> float | None:
    """`value` as float milliseconds: ValueError naming `field` unless None or a finite number > 0
    (an int too large for a float, 10**400, included)."""
    if value is None:
        return None
    milliseconds, shown = None, None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            milliseconds = float(value)
        except OverflowError:
            shown = f"an integer of {value.bit_length()} bits (too large for a float)"
    if milliseconds is None or not math.isfinite(milliseconds) or milliseconds <= 0:
        raise ValueError(f"{field}: expected a finite number of milliseconds > 0 or None, got {shown or repr(value)}")
    return milliseconds


class Deadlines:
    def __init__(self):
        self._lock = threading.Lock()
        self._deadline_s: dict[int, float] = {}   # request id -> monotonic deadline
        self._timed_out: set[int] = set()         # passed their deadline, final result not yet sent

    def __len__(self) -> int:
        with self._lock:
            return len(self._deadline_s) + len(self._timed_out)

    def add(self, request_id: int, allotted_time_ms: float) -> None:
        with self._lock:
            self._deadline_s[request_id] = time.monotonic() + allotted_time_ms / 1000.0

    def pop_expired(self) -> list[int]:
        """The ids whose deadline passed since the last call (each once); they stay timed out."""
        if not self._deadline_s:   # NOTE: unlocked peek: the common case costs nothing per step
            return []
        now = time.monotonic()
        with self._lock:
            expired = [i for i, deadline in self._deadline_s.items() if deadline <= now]
            for request_id in expired:
                del self._deadline_s[request_id]
                self._timed_out.add(request_id)
        return expired

    def forget(self, request_id: int) -> bool:
        """At its final result: whether it had timed out."""
        with self._lock:
            self._deadline_s.pop(request_id, None)
            if request_id in self._timed_out:
                self._timed_out.discard(request_id)
                return True
            return False
