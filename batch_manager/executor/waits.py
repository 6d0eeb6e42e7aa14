"""The Executor's blocking waits: the one check of a caller's `timeout` and the one wait loop that
`ResponseStore` and `KvEventBuffer` share (a store that is closed at shutdown never waits)."""
from __future__ import annotations

import math
import numbers
import threading
import time
from datetime import timedelta
from typing import Callable


def timeout_seconds(timeout) -> float | None:
    """A caller's `timeout` (timedelta, finite seconds >= 0, or None: until ready or shutdown) as
    seconds; ValueError naming `timeout` otherwise (NaN, inf, negative, a bool, a string)."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        try:
            seconds = float(timeout)
        except OverflowError:   # an int too large for a float
            seconds = math.inf
    else:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"timeout: expected a datetime.timedelta, finite seconds >= 0 or None, got {timeout!r}")
    return seconds


def wait_for(condition: threading.Condition, is_ready: Callable[[], bool], timeout_s: float | None) -> bool:
    """Call with `condition` held: wait until `is_ready()` (True) or `timeout_s` passes (False)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not is_ready():
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return False
        condition.wait(None if remaining is None else min(remaining, threading.TIMEOUT_MAX))
    return True
