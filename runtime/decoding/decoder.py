"""The decoder: turns one step's last-token logits into tokens for a batch of requests with any
mix of settings (greedy, sampling, beam search), through the kernel backend's decoding
operations. Owns nothing across steps; each request's progress lives in its `DecodeState` and
its tokens in its `RequestOutput` (read here; its owner applies the returned `DecodeOutcome`s).
GptSession and the batch manager's model executor both drive it.

Rows: `step(states, logits, drafts)` takes logits float32 [R, V] whose rows are the states' live
beams in order (state i contributes `states[i].num_rows` rows: 1 on its first step, its beam width
after), or, for a state with D draft tokens (beam width 1), D + 1 rows: the logits after its last
token and after each draft. Row j is processed (penalties, bans, min length, top-p decay) as if
drafts[:j] had been generated one by one; the accepted drafts and one token of the model's are
appended (speculative.py has the acceptance rules).
Randomness: the draw for a request's token t of beam b is `rng.uniforms(seed, t, b)`; draft
acceptance tests draw from stream `ACCEPT_STREAM` at the draft's position.
No token allowed: a token whose processed logit is -inf is never chosen. Where a request's row
(every beam's, for beam search; any sample's) has none left, it ends with finish reason
NO_TOKEN and nothing from that row; its owner reports the step.
"""
from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ..kernels.interface import NO_TOKEN
from ..request.output import BeamOutputs, RequestOutput
from ..request.spec import FinishReason
from .beam_search import BeamSearch, Hypothesis
from .guided import Guide
from .params import DecodingParams
from .processing import StepRows, process_logits
from .samples import Samples
from .speculative import DraftVerifier


class DecodeState:
    """One request's decoding progress: the decayed top-p, the cumulative log prob, the
    beam-search bank; its tokens are read from its `RequestOutput`, which its owner updates with
    each step's `DecodeOutcome` before the next step."""

    def __init__(self, params: DecodingParams, record: RequestOutput, max_new_tokens: int,
                 gather_generation_logits: bool = False):
        assert max_new_tokens >= 1
        self.params = params
        self.record = record
        self.max_new_tokens = max_new_tokens
        self.gather_generation_logits = gather_generation_logits
        self.cum_log_prob = 0.0
        self.search = (BeamSearch(params.beam_width, params.length_penalty, params.early_stopping,
                                  params.diversity_rate, max_new_tokens) if params.is_beam_search else None)
        self.samples = (Samples(params.num_return_sequences, params.random_seed, params.top_p,
                                gather_generation_logits) if params.num_return_sequences > 1 else None)
        # Beam search: the live hypotheses (log probs, scores, gathered logits) of the bank.
        self.live = [Hypothesis([], [], 0.0, 0.0, [] if gather_generation_logits else None)]
        self.top_p = params.top_p
        # END_ID | STOP_WORDS | LENGTH | NO_TOKEN (no token was allowed: every logit -inf)
        self.finish_reason: FinishReason | None = None
        # External drafts (params.draft_logits): dropped once their step is decoded.
        self.draft_logits: torch.Tensor | None = params.draft_logits
        self.draft_acceptance_threshold: float | None = params.draft_acceptance_threshold
        self.guide: Guide | None = None   # guided decoding: the grammar's matcher state (guided.py)
        if params.guide is not None:
            template = params.guide.result() if isinstance(params.guide, Future) else params.guide
            self.guide = template.start()

    def advance_top_p(self, token: int) -> None:
        """Top-p decay after `token` was generated (reset by the reset id)."""
        p = self.params
        if p.top_p_decay != 1.0 or p.top_p_reset_id >= 0:
            self.top_p = p.top_p if token == p.top_p_reset_id else max(self.top_p * p.top_p_decay, p.top_p_min)

    def resume_after(self, first_token: int, first_log_prob: float) -> None:
        """Continue a request whose first token was decoded elsewhere (its record holds it already)."""
        self.cum_log_prob = first_log_prob
        self.advance_top_p(first_token)

    @property
    def num_rows(self) -> int:
        return len(self.record.beams)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_generated(self) -> int:
        return self.record.num_generated

    def ends_beam(self, tokens: list[int], token: int) -> FinishReason | None:
        """Why appending `token` to generated `tokens` ends the beam, or None."""
        if token == self.params.end_id:
            return FinishReason.END_ID
        for word in self.params.stop_words:
            n = len(word)
            if word[-1] == token and len(tokens) >= n - 1 and tuple(tokens[len(tokens) - n + 1:]) == word[:-1]:
                return FinishReason.STOP_WORDS
        return None


@dataclass(frozen=True)
class DecodeOutcome:
    """What one step decoded for one request (apply it to the request's RequestOutput)."""
    tokens: tuple[int, ...] = ()        # beam width 1: tokens appended (none when the end id ended it)
    log_probs: tuple[float, ...] = ()
    logits: tuple = ()                  # raw float32 [V] rows per token (on the host), when gathered
    cum_log_prob: float = 0.0           # includes an end token's log prob
    beams: BeamOutputs | None = None    # beam search
    finish_reason: FinishReason | None = None   # as DecodeState.finish_reason (NO_TOKEN: nothing was allowed)
    num_accepted_drafts: int = 0        # drafts among `tokens` (their KV, computed this step, is kept)
    # num_top_log_probs k: per token of `tokens`, (k log probs, descending; their k token ids)
    top_log_probs: tuple[tuple[tuple[float, ...], tuple[int, ...]], ...] = ()


class Decoder:
    def __init__(self, kernels):
        self.kernels = kernels
        self.verifier = DraftVerifier(kernels)

    @torch.inference_mode()  # the runner's outputs are inference tensors, modified in place here
    def step(self, states: list[DecodeState], logits: torch.Tensor,
             drafts: list[tuple[int, ...]] | None = None) -> list[DecodeOutcome]:
        """Process and select the tokens of every state (see module doc) -> each state's outcome,
        in order. drafts[i]: state i's draft tokens this step (empty: none). logits may be
        modified in place."""
        drafts = drafts or [()] * len(states)
        rows = StepRows.of(states, drafts)
        outcomes: list[DecodeOutcome | None] = [None] * len(states)
        assert logits.shape[0] == len(rows.state_of_row), "one logits row per live beam (and per draft)"
        wants_raw = any(s.gather_generation_logits or s.params.num_top_log_probs for s in states)
        raw = logits.clone() if wants_raw else None
        tops = self._top_log_probs(states, drafts, raw, rows)
        process_logits(self.kernels, states, drafts, logits, rows)
        single = [i for i, s in enumerate(states) if s.search is None and s.samples is None]
        greedy = [i for i in single if states[i].params.is_greedy]
        sampled = [i for i in single if not states[i].params.is_greedy and not drafts[i]]
        if greedy:
            # one row per request, or 1 + D with drafts
            spans = [range(rows.first_row[i], rows.first_row[i] + 1 + len(drafts[i])) for i in greedy]
            index = [r for span in spans for r in span]
            picked = logits if index == list(range(logits.shape[0])) else \
                logits[torch.tensor(index, device=logits.device)]   # (a gather of 1 x 49152 costs ~75 us)
            tokens, log_probs = (t.tolist() for t in self.kernels.greedy(picked))
            start = 0
            for i in greedy:
                n = 1 + len(drafts[i])
                chosen = tokens[start:start + n]
                picks = [(token, lp, j < len(drafts[i]) and token == drafts[i][j])
                         for j, (token, lp) in enumerate(zip(chosen, log_probs[start:start + n]))]
                outcomes[i] = self._accept(states[i], picks, raw, rows.first_row[i], tops.get(i))
                start += n
        if sampled:
            self._sample(states, sampled, logits, raw, rows, outcomes, tops)
        for i, state in enumerate(states):
            if state.search is None and not state.params.is_greedy and drafts[i]:
                first = rows.first_row[i]
                picks = self.verifier.verify(state, drafts[i], logits[first:first + len(drafts[i]) + 1])
                outcomes[i] = self._accept(state, picks, raw, first, tops.get(i))
                state.draft_logits = None   # they described the request's external drafts only
            elif state.search is not None:
                outcomes[i] = self._beam_step(state, logits, raw, rows.first_row[i])
            elif state.samples is not None:
                outcomes[i] = self._samples_step(state, logits, raw, rows.first_row[i])
        return outcomes

    @classmethod
    def accept_steps(cls, state: DecodeState, tokens: list[int], log_probs: list[float]) -> DecodeOutcome:
        """The outcome of n greedy steps computed in one call (runtime.ModelRunner.decode_greedy)
        for a plain-greedy state (DecodingParams.is_plain_greedy): tokens[j] and its log prob were
        picked after tokens[:j], so each but the last is accepted like a verified draft, until one
        ends the request (end id, stop word, length); the tokens after it are dropped."""
        assert state.params.is_plain_greedy and state.search is None and state.samples is None
        last = len(tokens) - 1
        return cls._accept(state, [(token, log_prob, j < last)
                                   for j, (token, log_prob) in enumerate(zip(tokens, log_probs))], None, 0)

    def _top_log_probs(self, states, drafts, raw, rows: StepRows) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """state index -> (values [rows, k], ids [rows, k]) of the raw logits, for the states that
        want num_top_log_probs k (one kernel call per distinct k)."""
        by_k: dict[int, list[int]] = {}
        for i, s in enumerate(states):
            if s.params.num_top_log_probs:
                by_k.setdefault(s.params.num_top_log_probs, []).append(i)
        out = {}
        for k, picked in by_k.items():
            spans = [range(rows.first_row[i], rows.first_row[i] + states[i].num_rows + len(drafts[i])) for i in picked]
            values, ids = self.kernels.top_log_probs(raw[torch.tensor([r for span in spans for r in span],
                                                                      device=raw.device)], k)
            start = 0
            for i, span in zip(picked, spans):
                out[i] = (values[start:start + len(span)], ids[start:start + len(span)])
                start += len(span)
        return out

    def _sample(self, states, picked: list[int], logits, raw, rows: StepRows, outcomes: list, tops: dict) -> None:
        device = logits.device
        chosen = [states[i] for i in picked]
        index = torch.tensor([rows.first_row[i] for i in picked], device=device)
        # uint64 seeds travel as their int64 bit pattern
        seeds = [s.params.random_seed - (1 << 64) if s.params.random_seed >= 1 << 63 else s.params.random_seed
                 for s in chosen]
        draws = self.kernels.uniforms(torch.tensor(seeds, dtype=torch.int64, device=device),
                                      torch.tensor([s.num_generated for s in chosen], dtype=torch.int64, device=device),
                                      torch.zeros(len(chosen), dtype=torch.int64, device=device))
        tokens, log_probs = self.kernels.sample(
            logits[index],
            torch.tensor([s.params.top_k for s in chosen], dtype=torch.int64, device=device),
            torch.tensor([s.top_p for s in chosen], dtype=torch.float32, device=device),
            draws,
            torch.tensor([s.params.normalize_log_probs for s in chosen], device=device))
        for i, token, log_prob in zip(picked, tokens.tolist(), log_probs.tolist()):
            outcomes[i] = self._accept(states[i], [(token, log_prob, False)], raw, rows.first_row[i], tops.get(i))

    @staticmethod
    def _accept(state: DecodeState, picks: list[tuple[int, float, bool]], raw, first_row: int,
                top: tuple[torch.Tensor, torch.Tensor] | None = None) -> DecodeOutcome:
        """Append picks[j] = (token, log prob, it equals draft j) in order, as if generated one by
        one, until one ends the request or is not an accepted draft (the model's own token)."""
        generated = state.record.beams[0]
        tokens: list[int] = []
        log_probs: list[float] = []
        logits: list[torch.Tensor] = []
        for j, (token, log_prob, is_accepted_draft) in enumerate(picks):
            if token == NO_TOKEN:   # the guide and the bans left nothing: the request ends here
                state.finish_reason = FinishReason.NO_TOKEN
                break
            reason = state.ends_beam(generated + tokens if tokens else generated, token)
            if state.guide is not None and state.guide.ends(0, token):
                reason = FinishReason.END_ID   # the grammar is complete: its stop token ends the request
            state.cum_log_prob += log_prob
            if reason == FinishReason.END_ID:
                state.finish_reason = reason
                break
            tokens.append(token)
            log_probs.append(log_prob)
            if state.guide is not None:
                state.guide.consume(0, [token])
            if raw is not None and state.gather_generation_logits:
                logits.append(raw[first_row + j].cpu())
            state.advance_top_p(token)
            if reason is None and len(generated) + len(tokens) >= state.max_new_tokens:
                reason = FinishReason.LENGTH
            state.finish_reason = reason
            if reason is not None or not is_accepted_draft:
                break
        num_accepted = sum(1 for _ in itertools.takewhile(lambda pick: pick[2], picks[:len(tokens)]))
        tops = () if top is None else tuple(zip((tuple(v) for v in top[0][:len(tokens)].tolist()),
                                                (tuple(i) for i in top[1][:len(tokens)].tolist())))
        return DecodeOutcome(tuple(tokens), tuple(log_probs), tuple(logits), state.cum_log_prob,
                             finish_reason=state.finish_reason, num_accepted_drafts=num_accepted,
                             top_log_probs=tops)

    def _beam_step(self, state: DecodeState, logits, raw, first_row: int) -> DecodeOutcome:
        span = slice(first_row, first_row + state.num_rows)
        search = state.search
        log_probs = self.kernels.log_softmax(logits[span])
        log_probs = log_probs.masked_fill(log_probs.isnan(), float("-inf"))   # a beam with every token masked
        running = torch.tensor(search.running_scores, dtype=torch.float32, device=logits.device)
        candidates = self.kernels.beam_candidates(log_probs, running, search.num_candidates, search.diversity_rate)
        allowed = candidates[0] > float("-inf")   # best first: the masked continuations come last
        if not bool(allowed.any()):
            state.finish_reason = FinishReason.NO_TOKEN
            return DecodeOutcome(finish_reason=state.finish_reason)
        candidates = tuple(c[allowed] for c in candidates)
        step_log_probs = log_probs[candidates[1], candidates[2]].tolist()
        histories = state.live
        guide = state.guide
        parents = search.step(candidates, step_log_probs, histories,
                              lambda parent, token: (state.ends_beam(histories[parent].tokens, token) is not None
                                                     or (guide is not None and guide.ends(parent, token))),
                              None if raw is None or not state.gather_generation_logits else raw[span])
        state.live = search.live
        if guide is not None and parents:
            guide.fork(parents, [h.tokens[-1] for h in state.live])
        if search.done:
            best = search.final(state.live)[0]
            state.finish_reason = (state.ends_beam(best.tokens[:-1], best.tokens[-1]) if best.tokens else None) \
                or FinishReason.LENGTH
        outputs = [_without_end(h, state.params.end_id)
                   for h in (search.final(state.live) if state.is_finished else state.live)]
        return DecodeOutcome(beams=_beam_outputs(parents, state.live, outputs, state.is_finished),
                             finish_reason=state.finish_reason)

    def _samples_step(self, state: DecodeState, logits, raw, first_row: int) -> DecodeOutcome:
        """num_return_sequences: each live sequence draws its own token (samples.py)."""
        samples = state.samples
        parents = samples.step(self.kernels, state, logits, raw, first_row)
        if FinishReason.NO_TOKEN in samples.reasons:   # one sequence had no token allowed: the request ends
            state.finish_reason = FinishReason.NO_TOKEN
            return DecodeOutcome(finish_reason=state.finish_reason)
        if samples.done:
            state.finish_reason = next(r for r in reversed(samples.reasons) if r is not None)
        live = [samples.outputs[i] for i in samples.live]
        return DecodeOutcome(beams=_beam_outputs(parents, live, samples.outputs, state.is_finished),
                             finish_reason=state.finish_reason)


def _beam_outputs(parents, live: list[Hypothesis], outputs: list[Hypothesis], finished: bool) -> BeamOutputs:
    return BeamOutputs(
        parents=tuple(parents), live_tokens=() if finished else tuple(tuple(h.tokens) for h in live),
        tokens=tuple(tuple(h.tokens) for h in outputs), log_probs=tuple(tuple(h.log_probs) for h in outputs),
        cum_log_probs=tuple(h.cum_log_prob for h in outputs),
        generation_logits=tuple(tuple(row.cpu() for row in h.logits) for h in outputs)
        if outputs[0].logits is not None else ())


def _without_end(h: Hypothesis, end_id: int | None) -> Hypothesis:
    """An output beam without its trailing end token."""
    if h.tokens and h.tokens[-1] == end_id:
        return Hypothesis(h.tokens[:-1], h.log_probs[:-1], h.cum_log_prob, h.score,
                          None if h.logits is None else h.logits[:-1])
    return h
