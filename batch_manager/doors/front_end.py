"""The worker's outward face, every front door's protocol: `FrontEnd` (where requests come from and
responses and stats go), what a fetch hands over (`Fetched`) and the terminate message. The worker
calls a front end only on its own thread; the doors' adapters live in `batch_manager.legacy`
(GptManager) and `batch_manager.executor`."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Protocol

from runtime.request import RequestOutput, RequestSpec

from ..scheduling.llm_request import LlmRequest
from ..stats import IterationStats

if TYPE_CHECKING:
    from ..kv_transport.kv_handoff import ExportedKv

TERMINATED = "terminated: the terminate request id was received"


@dataclass(frozen=True)
class Fetched:
    requests: list[Any]       # items with a `request_id`, admitted later through `FrontEnd.admit`
    num_items: int            # everything handed over (dropped items included): 0 lets the worker idle
    terminate: bool = False   # stop now: fail everything (GptManager's terminate_req_id)


class FrontEnd(Protocol):
    @property
    def num_pending(self) -> int:
        """Requests waiting on the front end's side; the worker keeps fetching them after a
        shutdown while this is non-zero."""

    @property
    def has_stats(self) -> bool:
        """Whether `report_stats` wants iteration stats (they are not built otherwise)."""

    def fetch(self, max_num_requests: int) -> Fetched:
        """At most `max_num_requests` new requests."""

    def wait_for_work(self, stop: threading.Event, poll_s: float) -> None:
        """The worker idles: return when new requests or stop ids may have arrived, `stop` is
        set, or after `poll_s` (a front end that hears of its requests may block longer, up to
        half a second, if `wake` ends the wait)."""

    def wake(self) -> None:
        """End a `wait_for_work` (the worker is stopping)."""

    def admit(self, item: Any, arrival_index: int) -> LlmRequest:
        """A fetched item as an admitted request (its spec validated, its resources resolved);
        raises ValueError (answered as that request's error) for bad input."""

    def poll_stop_ids(self) -> Iterable[Any]:
        """Ids of requests to end with what they have."""

    def respond(self, spec: RequestSpec, output: RequestOutput, is_final: bool,
                kv_export: ExportedKv | None = None) -> None:
        """Answer a request from its output: its final response, or (streaming) the tokens
        generated since its last response, if any. `kv_export`: where a context-only request's KV
        blocks were kept for a generation instance (its final response says so), else None. May
        raise while building the response, before anything is sent: the worker then fails the
        request."""

    def respond_error(self, request_id: Any, message: str) -> None:
        """A final error response: the request ends (what the front end keeps of it goes)."""

    def refuse(self, request_id: Any, message: str) -> None:
        """The final error response of a request that was never admitted (bad input, a duplicate
        id, a failed or terminated run): an active request with the same id is untouched."""

    def report_stats(self, stats: IterationStats, scheduled_ids: frozenset[int], scheduler,
                     finished: list[LlmRequest]) -> None:
        """One iteration's stats; `scheduler` (read only) and the requests that finished in this
        iteration give the per-request view."""
