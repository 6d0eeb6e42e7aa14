"""The data seam of one step: what the scheduler hands the model executor (`ScheduledStep`) and
what comes back (`StepResult`). Both are made fresh each step, frozen, and hold ids, ints, lists
and the decoded values; the executor changes nothing of the scheduler's state, and the
scheduler applies a result in `Scheduler.update`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.request import RequestOutput, RequestSpec

if TYPE_CHECKING:
    import torch

    from runtime.decoding import DecodeOutcome
    from runtime.adapters.lora import LoraAdapter

    from ..kv_transport.kv_handoff import KvWrites


@dataclass(frozen=True)
class NewRequest:
    """What the executor's per-request stores (decoder state) open from, on a request's first step."""
    spec: RequestSpec
    record: RequestOutput                # the request's one record: the scheduler writes, the decoder reads


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: int
    token_ids: tuple[tuple[int, ...], ...]     # per live beam: the step's new tokens (a context chunk,
                                               # one generation token, or one token + D draft tokens)
    past_length: int                           # tokens already in the KV cache (every beam alike)
    block_tables: tuple[tuple[int, ...], ...]  # per live beam: KV block ids in token order
    is_last_chunk: bool                        # computes every token it has: a token is decoded after it
    block_copies: tuple[tuple[int, int], ...] = ()   # (src, dst) KV blocks to copy before its forward
    kv_writes: KvWrites | None = None          # fetched prompt KV to write into the
                                               # pool before its forward (a generation-only request)
    return_context_logits: bool = False        # the whole prompt runs in this step; its logits are wanted
    new: NewRequest | None = None              # set on the request's first step only
    lora_task_id: int | None = None            # its LoRA adapter (resident in the runtime's store), or None
    num_draft_tokens: int = 0                  # the last D of token_ids are drafts (beam width 1, last chunk):
                                               # logits are wanted after each of the last D + 1 tokens
    num_decode_steps: int = 1                  # n > 1: a plain-greedy generation request runs n steps in
                                               # one call (its blocks hold past + n tokens); every request
                                               # of the step has the same n

    @property
    def num_beams(self) -> int:
        return len(self.token_ids)

    @property
    def num_step_tokens(self) -> int:
        """New tokens of each beam (drafts included)."""
        return len(self.token_ids[0])

    @property
    def drafts(self) -> tuple[int, ...]:
        return self.token_ids[0][len(self.token_ids[0]) - self.num_draft_tokens:] if self.num_draft_tokens else ()


@dataclass(frozen=True)
class ScheduledStep:
    iteration: int
    context_requests: tuple[ScheduledRequest, ...]
    generation_requests: tuple[ScheduledRequest, ...]
    separate_context_forward: bool = False           # InflightBatching: context and generation apart
    released_request_ids: tuple[int, ...] = ()       # ended since the last step: free their stores first
    # The PEFT cache's changes since the last step, applied before the forward: evictions (task
    # ids) first, then loads ((task id, runtime.adapters.lora.LoraAdapter): a reference, not a copy).
    adapter_evictions: tuple[int, ...] = ()
    adapter_loads: tuple[tuple[int, LoraAdapter], ...] = ()

    @property
    def requests(self) -> tuple[ScheduledRequest, ...]:
        return self.generation_requests + self.context_requests

    @property
    def forward_groups(self) -> list[tuple[ScheduledRequest, ...]]:
        """The requests of each forward pass, in order; a failure fails exactly one group."""
        groups = [self.context_requests, self.generation_requests] if self.separate_context_forward \
            else [self.generation_requests + self.context_requests]
        return [g for g in groups if g]


@dataclass(frozen=True)
class RequestResult:
    """One scheduled request's outcome; a request that ran a non-final context chunk decodes nothing."""
    request_id: int
    outcome: DecodeOutcome | None = None   # what its decoder step chose
    error: str | None = None               # the step failed for this request (or allowed it no token): it ends
    context_logits: torch.Tensor | None = None   # float32 [prompt_len, V] when requested


@dataclass(frozen=True)
class StepResult:
    results: tuple[RequestResult, ...]
