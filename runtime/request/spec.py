"""What a request asked for, frozen at admission: never rewritten after (what the engine resolves
for it, an adapter's cache entry, its KV import, its export, is the request's progress)."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

    from ..decoding.params import DecodingParams
    from .seams import AdapterHandle, KvSourceAddress


class FinishReason(enum.Enum):
    END_ID = "end_id"
    LENGTH = "length"
    STOP_WORDS = "stop_words"
    STOPPED = "stopped"
    ERROR = "error"
    # The decoder's only: no token was allowed (every logit -inf). Its owner ends the request with an
    # error naming the step, so no RequestOutput records it.
    NO_TOKEN = "no_token"


@dataclass(frozen=True)
class ResumedContext:
    """A generation-only request's start (disaggregated context and generation): the context
    instance's first token, and where its prompt's KV blocks are."""
    first_token: int
    first_log_prob: float   # the first token's log prob (cum_log_probs counts it)
    source: KvSourceAddress   # the Executor's KvSource: the context instance's address and handle


@dataclass(frozen=True, eq=False)
class RequestSpec:
    """One validated request, whichever door it came through (`make_spec`)."""
    prompt: list[int]                 # never changed after admission
    max_new_tokens: int               # clamped so that prompt + max_new_tokens <= max_seq_len
    decoding: DecodingParams          # sampling, beams or samples, stops, the external drafts' logits
                                      # and threshold, the guide
    pad_id: int = 0
    is_streaming: bool = False
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    logits_post_processor: Callable | None = None
    use_batched_post_processor: bool = False  # the manager's batched logits post-processor applies
    priority: float = 0.5   # in [0, 1]: admitted first when higher, paused first when lower
    client_id: int | None = None   # the Executor request's (uint64), handed to logits post-processors
    lora: AdapterHandle | None = None   # the manager's AdapterRef (task id, and weights when sent)
    prompt_table: torch.Tensor | None = None   # float32 [T, hidden]: prompt ids vocab_size + j take row j
    # Its cached KV differs from another request's for the same tokens (an adapter, a prompt
    # table): block reuse keys its blocks by this too.
    cache_salt: bytes | None = None
    draft_tokens: tuple[int, ...] = ()   # its own drafts, verified with its first generated token
    # A generation-only request starts after the context instance's first token (disaggregated
    # context and generation); a context-only one runs to its first token (max_new_tokens 1).
    resumed: ResumedContext | None = None

    @property
    def num_sequences(self) -> int:
        """Its beams, or its independent samples (they share the prompt's KV like beams)."""
        return self.decoding.num_sequences
