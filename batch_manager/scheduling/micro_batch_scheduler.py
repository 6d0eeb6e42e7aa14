"""The micro-batch stage of scheduling (ints only): who runs this step under max_batch_size and
max_num_tokens, with context chunking. Called by `Scheduler` after the capacity stage."""
from __future__ import annotations

from dataclasses import dataclass, field

from .llm_request import LlmRequest, RequestState


@dataclass
class MicroBatch:
    context_requests: list[LlmRequest] = field(default_factory=list)
    generation_requests: list[LlmRequest] = field(default_factory=list)
    # Context tokens this step computes (chunks; never a reused prefix). Counted when scheduled:
    # the requests' own counts move on with the step.
    num_context_tokens: int = 0

    @property
    def requests(self) -> list[LlmRequest]:
        return self.context_requests + self.generation_requests

    @property
    def num_requests(self) -> int:
        return len(self.context_requests) + len(self.generation_requests)


class MicroBatchScheduler:
    """Generation requests first (one token each), then context requests in order, under
    max_batch_size sequences and max_num_tokens tokens. Without chunking, a context longer than
    the whole token budget runs alone rather than never. With `enable_chunked_context`, the
    context that does not fit gets the rest of the budget as a chunk (its other tokens follow in
    later steps, next to the generation tokens of the running requests), so every step stays
    within max_num_tokens. A request that wants its context logits is never chunked."""

    def __init__(self, max_batch_size: int, max_num_tokens: int, enable_chunked_context: bool = False):
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.enable_chunked_context = enable_chunked_context

    def schedule(self, fitting: list[LlmRequest], max_batch_size: int | None = None) -> MicroBatch:
        """`max_batch_size` lowers the limit for this step (overlap, pipeline: a share of the
        requests each); a request with more beams than it still runs alone."""
        limit = self.max_batch_size if max_batch_size is None else min(max_batch_size, self.max_batch_size)
        batch = MicroBatch()
        num_tokens = 0
        num_sequences = 0  # a beam-search request runs one sequence per live beam

        def fits(k: int) -> bool:
            return num_sequences + k <= limit or (num_sequences == 0 and k <= self.max_batch_size)

        for r in fitting:
            k = r.num_live_beams
            if r.state != RequestState.GENERATION or not fits(k):
                continue
            if num_tokens + k + len(r.draft_tokens) > self.max_num_tokens:
                r.draft_tokens = []   # no room for its drafts this step: one token, as without them
            if num_tokens + k <= self.max_num_tokens:
                batch.generation_requests.append(r)
                num_tokens += k + len(r.draft_tokens)
                num_sequences += k
        for r in fitting:
            k = r.num_live_beams
            if r.state != RequestState.CONTEXT or not fits(k):
                continue
            n, budget = r.num_tokens_to_compute, self.max_num_tokens - num_tokens
            r.context_chunk_size = None
            cost = n + len(r.draft_tokens)   # drafts ride on the last chunk (beam width 1)
            if cost > budget and self.enable_chunked_context and budget > 0 and not r.spec.return_context_logits \
                    and k == 1 and n > 1:
                r.context_chunk_size = cost = min(budget, n - 1)
            if cost * k <= budget or batch.num_requests == 0:
                batch.context_requests.append(r)
                batch.num_context_tokens += cost * k
                num_tokens += cost * k
                num_sequences += k
        return batch
