"""Decoding for the manager: each active request's runtime DecodeState, the logits
post-processors (per request and batched), one decoder step over the requests of a step, and the
results recorded on the requests (tokens, log probs, beams, finish reasons). The model executor
calls it with the step's last-token logits; a request's state survives pauses and goes with it.
"""
from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Callable

import torch

from runtime.decoder import Decoder, DecodeState
from runtime.decoding_params import DecodingParams

from .llm_request import FinishReason, LlmRequest, RequestState

logger = logging.getLogger(__name__)

_FINISH_REASONS = {"end_id": FinishReason.END_ID, "stop_words": FinishReason.STOP_WORDS,
                   "length": FinishReason.LENGTH}


def decoding_params(r: LlmRequest, normalize_log_probs: bool) -> DecodingParams:
    # SamplingParams mirrors DecodingParams field for field (the manager's pure copy of it).
    return DecodingParams(**dataclasses.asdict(r.sampling), beam_width=r.beam_width,
                          end_id=-1 if r.end_id is None else r.end_id, normalize_log_probs=normalize_log_probs,
                          embedding_bias=r.embedding_bias)


class RequestDecoder:
    def __init__(self, kernels, normalize_log_probs: bool = True,
                 batched_post_processor: Callable | None = None):
        self.decoder = Decoder(kernels)
        self.normalize_log_probs = normalize_log_probs
        self.batched_post_processor = batched_post_processor
        # LlmRequest -> DecodeState; entries go with their request (explicit release or collection).
        self._states: weakref.WeakKeyDictionary[LlmRequest, DecodeState] = weakref.WeakKeyDictionary()

    def state(self, r: LlmRequest) -> DecodeState:
        state = self._states.get(r)
        if state is None:
            state = DecodeState(decoding_params(r, self.normalize_log_probs), r.prompt, r.max_new_tokens,
                                r.return_generation_logits)
            self._states[r] = state
        return state

    def num_rows(self, r: LlmRequest) -> int:
        """Logits rows the request contributes to its next step (its live beams)."""
        return self.state(r).num_rows

    def release(self, r: LlmRequest) -> None:
        self._states.pop(r, None)

    def decode(self, requests: list[LlmRequest], logits: torch.Tensor) -> None:
        """logits float32 [sum of num_rows, V], the requests' rows in order: one step for each."""
        states = [self.state(r) for r in requests]
        spans, start = [], 0
        for s in states:
            spans.append((start, start + s.num_rows))
            start += s.num_rows
        assert start == logits.shape[0], "one logits row per live beam"
        with torch.inference_mode():  # the runtime's outputs are inference tensors
            failures = self._post_process(requests, states, logits, spans)
        keep = [i for i, r in enumerate(requests) if r not in failures]
        for r, message in failures.items():
            r.finish(FinishReason.ERROR, message)
            self.release(r)
        if not keep:
            return
        if len(keep) < len(requests):
            logits = logits[[row for i in keep for row in range(*spans[i])]]
        self.decoder.step([states[i] for i in keep], logits)
        for i in keep:
            self._record(requests[i], states[i])

    def _post_process(self, requests, states, logits: torch.Tensor, spans) -> dict[LlmRequest, str]:
        """Per-request post-processors, fn(request_id, logits [beams, V], token_ids [per beam],
        stream, client_id), then the batched one over every request that asked for it; both may
        modify the logits in place or return new ones. -> the requests whose processor raised."""
        failures: dict[LlmRequest, str] = {}

        def token_ids(r: LlmRequest, s: DecodeState) -> list[list[int]]:
            return [r.prompt + h.tokens for h in s.beams]

        for r, s, (lo, hi) in zip(requests, states, spans):
            if r.logits_post_processor is None:
                continue
            view = logits[lo:hi]
            try:
                result = r.logits_post_processor(r.request_id, view, token_ids(r, s), None, None)
                if isinstance(result, torch.Tensor) and result is not view:
                    view.copy_(result.reshape(view.shape))
            except Exception as e:  # noqa: BLE001 - user code fails only its own request
                logger.exception("logits post-processor of request %s raised", r.request_id)
                failures[r] = f"logits post-processor raised: {e!r}"
        batched = [i for i, r in enumerate(requests) if r.use_batched_post_processor and r not in failures]
        if batched and self.batched_post_processor is not None:
            views = [logits[spans[i][0]:spans[i][1]] for i in batched]
            try:
                results = self.batched_post_processor([requests[i].request_id for i in batched], views,
                                                      [token_ids(requests[i], states[i]) for i in batched],
                                                      None, [None] * len(batched))
                for view, result in zip(views, results or []):
                    if isinstance(result, torch.Tensor) and result is not view:
                        view.copy_(result.reshape(view.shape))
            except Exception as e:  # noqa: BLE001 - fails the requests it was called for
                logger.exception("batched logits post-processor raised")
                for i in batched:
                    failures[requests[i]] = f"batched logits post-processor raised: {e!r}"
        return failures

    def _record(self, r: LlmRequest, s: DecodeState) -> None:
        if s.search is None:
            h = s.beams[0]
            r.cum_log_prob = h.cum_log_prob
            if len(h.tokens) > len(r.generated):  # a new token (none when the end id ended it)
                r.generated.append(h.tokens[-1])
                r.log_probs.append(h.log_probs[-1])
                if h.logits is not None:
                    r.generation_logits.append(h.logits[-1].cpu())
        else:
            beams = s.outputs()
            r.beam_tokens = [h.tokens for h in beams]
            r.beam_log_probs = [h.log_probs for h in beams]
            r.beam_cum_log_probs = [h.cum_log_prob for h in beams]
            r.generation_logits = [[row.cpu() for row in h.logits] for h in beams] if beams[0].logits is not None \
                else []
            # KV accounting follows the live beams (all of one length); the final answer is beam 0.
            r.generated = list((beams if s.is_finished else s.beams)[0].tokens)
        if s.is_finished:
            r.finish(_FINISH_REASONS[s.finish_reason])
            self.release(r)
        elif r.state == RequestState.CONTEXT:
            r.set_state(RequestState.GENERATION)
