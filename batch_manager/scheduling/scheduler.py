"""The scheduler: the sole owner of the active requests' states and of the KV cache manager.

Each request has computed tokens and a target (its token list); each step hands out a token
budget. `schedule()` runs the capacity stage (who holds KV blocks: admit, grow, pause), then the
micro-batch stage (who runs this step, chunking contexts) and returns a frozen `ScheduledStep`;
`update(step, result)` applies what the model executor returned. Plain Python on ints and lists.
"""
from __future__ import annotations

from runtime.cache.beam_blocks import beam_holder, fork_beams
from runtime.cache.kv_cache_manager import KvCacheManager

from .capacity_scheduler import CapacityScheduler
from runtime.request import FinishReason

from .llm_request import LlmRequest, RequestState
from .micro_batch_scheduler import MicroBatchScheduler
from .prompt_lookup import propose_drafts
from .step import NewRequest, RequestResult, ScheduledRequest, ScheduledStep, StepResult


class Scheduler:
    def __init__(self, kv_cache_manager: KvCacheManager, capacity: CapacityScheduler,
                 micro_batch: MicroBatchScheduler, separate_context_forward: bool = False,
                 prompt_lookup_num_tokens: int = 0, max_matching_ngram_size: int = 3,
                 prompt_lookup_max_batch_size: int = 0):
        self.kv, self.capacity, self.micro_batch = kv_cache_manager, capacity, micro_batch
        self.separate_context_forward = separate_context_forward
        # The built-in drafter (prompt lookup) for greedy requests of beam width 1; 0 = off.
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens
        self.max_matching_ngram_size = max_matching_ngram_size
        self.prompt_lookup_max_batch_size = prompt_lookup_max_batch_size   # 0: drafts at any batch size
        self._requests: dict[int, LlmRequest] = {}   # admission order
        self._released_ids: list[int] = []          # ended with a decoder state: freed by the next step
        self.num_draft_tokens_proposed = 0          # cumulative: drafts sent to verification
        self.num_draft_tokens_accepted = 0
        self._num_steps = 0
        # kv_handoff.KvExports (the Executor's): context-only requests' blocks kept for transfer.
        self.kv_exports = None

    @property
    def num_active(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._requests

    def get(self, request_id: int) -> LlmRequest | None:
        """The request, for reading (responses, stats); only the scheduler changes it."""
        return self._requests.get(request_id)

    def active_requests(self) -> list[LlmRequest]:
        """Every active request in admission order, for reading (stats)."""
        return list(self._requests.values())

    def add(self, r: LlmRequest) -> None:
        """Admit `r`; one whose adapter the PEFT cache refuses ends at once with that error."""
        assert r.request_id not in self._requests, f"request {r.request_id} is active already"
        if self._uses_drafter(r):
            r.max_draft_len = max(r.max_draft_len, self.prompt_lookup_num_tokens)
        # Drafts never take a request past max_new_tokens: D <= what is left after one more token.
        del r.draft_tokens[max(0, r.max_new_tokens - 1):]
        self._requests[r.request_id] = r
        error = self.capacity.register(r)
        if error is not None:
            r.finish(FinishReason.ERROR, error)

    def _uses_drafter(self, r: LlmRequest) -> bool:
        return bool(self.prompt_lookup_num_tokens) and r.spec.num_sequences == 1 and r.spec.decoding.is_greedy

    def stop(self, request_id: int) -> None:
        """End a request with what it has; its blocks go in `pop_finished`."""
        r = self._requests.get(request_id)
        if r is not None and not r.is_finished:
            r.finish(FinishReason.STOPPED)

    def fail(self, request_id: int, message: str) -> None:
        """End a request with an error (also one that finished but could not be answered)."""
        r = self._requests[request_id]
        if r.is_finished:
            r.output.finish(FinishReason.ERROR, r.max_new_tokens, message)
        else:
            r.finish(FinishReason.ERROR, message)

    def fail_all(self, message: str) -> None:
        for request_id in list(self._requests):
            self.fail(request_id, message)

    def abandon_all(self) -> list[int]:
        """Forget every request without releasing its blocks (after an internal error left the
        bookkeeping in doubt). -> their ids."""
        request_ids = list(self._requests)
        self._requests.clear()
        return request_ids

    def pop_finished(self, in_flight_ids: frozenset[int] = frozenset()) -> list[LlmRequest]:
        """Release every finished request (blocks, then its id) except those whose forward is
        still running; they are returned for their final responses."""
        if self.kv_exports is not None:
            self.kv_exports.release_due(self.kv)
        done = [r for r in self._requests.values() if r.is_finished and r.request_id not in in_flight_ids]
        for r in done:
            if r.exports_kv and r.output.finish_reason == FinishReason.LENGTH and self.kv_exports is not None:
                assert r.num_computed_tokens == r.prompt_len and r.num_live_beams == 1
                r.kv_export = self.kv_exports.export(self.kv, r.request_id, r.prompt_len)
            self.capacity.end(r)
            del self._requests[r.request_id]
            if r.has_decoder_state:
                self._released_ids.append(r.request_id)
        return done

    # -- one step -----------------------------------------------------------------------------------

    def schedule(self, in_flight_ids: frozenset[int] = frozenset(),
                 max_batch_size: int | None = None, max_decode_steps: int = 1) -> tuple[ScheduledStep, int]:
        """-> (the step, requests paused to make room). Requests in `in_flight_ids` (their
        forward runs: overlap) keep their blocks and are not scheduled; `max_batch_size` lowers
        the micro-batch limit for this step. max_decode_steps n > 1: a step of plain-greedy
        generation requests only may run up to n generation steps in one call (`_decode_steps`)."""
        requests = self._ready(list(self._requests.values()))
        in_flight = frozenset(r for r in requests if r.request_id in in_flight_ids)
        if self.prompt_lookup_num_tokens:
            self._propose_drafts(r for r in requests if r.state == RequestState.GENERATION and r not in in_flight)
        capacity = self.capacity.schedule(requests, in_flight)
        batch = self.micro_batch.schedule(capacity.fitting, max_batch_size)
        adapter_loads, adapter_evictions = self.capacity.take_adapter_changes()
        # Several steps in one call only when no active request is left out of this one.
        num_decode_steps = 1 if max_decode_steps <= 1 or batch.context_requests or len(self._requests) \
            != len(batch.generation_requests) else self._decode_steps(batch.generation_requests, max_decode_steps)
        step = ScheduledStep(
            iteration=self._num_steps,
            context_requests=tuple(self._scheduled(r) for r in batch.context_requests),
            generation_requests=tuple(self._scheduled(r, num_decode_steps) for r in batch.generation_requests),
            separate_context_forward=self.separate_context_forward,
            released_request_ids=tuple(self._released_ids),
            adapter_loads=adapter_loads, adapter_evictions=adapter_evictions)
        self._released_ids = []
        self._num_steps += 1
        return step, len(capacity.paused)

    @staticmethod
    def _ready(requests: list[LlmRequest]) -> list[LlmRequest]:
        """The requests that may be scheduled: a guided request waits until its grammar is
        compiled (off this thread), and one whose guide failed to compile ends with that error; a
        generation-only request likewise waits for its prompt's KV to be fetched."""
        ready = []
        for r in requests:
            if r.kv_import is not None:
                if not r.kv_import.done():
                    continue
                if r.kv_import.cancelled() or r.kv_import.exception() is not None:
                    r.finish(FinishReason.ERROR, str(r.kv_import.exception()) if not r.kv_import.cancelled()
                             else "context_phase_params: the KV fetch was cancelled (shutdown)")
                    continue
            guide = r.spec.decoding.guide
            if guide is not None and r.state == RequestState.WAITING:
                if not guide.done():
                    continue
                if guide.exception() is not None:
                    r.finish(FinishReason.ERROR, str(guide.exception()))
                    continue
            ready.append(r)
        return ready

    def _propose_drafts(self, requests) -> None:
        requests = list(requests)
        limit = self.prompt_lookup_max_batch_size
        drafting = not limit or len(requests) <= limit   # above it a step is compute-bound: drafts cost
        for r in requests:
            if not drafting:
                r.draft_tokens = []
            elif self._uses_drafter(r):
                room = r.max_new_tokens - len(r.generated) - 1
                r.draft_tokens = propose_drafts(r.output.sequence(0), min(room, self.prompt_lookup_num_tokens),
                                                self.max_matching_ngram_size) if room > 0 else []

    def _decode_steps(self, requests: list[LlmRequest], max_decode_steps: int) -> int:
        """How many generation steps these requests (the whole step, every active one) run in one
        call: up to max_decode_steps when each is plain greedy (its token is the argmax of the
        model's logits: no post-processor, drafts, adapter, gathered logits; one sequence), else 1.
        Bounded by what each still may generate and by its blocks: where the capacity policy
        reserves every request's worst case (and no window releases blocks), it takes the blocks
        ahead now, at no one's cost; else the call stays within the blocks it holds."""
        for r in requests:
            spec = r.spec
            if (r.draft_tokens or r.adapter is not None or r.pending_block_copies or r.pending_kv_writes is not None
                    or r.num_live_beams != 1 or not spec.decoding.is_plain_greedy or spec.logits_post_processor
                    or spec.use_batched_post_processor or spec.return_generation_logits):
                return 1
        takes_ahead = self.capacity.reserves_worst_case and self.kv.attention_window is None
        tpb = self.kv.tokens_per_block

        def room(r: LlmRequest) -> int:   # steps its blocks hold: past + n tokens
            return len(self.kv.block_table(beam_holder(r.request_id, 0))) * tpb - r.num_computed_tokens

        n = max_decode_steps
        for r in requests:
            n = min(n, r.max_new_tokens - len(r.generated))   # past + n <= prompt + max_new_tokens: its worst case
            if not takes_ahead:
                n = min(n, room(r))
        if n > 1 and takes_ahead:
            for r in requests:
                if not self.kv.allocate(beam_holder(r.request_id, 0), r.num_computed_tokens + n):
                    n = min(n, *(room(q) for q in requests))   # reserved, but not free: what is held
                    break
        return max(n, 1)

    def _scheduled(self, r: LlmRequest, num_decode_steps: int = 1) -> ScheduledRequest:
        past = r.num_computed_tokens
        n = r.context_chunk_size or r.num_tokens_to_compute
        r.context_chunk_size = None
        is_last_chunk = past + n == r.num_tokens
        drafts = tuple(r.draft_tokens) if is_last_chunk else ()
        r.num_draft_tokens_proposed += len(drafts)
        self.num_draft_tokens_proposed += len(drafts)
        beams = range(r.num_live_beams)
        copies, r.pending_block_copies = tuple(r.pending_block_copies), []
        kv_writes, r.pending_kv_writes = r.pending_kv_writes, None
        new = None
        if not r.has_decoder_state:
            r.has_decoder_state = True
            new = NewRequest(r.spec, r.output)
        return ScheduledRequest(
            request_id=r.request_id,
            token_ids=tuple(tuple(r.beam_token_slice(b, past, past + n)) + drafts for b in beams),
            past_length=past,
            block_tables=tuple(tuple(self.kv.block_table(beam_holder(r.request_id, b))) for b in beams),
            is_last_chunk=is_last_chunk, block_copies=copies, kv_writes=kv_writes, num_draft_tokens=len(drafts),
            # Whole-prompt logits: such a request is never chunked and reuses no prefix.
            return_context_logits=r.spec.return_context_logits and r.output.context_logits is None and past == 0,
            new=new, lora_task_id=None if r.adapter is None else r.adapter.task_id, num_decode_steps=num_decode_steps)

    def update(self, step: ScheduledStep, result: StepResult) -> None:
        """Advance each scheduled request by the tokens it computed, register its newly full
        blocks for reuse, and record what was decoded. Requests that finished while their
        forward ran (stopped) are left as they are."""
        by_id = {res.request_id: res for res in result.results}
        for scheduled in step.requests:
            r = self._requests.get(scheduled.request_id)
            if r is None or r.is_finished:
                continue
            res = by_id[scheduled.request_id]
            if res.error is not None:
                r.finish(FinishReason.ERROR, res.error)
                continue
            # Rejected drafts: their KV is rolled back (never counted computed, never registered).
            accepted = 0 if res.outcome is None else res.outcome.num_accepted_drafts
            r.num_computed_tokens += scheduled.num_step_tokens - scheduled.num_draft_tokens + accepted
            if scheduled.is_last_chunk:
                self._record(r, res)
                r.draft_tokens = []   # verified, or (no room this step) stale: the drafter proposes anew
            if scheduled.num_draft_tokens:
                r.num_draft_tokens_accepted += accepted
                self.num_draft_tokens_accepted += accepted
                if not r.is_finished:
                    self.kv.truncate(r.request_id, r.num_tokens)
            if self.kv.enable_block_reuse:
                self.kv.store_computed_blocks(
                    r.request_id, r.reuse_token_slice(self.kv.num_stored_tokens(r.request_id), r.num_computed_tokens),
                    r.num_computed_tokens)

    def _record(self, r: LlmRequest, res: RequestResult) -> None:
        if res.context_logits is not None:
            r.output.context_logits = res.context_logits
        outcome = res.outcome
        finished = outcome.finish_reason is not None
        beams = outcome.beams
        if beams is not None and not finished:   # KV tables follow the live beams (all of one length)
            fork_beams(self.kv, r.request_id, r.num_live_beams, list(beams.parents))
            r.num_live_beams = len(beams.live_tokens)
        r.output.apply(outcome)
        if finished:
            r.finish(outcome.finish_reason)
        elif r.state == RequestState.CONTEXT:
            r.set_state(RequestState.GENERATION)
