"""The executor's decoder store: request id -> runtime DecodeState (beam bank, decayed top-p;
the tokens are read from the request's TokenRecord, which the scheduler keeps), opened by a
step's `NewRequest` and freed by its released ids (or when the decoder finishes the request). `decode` runs the logits post-processors and one decoder step
and returns each request's `RequestResult`; it writes nothing outside this store.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch

from runtime.decoding import Decoder, DecodeState

from .step import NewRequest, RequestResult, ScheduledRequest

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Entry:
    state: DecodeState
    post_processor: Callable | None
    use_batched_post_processor: bool
    client_id: Any = None


class RequestDecoder:
    def __init__(self, kernels, batched_post_processor: Callable | None = None):
        self.decoder = Decoder(kernels)
        self.batched_post_processor = batched_post_processor
        self._entries: dict[int, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def open(self, request_id: int, new: NewRequest) -> None:
        state = DecodeState(new.decoding_params, new.record, new.max_new_tokens, new.return_generation_logits)
        self._entries[request_id] = _Entry(state, new.logits_post_processor, new.use_batched_post_processor,
                                           new.client_id)

    def release(self, request_ids) -> None:
        for request_id in request_ids:
            self._entries.pop(request_id, None)

    def decode(self, requests: list[ScheduledRequest], logits: torch.Tensor) -> dict[int, RequestResult]:
        """logits float32 [sum of live beams, V], the requests' rows in order: one step for each."""
        entries = [self._entries[r.request_id] for r in requests]
        spans, start = [], 0
        for e in entries:
            spans.append((start, start + e.state.num_rows))
            start += e.state.num_rows
        assert start == logits.shape[0], "one logits row per live beam"
        with torch.inference_mode():  # the runtime's outputs are inference tensors
            failures = self._post_process(requests, entries, logits, spans)
        results = {r.request_id: RequestResult(r.request_id, error=failures[r.request_id])
                   for r in requests if r.request_id in failures}
        keep = [i for i, r in enumerate(requests) if r.request_id not in failures]
        if keep:
            if len(keep) < len(requests):
                logits = logits[[row for i in keep for row in range(*spans[i])]]
            outcomes = self.decoder.step([entries[i].state for i in keep], logits)
            for i, o in zip(keep, outcomes):
                results[requests[i].request_id] = RequestResult(
                    requests[i].request_id, new_tokens=o.tokens, new_log_probs=o.log_probs,
                    new_generation_logits=o.logits, cum_log_prob=o.cum_log_prob,
                    beams=o.beams, finish_reason=o.finish_reason)
        self.release(r.request_id for r in requests if r.request_id in failures or
                     self._entries[r.request_id].state.is_finished)
        return results

    def _post_process(self, requests, entries: list[_Entry], logits: torch.Tensor, spans) -> dict[int, str]:
        """Per-request post-processors, fn(request_id, logits [beams, V], token_ids [per beam],
        stream, client_id), then the batched one over every request that asked for it; both may
        modify the logits in place or return new ones. -> request id -> error, for those that raised."""
        failures: dict[int, str] = {}

        def token_ids(e: _Entry) -> list[list[int]]:
            return [e.state.record.sequence(b) for b in range(e.state.num_rows)]

        for r, e, (lo, hi) in zip(requests, entries, spans):
            if e.post_processor is None:
                continue
            view = logits[lo:hi]
            try:
                _write_back(view, e.post_processor(r.request_id, view, token_ids(e), None, e.client_id))
            except Exception as exc:  # noqa: BLE001 - user code fails only its own request
                logger.exception("logits post-processor of request %s raised", r.request_id)
                failures[r.request_id] = f"logits post-processor raised: {exc!r}"
        batched = [i for i, (r, e) in enumerate(zip(requests, entries))
                   if e.use_batched_post_processor and r.request_id not in failures]
        if batched and self.batched_post_processor is not None:
            views = [logits[spans[i][0]:spans[i][1]] for i in batched]
            try:
                outputs = self.batched_post_processor([requests[i].request_id for i in batched], views,
                                                      [token_ids(entries[i]) for i in batched],
                                                      None, [entries[i].client_id for i in batched])
                for view, output in zip(views, outputs or []):
                    _write_back(view, output)
            except Exception as exc:  # noqa: BLE001 - fails the requests it was called for
                logger.exception("batched logits post-processor raised")
                for i in batched:
                    failures[requests[i].request_id] = f"batched logits post-processor raised: {exc!r}"
        return failures


def _write_back(view: torch.Tensor, output) -> None:
    if isinstance(output, torch.Tensor) and output is not view:
        view.copy_(output.reshape(view.shape))

