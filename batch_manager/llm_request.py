"""LlmRequest: the manager's per-request state (plain Python, no tensors of its own). The
scheduler owns it: only `Scheduler` (and its capacity and micro-batch stages) changes it; the
model executor sees a request only through the frozen `ScheduledRequest` of a step.

Each request has a token list (prompt + generated) and a count of tokens whose KV is in the
cache (`num_computed_tokens`). A step computes the tokens between the two; when they meet, the
step's last logits yield the next token. Pausing drops the cache (`num_computed_tokens = 0`), so
a resumed request recomputes prompt + generated tokens as one context.
"""
from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

from runtime.token_record import TokenRecord


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


class FinishReason(enum.Enum):
    END_ID = "end_id"
    LENGTH = "length"
    STOP_WORDS = "stop_words"
    STOPPED = "stopped"
    ERROR = "error"


@dataclass(eq=False)
class LlmRequest:
    request_id: int
    prompt: list[int]
    max_new_tokens: int
    pad_id: int = 0
    beam_width: int = 1
    is_streaming: bool = False
    decoding: Any = None   # runtime.decoding.params.DecodingParams, validated on admission
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    logits_post_processor: Callable | None = None
    use_batched_post_processor: bool = False  # the manager's batched logits post-processor applies
    arrival_index: int = 0  # admission order, for FIFO scheduling and pause priority
    priority: float = 0.5   # in [0, 1]: admitted first when higher, paused first when lower
    client_id: Any = None   # the Executor request's, handed to logits post-processors
    lora: Any = None        # batch_manager.peft_cache.AdapterRef: its LoRA adapter, or None
    prompt_table: Any = None   # float32 [T, hidden]: prompt ids vocab_size + j take row j (prompt tuning)
    # Its cached KV differs from another request's for the same tokens (an adapter, a prompt
    # table): block reuse keys its blocks by this too (see reuse_token_slice).
    cache_salt: bytes | None = None

    state: RequestState = RequestState.WAITING
    num_computed_tokens: int = 0
    num_sent_tokens: int = 0   # generated tokens already streamed
    context_chunk_size: int | None = None  # tokens of the next step when a context is chunked; None = all
    num_pauses: int = 0
    start_index: int = -1      # when it last started holding blocks (pause picks the largest)
    num_reused_blocks: int = 0   # cached prefix blocks it took over, over all its starts
    finish_reason: FinishReason | None = None
    error: str | None = None
    log_probs: list[float] = field(default_factory=list)
    top_log_probs: list[tuple] = field(default_factory=list)   # per generated token: (k log probs, k ids)
    cum_log_prob: float = 0.0     # includes the end token's log prob, which has no log_probs entry
    has_decoder_state: bool = False  # the executor opened its decoder state (released when it ends)
    holds_adapter: bool = False      # its adapter is pinned on the device (while it holds KV blocks)
    # The one record of its tokens (prompt, generated tokens per live beam; `generated` is live
    # beam 0, or the best output once a beam search finished); the decoder reads it.
    record: TokenRecord = field(init=False)
    # Beam search (beam_width > 1): the output beams, best first.
    beam_tokens: list[list[int]] = field(default_factory=list)
    beam_log_probs: list[list[float]] = field(default_factory=list)
    beam_cum_log_probs: list[float] = field(default_factory=list)
    num_live_beams: int = 1       # KV holders of the request: beam b > 0 is (request_id, b)
    pending_block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before its next forward
    # Draft tokens (beam width 1): those to verify in the next forward (the request's own
    # draft_input_ids before its first token, then the drafter's), the most one step may carry
    # (what the KV reservation counts), and counters for the stats.
    draft_tokens: list[int] = field(default_factory=list)
    draft_logits: Any = None               # float32 [D, V] of the request's own drafts, or None
    draft_acceptance_threshold: float | None = None
    max_draft_len: int = 0
    guide: Any = None   # guided decoding: Future of the compiled grammar; the request waits until it is done
    num_draft_tokens_proposed: int = 0
    num_draft_tokens_accepted: int = 0
    context_logits: Any = None             # float32 [prompt_len, V] when requested
    generation_logits: list[Any] = field(default_factory=list)  # float32 [V] per generated token

    def __post_init__(self):
        self.record = TokenRecord(self.prompt)

    @property
    def generated(self) -> list[int]:
        return self.record.beams[0]

    @generated.setter
    def generated(self, tokens: list[int]) -> None:
        self.record.beams[0] = tokens

    @property
    def end_id(self) -> int | None:
        return None if self.decoding is None else self.decoding.end_id

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def max_num_tokens(self) -> int:
        """Worst-case length: prompt + max_new_tokens (what GUARANTEED_NO_EVICT reserves)."""
        return len(self.prompt) + self.max_new_tokens

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
        return self.record.sequence(beam)[start:stop]

    def token_slice(self, start: int, stop: int) -> list[int]:
        n = len(self.prompt)
        if stop <= n:
            return self.prompt[start:stop]
        if start >= n:
            return self.generated[start - n:stop - n]
        return self.prompt[start:] + self.generated[:stop - n]

    def reuse_token_slice(self, start: int, stop: int) -> list[int]:
        """token_slice as block reuse keys it: with a cache salt the first token becomes a negative
        key (real ids are >= 0) derived from the salt, so the whole chain of block hashes differs
        from any request with another salt or none."""
        tokens = self.token_slice(start, stop)
        if self.cache_salt is not None and start == 0 and tokens:
            digest = hashlib.blake2b(self.cache_salt + tokens[0].to_bytes(8, "little", signed=True),
                                     digest_size=8).digest()
            tokens[0] = -1 - (int.from_bytes(digest, "little") >> 2)
        return tokens

    def set_state(self, new: RequestState) -> None:
        if new not in _ALLOWED[self.state]:
            raise AssertionError(f"request {self.request_id}: illegal transition {self.state.name} -> {new.name}")
        self.state = new

    def pause(self) -> None:
        """Drop the KV cache; the request resumes later by recomputing all its tokens (the
        drafter's drafts go; its own draft_input_ids stay until its first token)."""
        self.set_state(RequestState.WAITING)
        if self.generated:
            self.draft_tokens = []
        self.num_computed_tokens = 0
        self.num_pauses += 1

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.set_state(RequestState.FINISHED)
        self.finish_reason = reason
        self.error = error
