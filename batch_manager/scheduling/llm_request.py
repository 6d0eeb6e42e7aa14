"""A request inside the manager: `LlmRequest`, its progress, beside its `RequestSpec` (what it
asks for, frozen at admission) and its `RequestOutput` (the one record of what it produced), both
from runtime/request/. Plain Python, no tensors of its own. The scheduler owns the last two: only `Scheduler` (and its capacity and micro-batch
stages) changes them; the model executor sees a request only through the frozen
`ScheduledRequest` of a step, and the front ends read its `RequestOutput` to answer.

Each request has a token list (prompt + generated) and a count of tokens whose KV is in the
cache (`num_computed_tokens`). A step computes the tokens between the two; when they meet, the
step's last logits yield the next token. Pausing drops the cache (`num_computed_tokens = 0`), so
a resumed request recomputes prompt + generated tokens as one context.
"""
from __future__ import annotations

import enum
import hashlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runtime.request import FinishReason, RequestOutput, RequestSpec

if TYPE_CHECKING:
    from ..adapters.peft_cache import AdapterRef
    from ..kv_transport.kv_handoff import ExportedKv, KvWrites


class RequestState(enum.IntEnum):
    WAITING = 0      # admitted, holds no KV blocks (new, or paused)
    CONTEXT = 1      # holds KV blocks, more than one token left to compute
    GENERATION = 2   # holds KV blocks, one token per step
    FINISHED = 3


_ALLOWED = {
    RequestState.WAITING: {RequestState.CONTEXT, RequestState.FINISHED},
    RequestState.CONTEXT: {RequestState.GENERATION, RequestState.WAITING, RequestState.FINISHED},
    RequestState.GENERATION: {RequestState.WAITING, RequestState.FINISHED, RequestState.CONTEXT},
    RequestState.FINISHED: set(),
}


@dataclass(eq=False)
class LlmRequest:
    """An admitted request's progress; `spec` is what it asked for."""
    request_id: int
    spec: RequestSpec
    arrival_index: int = 0  # admission order, for FIFO scheduling and pause priority

    state: RequestState = RequestState.WAITING
    num_computed_tokens: int = 0
    context_chunk_size: int | None = None  # tokens of the next step when a context is chunked; None = all
    num_pauses: int = 0
    start_index: int = -1      # when it last started holding blocks (pause picks the largest)
    num_reused_blocks: int = 0   # cached prefix blocks it took over, over all its starts
    has_decoder_state: bool = False  # the executor opened its decoder state (released when it ends)
    holds_adapter: bool = False      # its adapter is pinned on the device (while it holds KV blocks)
    # Its adapter as the PEFT cache holds it (registered at admission: the weights dropped, the
    # cache salt extended by the cached instance), None once refused or ended.
    adapter: AdapterRef | None = field(init=False)
    cache_salt: bytes | None = field(init=False)   # what block reuse keys its blocks by besides tokens
    # The one record of its tokens (prompt, generated tokens per live beam; `generated` is live
    # beam 0, or the best output once a beam search finished); the decoder reads it.
    output: RequestOutput = field(init=False)
    num_live_beams: int = 1       # KV holders of the request: beam b > 0 is (request_id, b)
    pending_block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before its next forward
    # Draft tokens (beam width 1): those to verify in the next forward (the request's own
    # draft tokens before its first token, then the drafter's), the most one step may carry
    # (what the KV reservation counts), and counters for the stats.
    draft_tokens: list[int] = field(init=False)
    max_draft_len: int = field(init=False)
    num_draft_tokens_proposed: int = 0
    num_draft_tokens_accepted: int = 0
    # Disaggregated context and generation (kv_handoff.py): a context-only request that leaves
    # its prompt's KV blocks for a generation-only one (unless its first token ends it); a
    # generation-only request's fetched prompt KV (a Future of kv_transfer.FetchedBlocks) until
    # its first start takes it, then the writes of its next forward, dropped if it pauses first.
    exports_kv: bool = False
    kv_import: Future | None = None
    pending_kv_writes: KvWrites | None = None
    # Where a context-only request's blocks went when it ended (set by the scheduler as it releases
    # the request; its final response hands them over): None when nothing was kept.
    kv_export: ExportedKv | None = None

    def __post_init__(self):
        self.adapter, self.cache_salt = self.spec.lora, self.spec.cache_salt
        self.output = RequestOutput(self.request_id, self.spec.prompt, self.spec.num_sequences)
        self.draft_tokens = list(self.spec.draft_tokens)
        self.max_draft_len = len(self.draft_tokens)
        resumed = self.spec.resumed
        if resumed is not None:   # its first token came from the context instance: generated already
            self.output.start_after(resumed.first_token, resumed.first_log_prob, self.spec.decoding.num_top_log_probs,
                                    self.spec.return_generation_logits)

    @property
    def prompt(self) -> list[int]:
        return self.spec.prompt

    @property
    def max_new_tokens(self) -> int:
        return self.spec.max_new_tokens

    @property
    def generated(self) -> list[int]:
        return self.output.beams[0]

    @property
    def prompt_len(self) -> int:
        return len(self.spec.prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.spec.prompt) + len(self.generated)

    @property
    def max_num_tokens(self) -> int:
        """Worst-case length: prompt + max_new_tokens (what GUARANTEED_NO_EVICT reserves)."""
        return len(self.spec.prompt) + self.spec.max_new_tokens

    @property
    def num_tokens_with_drafts(self) -> int:
        """What its next step writes KV for when it carries its drafts."""
        return self.num_tokens + len(self.draft_tokens)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.state == RequestState.FINISHED

    @property
    def holds_blocks(self) -> bool:
        return self.state in (RequestState.CONTEXT, RequestState.GENERATION)

    def beam_token_slice(self, beam: int, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of live beam `beam` (prompt + that beam's generated tokens)."""
        if self.num_live_beams == 1:
            return self.token_slice(start, stop)
        return self.output.sequence(beam)[start:stop]

    def token_slice(self, start: int, stop: int) -> list[int]:
        prompt = self.spec.prompt
        n = len(prompt)
        if stop <= n:
            return prompt[start:stop]
        if start >= n:
            return self.generated[start - n:stop - n]
        return prompt[start:] + self.generated[:stop - n]

    def reuse_token_slice(self, start: int, stop: int) -> list[int]:
        """token_slice as block reuse keys it: with a cache salt the first token becomes a negative
        key (real ids are >= 0) derived from the salt, so the whole chain of block hashes differs
        from any request with another salt or none."""
        tokens = self.token_slice(start, stop)
        salt = self.cache_salt
        if salt is not None and start == 0 and tokens:
            digest = hashlib.blake2b(salt + tokens[0].to_bytes(8, "little", signed=True), digest_size=8).digest()
            tokens[0] = -1 - (int.from_bytes(digest, "little") >> 2)
        return tokens

    def set_state(self, new: RequestState) -> None:
        if new not in _ALLOWED[self.state]:
            raise AssertionError(f"request {self.request_id}: illegal transition {self.state.name} -> {new.name}")
        self.state = new

    def pause(self) -> None:
        """Drop the KV cache; the request resumes later by recomputing all its tokens (the
        drafter's drafts go; its own draft tokens stay until its first token)."""
        self.set_state(RequestState.WAITING)
        if self.generated:
            self.draft_tokens = []
        self.num_computed_tokens = 0
        self.num_pauses += 1

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.set_state(RequestState.FINISHED)
        self.output.finish(reason, self.spec.max_new_tokens, error)
