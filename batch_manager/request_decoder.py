"""The executor's decoder store: request id -> runtime DecodeState (beam bank, decayed top-p;
the tokens are read from the request's RequestOutput, which the scheduler keeps), opened by a
step's `NewRequest` and freed by its released ids (or when the decoder finishes the request). `decode` runs the logits post-processors and one decoder step
and returns each request's `RequestResult`; it writes nothing outside this store.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch

from runtime import GreedySteps
from runtime.decoding import Decoder, DecodeState
from runtime.request import FinishReason

from .scheduling.step import NewRequest, RequestResult, ScheduledRequest

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
        spec = new.spec
        state = DecodeState(spec.decoding, new.record, spec.max_new_tokens, spec.return_generation_logits)
        if spec.resumed is not None:   # generation-only: the context instance decoded its first token
            state.resume_after(spec.resumed.first_token, spec.resumed.first_log_prob)
        self._entries[request_id] = _Entry(state, spec.logits_post_processor, spec.use_batched_post_processor,
                                           spec.client_id)

    def release(self, request_ids) -> None:
        for request_id in request_ids:
            self._entries.pop(request_id, None)

    def decode(self, requests: list[ScheduledRequest], logits: torch.Tensor) -> dict[int, RequestResult]:
        """logits float32 [rows, V], the requests' rows in order (one per live beam, or 1 + D for a
        request with D drafts): one step for each."""
        entries = [self._entries[r.request_id] for r in requests]
        spans, start = [], 0
        for r, e in zip(requests, entries):
            spans.append((start, start + e.state.num_rows + r.num_draft_tokens))
            start = spans[-1][1]
        assert start == logits.shape[0], "one logits row per live beam (and per draft)"
        with torch.inference_mode():  # the runtime's outputs are inference tensors
            failures = self._post_process(requests, entries, logits, spans)
        results = {r.request_id: RequestResult(r.request_id, error=failures[r.request_id])
                   for r in requests if r.request_id in failures}
        keep = [i for i, r in enumerate(requests) if r.request_id not in failures]
        if keep:
            all_logits = logits
            if len(keep) < len(requests):
                logits = logits[[row for i in keep for row in range(*spans[i])]]
            outcomes = self.decoder.step([entries[i].state for i in keep], logits, [requests[i].drafts for i in keep])
            for i, o in zip(keep, outcomes):
                if o.finish_reason == FinishReason.NO_TOKEN:
                    state, (lo, hi) = entries[i].state, spans[i]
                    is_nan = bool(torch.isnan(all_logits[lo:hi]).any())
                    results[requests[i].request_id] = RequestResult(requests[i].request_id, error=_no_token_error(
                        state, state.num_generated + len(o.tokens), is_nan))
                    continue
                results[requests[i].request_id] = RequestResult(requests[i].request_id, o)
        self.release(r.request_id for r in requests if r.request_id in failures or
                     self._entries[r.request_id].state.is_finished)
        return results

    def end_ids(self, requests: list[ScheduledRequest]) -> list[int | None]:
        return [self._entries[r.request_id].state.params.end_id for r in requests]

    def accept_steps(self, requests: list[ScheduledRequest], steps: GreedySteps) -> list[RequestResult]:
        """The results of plain-greedy requests that ran several steps in one call
        (ModelRunner.decode_greedy): each takes its picks up to the first that ends it."""
        results = []
        for r, tokens, log_probs in zip(requests, steps.tokens.tolist(), steps.log_probs.tolist()):
            state = self._entries[r.request_id].state
            outcome = Decoder.accept_steps(state, tokens, log_probs)
            if outcome.finish_reason == FinishReason.NO_TOKEN:   # no bans, no guide: the model's logits were NaN
                results.append(RequestResult(r.request_id, error=_no_token_error(
                    state, state.num_generated + len(outcome.tokens), is_nan=True)))
            else:
                results.append(RequestResult(r.request_id, outcome))
        self.release(r.request_id for r, result in zip(requests, results)
                     if result.error is not None or self._entries[r.request_id].state.is_finished)
        return results

    def _post_process(self, requests, entries: list[_Entry], logits: torch.Tensor, spans) -> dict[int, str]:
        """Per-request post-processors, fn(request_id, logits [beams, V], token_ids [per beam],
        stream, client_id), then the batched one over every request that asked for it; both may
        modify the logits in place or return new ones. A request with drafts is handed each of its
        positions in turn (logits [1, V], its tokens and the drafts before that position), as if
        they had been generated one by one. -> request id -> error, for those that raised."""
        failures: dict[int, str] = {}

        def positions(r: ScheduledRequest, e: _Entry, lo: int, hi: int) -> list[tuple[torch.Tensor, list]]:
            if not r.num_draft_tokens:
                return [(logits[lo:hi], [e.state.record.sequence(b) for b in range(e.state.num_rows)])]
            sequence = e.state.record.sequence(0)
            return [(logits[lo + j:lo + j + 1], [sequence + list(r.drafts[:j])]) for j in range(hi - lo)]

        for r, e, (lo, hi) in zip(requests, entries, spans):
            if e.post_processor is None:
                continue
            try:
                for view, token_ids in positions(r, e, lo, hi):
                    _write_back(view, e.post_processor(r.request_id, view, token_ids, None, e.client_id))
            except Exception as exc:  # noqa: BLE001 - user code fails only its own request
                logger.exception("logits post-processor of request %s raised", r.request_id)
                failures[r.request_id] = f"logits post-processor raised: {exc!r}"
        batched = [i for i, (r, e) in enumerate(zip(requests, entries))
                   if e.use_batched_post_processor and r.request_id not in failures]
        if batched and self.batched_post_processor is not None:
            calls = [(i, view, token_ids) for i in batched
                     for view, token_ids in positions(requests[i], entries[i], *spans[i])]
            try:
                outputs = self.batched_post_processor([requests[i].request_id for i, _, _ in calls],
                                                      [view for _, view, _ in calls],
                                                      [token_ids for _, _, token_ids in calls],
                                                      None, [entries[i].client_id for i, _, _ in calls])
                for (_, view, _), output in zip(calls, outputs or []):
                    _write_back(view, output)
            except Exception as exc:  # noqa: BLE001 - fails the requests it was called for
                logger.exception("batched logits post-processor raised")
                for i in batched:
                    failures[requests[i].request_id] = f"batched logits post-processor raised: {exc!r}"
        return failures


def _no_token_error(state: DecodeState, step: int, is_nan: bool) -> str:
    """The error ending a request whose logits allowed no token at generation step `step` (0: the
    first generated token); `is_nan`: its logits held NaN (the model's, or a post-processor's)."""
    if is_nan:
        return (f"logits: no token is allowed at generation step {step}: the logits are NaN (a model that "
                "computes NaN, e.g. from non-finite weights, or a logits post-processor that wrote NaN)")
    if state.guide is not None:
        return (f"guided_decoding_params: no token is allowed at generation step {step}: the guide and the bans "
                "(bad_words, min_length, a logits post-processor) leave none (the end id only where the guide "
                "is complete)")
    return (f"bad_words: no token is allowed at generation step {step}: every logit is -inf after bad_words, "
            "no_repeat_ngram_size and the logits post-processor")


def _write_back(view: torch.Tensor, output) -> None:
    if isinstance(output, torch.Tensor) and output is not view:
        view.copy_(output.reshape(view.shape))

