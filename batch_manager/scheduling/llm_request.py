"""A request inside the manager: `RequestSpec` (what it asks for, frozen at admission),
`LlmRequest` (its progress) and `RequestOutput` (what it produced). Plain Python, no tensors of
its own. The scheduler owns the last two: only `Scheduler` (and its capacity and micro-batch
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
from dataclasses import dataclass, field
from typing import Any, Callable

from runtime.token_record import BeamOutputs, TokenRecord


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


@dataclass(frozen=True)
class ResumedContext:
    """A generation-only request's start (disaggregated context and generation): the context
    instance's first token, and where its prompt's KV blocks are."""
    first_token: int
    first_log_prob: float   # the first token's log prob (cum_log_probs counts it)
    source: Any             # executor.disaggregated.KvSource: the context instance's address and handle
    kv: Any = None          # concurrent.futures.Future -> kv_transfer.FetchedBlocks, set when admitted


@dataclass(frozen=True, eq=False)
class RequestSpec:
    """One validated request, whichever front door it came through (`admission.make_spec`)."""
    prompt: list[int]                 # never changed after admission
    max_new_tokens: int               # clamped so that prompt + max_new_tokens <= max_seq_len
    decoding: Any                     # runtime.decoding.DecodingParams: sampling, beams or samples,
                                      # stops, the external drafts' logits and threshold, the guide
    pad_id: int = 0
    is_streaming: bool = False
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    logits_post_processor: Callable | None = None
    use_batched_post_processor: bool = False  # the manager's batched logits post-processor applies
    priority: float = 0.5   # in [0, 1]: admitted first when higher, paused first when lower
    client_id: Any = None   # the Executor request's, handed to logits post-processors
    lora: Any = None        # batch_manager.adapters.peft_cache.AdapterRef: its LoRA adapter, or None
    prompt_table: Any = None   # float32 [T, hidden]: prompt ids vocab_size + j take row j (prompt tuning)
    # Its cached KV differs from another request's for the same tokens (an adapter, a prompt
    # table): block reuse keys its blocks by this too (see LlmRequest.reuse_token_slice).
    cache_salt: bytes | None = None
    draft_tokens: tuple[int, ...] = ()   # its own drafts, verified with its first generated token
    # Disaggregated context and generation (kv_handoff.py): a context-only request runs to its
    # first token (max_new_tokens 1) and, when that is not its end, leaves its prompt's KV blocks
    # for a generation-only request, which starts after that token (`resumed`).
    exports_kv: bool = False
    resumed: ResumedContext | None = None

    @property
    def num_sequences(self) -> int:
        """Its beams, or its independent samples (they share the prompt's KV like beams)."""
        return self.decoding.num_sequences


@dataclass
class SequenceOutput:
    """One output sequence (a beam, or a returned sample): its generated tokens and what was asked
    with them."""
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)   # when return_log_probs; none for an end token
    cum_log_prob: float = 0.0                               # includes the end token's log prob
    top_log_probs: list[tuple] = field(default_factory=list)   # per token: (k log probs, k ids)
    generation_logits: list[Any] = field(default_factory=list)   # float32 [V] per token, when gathered
    finish_reason: FinishReason | None = None


@dataclass
class RequestOutput:
    """What a request produced so far: the scheduler writes it after each step; front ends render
    their responses from it and keep their own cursors of what they sent. Beam search: the
    output beams, best first, whole after each step (beams reorder); otherwise the sequences grow
    by appending."""
    request_id: int
    sequences: list[SequenceOutput]
    num_generated: int = 0          # generation steps' tokens so far (of the first live sequence)
    context_logits: Any = None      # float32 [prompt_len, V] when requested
    finish_reason: FinishReason | None = None
    error: str | None = None
    kv_export: Any = None           # kv_handoff.ExportedKv: where an exporting request's blocks went

    @classmethod
    def empty(cls, request_id: int, num_sequences: int) -> RequestOutput:
        return cls(request_id, [SequenceOutput() for _ in range(num_sequences)])

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, outcome) -> None:
        """One decoder outcome (runtime.decoding.DecodeOutcome): appended at width 1; beam search
        and samples replace every sequence."""
        beams: BeamOutputs | None = outcome.beams
        if beams is None:
            sequence = self.sequences[0]
            sequence.tokens += outcome.tokens
            sequence.log_probs += outcome.log_probs
            sequence.top_log_probs += outcome.top_log_probs
            sequence.generation_logits += outcome.logits
            sequence.cum_log_prob = outcome.cum_log_prob
        else:
            logits = beams.generation_logits or [()] * len(beams.tokens)
            self.sequences = [SequenceOutput(list(tokens), list(log_probs), cum, [], list(rows))
                              for tokens, log_probs, cum, rows
                              in zip(beams.tokens, beams.log_probs, beams.cum_log_probs, logits)]

    def finish(self, reason: FinishReason, max_new_tokens: int, error: str | None = None) -> None:
        """Every sequence's reason: beams shorter than max_new_tokens ended on the end id (or a
        stop word), the others on the length; a stop or an error ends all alike."""
        self.finish_reason, self.error = reason, error
        per_sequence = len(self.sequences) > 1 and reason in (FinishReason.END_ID, FinishReason.STOP_WORDS,
                                                               FinishReason.LENGTH)
        for s in self.sequences:
            if per_sequence and len(s.tokens) >= max_new_tokens:
                s.finish_reason = FinishReason.LENGTH
            elif per_sequence:
                s.finish_reason = FinishReason.STOP_WORDS if reason == FinishReason.STOP_WORDS else FinishReason.END_ID
            else:
                s.finish_reason = reason


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
    # The one record of its tokens (prompt, generated tokens per live beam; `generated` is live
    # beam 0, or the best output once a beam search finished); the decoder reads it.
    record: TokenRecord = field(init=False)
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
    # Generation-only: the Future of its fetched prompt KV until its first start takes it; then
    # the writes of its next forward (kv_handoff.KvWrites), dropped if it pauses before that.
    kv_import: Any = None
    pending_kv_writes: Any = None

    def __post_init__(self):
        self.record = TokenRecord(self.spec.prompt)
        self.output = RequestOutput.empty(self.request_id, self.spec.num_sequences)
        self.draft_tokens = list(self.spec.draft_tokens)
        self.max_draft_len = len(self.draft_tokens)
        resumed = self.spec.resumed
        if resumed is not None:   # its first token came from the context instance: generated already
            self.record.beams[0].append(resumed.first_token)
            self.output.sequences[0] = SequenceOutput(
                [resumed.first_token], [resumed.first_log_prob], resumed.first_log_prob,
                [None] if self.spec.decoding.num_top_log_probs else [],     # never rendered (start 1)
                [None] if self.spec.return_generation_logits else [])
            self.output.num_generated = 1
            self.kv_import = resumed.kv

    @property
    def prompt(self) -> list[int]:
        return self.spec.prompt

    @property
    def max_new_tokens(self) -> int:
        return self.spec.max_new_tokens

    @property
    def generated(self) -> list[int]:
        return self.record.beams[0]

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
        return self.record.sequence(beam)[start:stop]

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
        salt = self.spec.cache_salt
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
