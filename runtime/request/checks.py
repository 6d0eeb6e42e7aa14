"""The checks every door shares, after its own parsing: `make_spec` takes the parsed values and
checks them against the engine in one straight pass. A bad request is a RequestError (a
ValueError) naming the field as the door's user knows it (`names`) and the value."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .spec import RequestSpec

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..decoding.guided import GrammarCompiler
    from ..decoding.params import DecodingParams
    from .seams import AdapterCacheBounds, AdapterWeightClaims

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request that cannot be admitted; the message names the field and the value."""


@dataclass(frozen=True)
class AdmissionLimits:
    vocab_size: int
    max_input_len: int
    max_seq_len: int
    max_beam_width: int
    max_num_blocks: int          # the whole KV pool: a request that cannot fit it alone is refused
    tokens_per_block: int
    gather_context_logits: bool
    gather_generation_logits: bool
    model_config: ModelConfig | None = None   # LoRA modules and the prompt table's hidden size
    peft_cache_config: AdapterCacheBounds | None = None   # the manager's PeftCacheManagerConfig (None: its defaults)
    max_draft_tokens: int = 0    # longest draft a request may bring (0: drafts refused)
    guides: GrammarCompiler | None = None   # the engine's, when guided decoding is configured
    adapter_weights: AdapterWeightClaims | None = None   # the PEFT cache's AdapterWeights: the Executor checks re-sent weights
    max_batch_size: int = 1 << 30    # sequences one step may run: a request's beams or samples must fit


def check_prompt(prompt: list[int], limits: AdmissionLimits, name: str, num_virtual_tokens: int = 0) -> None:
    """The prompt's length and token ids against the engine; `name`: the field the user knows.
    num_virtual_tokens: rows of the request's prompt table (ids up to vocab_size + that are valid)."""
    if not prompt:
        raise RequestError(f"{name}: empty prompt")
    if len(prompt) > limits.max_input_len:
        raise RequestError(f"{name}: prompt length {len(prompt)} exceeds the engine's max_input_len "
                           f"{limits.max_input_len}")
    if len(prompt) >= limits.max_seq_len:
        raise RequestError(f"{name}: prompt length {len(prompt)} leaves no room to generate within the "
                           f"engine's max_seq_len {limits.max_seq_len}")
    low, high = min(prompt), max(prompt)
    limit = limits.vocab_size + num_virtual_tokens
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        extra = f" + {num_virtual_tokens} prompt table rows" if num_virtual_tokens else ""
        raise RequestError(f"{name}: token id {bad} outside [0, {limits.vocab_size}{extra})")


def check_range(name: str, value, low, high, low_inclusive=True, high_inclusive=True):
    ok_low = value >= low if low_inclusive else value > low
    ok_high = value <= high if high_inclusive else value < high
    if not (ok_low and ok_high):
        lb, hb = "[" if low_inclusive else "(", "]" if high_inclusive else ")"
        raise RequestError(f"{name}: {value} outside {lb}{low}, {high}{hb}")


def clamped_new_tokens(limits: AdmissionLimits, prompt_len: int, max_new_tokens: int) -> int:
    """The new tokens a request may have: what it asked, within max_seq_len."""
    return min(max_new_tokens, limits.max_seq_len - prompt_len)


def check_decoding(params: DecodingParams, limits: AdmissionLimits, names: dict[str, str]) -> DecodingParams:
    """The one validator (DecodingParams.validate) against the engine; `names` maps a field to
    the name the user knows."""
    try:
        params.validate(limits.vocab_size, limits.max_beam_width, names=names)
    except ValueError as e:
        raise RequestError(str(e)) from None
    return params


def check_drafts(drafts: list[int], draft_logits, limits: AdmissionLimits, name: str, logits_name: str) -> None:
    """A request's own drafts; draft_logits: float32 [D, V] (finite: the door checked), or None."""
    if not drafts:
        raise RequestError(f"{name}: must not be empty")
    if len(drafts) > limits.max_draft_tokens:
        hint = " (set max_draft_tokens to accept drafts)" if not limits.max_draft_tokens else ""
        raise RequestError(f"{name}: {len(drafts)} draft tokens exceed max_draft_tokens={limits.max_draft_tokens}{hint}")
    bad = [t for t in drafts if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestError(f"{name}: token ids must be in [0, {limits.vocab_size}), got {bad[0]}")
    if draft_logits is not None and tuple(draft_logits.shape) != (len(drafts), limits.vocab_size):
        raise RequestError(f"{logits_name}: expected shape [{len(drafts)}, {limits.vocab_size}] (one row per draft "
                           f"token), got {list(draft_logits.shape)}")


def make_spec(prompt: list[int], max_new_tokens: int, limits: AdmissionLimits, decoding: DecodingParams, *,
              names: dict[str, str], decoding_names: dict[str, str], request_id=None, pad_id: int = 0,
              draft_tokens: list[int] | None = None, draft_logits=None, guide: tuple[str, str | None] | None = None,
              context_only: bool = False, **fields) -> RequestSpec:
    """The parsed request -> its RequestSpec, checked against the engine (the prompt is checked by
    `check_prompt`, while the door parses). `names`: the door's names of max_new_tokens, pad_id,
    draft_input_ids (and their logits), num_return_sequences, beam_width and the return_* flags;
    `decoding_names`: of the DecodingParams fields. `draft_tokens` None: none given (an empty list
    is refused). `guide`: (guide type, text) to compile, last, only for an otherwise valid request.
    `context_only`: checked as asked, it runs to its first token (disaggregated context phase).
    `fields`: the other RequestSpec fields; `request_id` only names the request in the log."""
    if max_new_tokens <= 0:
        raise RequestError(f"{names['max_new_tokens']}: must be positive, got {max_new_tokens}")
    clamped = clamped_new_tokens(limits, len(prompt), max_new_tokens)
    if clamped < max_new_tokens:
        logger.warning("request %s: prompt %d + %s %d exceeds max_seq_len %d; clamped to %d new tokens",
                       request_id, len(prompt), names['max_new_tokens'], max_new_tokens, limits.max_seq_len,
                       clamped)
        max_new_tokens = clamped
    check_range(names["pad_id"], pad_id, -(1 << 31), (1 << 31) - 1)   # written into int32 output_ids
    params = check_decoding(decoding, limits, decoding_names)
    num_sequences = params.num_sequences   # beams, or independent samples (they share KV like beams)
    if num_sequences > limits.max_batch_size:
        field = names["num_return_sequences" if params.num_return_sequences > 1 else "beam_width"]
        raise RequestError(f"{field}: {num_sequences} sequences exceed max_batch_size {limits.max_batch_size}")
    if draft_tokens is not None:
        check_drafts(draft_tokens, draft_logits, limits, names.get("draft_tokens", names["draft_input_ids"]),
                     names["draft_logits"])
        if num_sequences > 1:
            raise RequestError(f"{names['draft_input_ids']}: draft tokens need beam width 1, got {params.beam_width}"
                               + (f" and num_return_sequences {params.num_return_sequences}"
                                  if params.num_return_sequences > 1 else ""))
    for flag, built in (("return_context_logits", limits.gather_context_logits),
                        ("return_generation_logits", limits.gather_generation_logits)):
        if fields.get(flag) and not built:
            raise RequestError(f"{names[flag]}: true, but the engine was not built with gather_{flag[7:]}")
    need_blocks = -(-(len(prompt) + max_new_tokens) // limits.tokens_per_block)
    if num_sequences > 1:  # each beam's own table plus one copy-on-write block (beam_blocks.max_beam_blocks)
        need_blocks = num_sequences * (need_blocks + 1)
    if need_blocks > limits.max_num_blocks:
        raise RequestError(f"{names['max_new_tokens']}: prompt {len(prompt)} + {max_new_tokens} new tokens need "
                           f"{need_blocks} KV blocks; the whole pool has {limits.max_num_blocks}")
    if guide is not None:   # last: its grammar starts compiling (off this thread) only for a valid request
        try:
            params = replace(params, guide=limits.guides.compile(*guide))
        except ValueError as e:
            raise RequestError(str(e)) from None
    if draft_logits is not None:
        params = replace(params, draft_logits=draft_logits)
    return RequestSpec(prompt=prompt, max_new_tokens=1 if context_only else max_new_tokens, decoding=params,
                       pad_id=pad_id, draft_tokens=tuple(draft_tokens or ()), **fields)
