"""The user's callbacks behind one guard. Every call out to user code, and every iterable it
returns (consumed here, item by item), runs inside `UserCallbacks`; what it raises is logged with
its traceback and contained. The worker calls user code only through this class."""
from __future__ import annotations

import logging
from typing import Any, Callable

logger = logging.getLogger(__name__)


class UserCallbacks:
    def __init__(self, get_requests: Callable, send_response: Callable,
                 poll_stop_signals: Callable | None = None, report_stats: Callable | None = None):
        self._get_requests, self._send_response = get_requests, send_response
        self._poll_stop_signals, self._report_stats = poll_stop_signals, report_stats

    @property
    def has_stats(self) -> bool:
        return self._report_stats is not None

    def get_requests(self, max_num_requests: int) -> list[Any]:
        """The items the get-requests callback handed over (unchecked: any objects)."""
        return _items("get_inference_requests_cb", self._get_requests, max_num_requests)

    def poll_stop_signals(self) -> list[Any]:
        if self._poll_stop_signals is None:
            return []
        return _items("poll_stop_signal_cb", self._poll_stop_signals)

    def send_response(self, request_id: int, tensors: list, is_final: bool, err_msg: str) -> None:
        _call("send_response_cb", self._send_response, request_id, tensors, is_final, err_msg)

    def report_stats(self, stats_json: str) -> None:
        if self._report_stats is not None:
            _call("return_batch_manager_stats_cb", self._report_stats, stats_json)


def _call(name: str, fn: Callable, *args) -> Any:
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - a user callback never kills the worker
        logger.exception("user callback %s raised", name)
        return None


def _items(name: str, fn: Callable, *args) -> list[Any]:
    """fn(*args) as a list; None is empty. The items yielded before an exception (raised by the
    call, by iter() of a non-iterable result, or while iterating) are kept."""
    items: list[Any] = []
    try:
        result = fn(*args)
        if result is not None:
            for item in result:
                items.append(item)
    except Exception:  # noqa: BLE001
        logger.exception("user callback %s raised (or returned an iterable that raised)", name)
    return items
