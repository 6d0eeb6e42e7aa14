"""Admission: the one maker of a `RequestSpec` (`make_spec`), whichever the front door; here too
GptManager's door, an InferenceRequest's tensors (`to_spec`); the Executor's `Request` is parsed
in executor/conversion.py. A bad request is a RequestError (a ValueError) that names the field and
the value; nothing is changed for a rejected request."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from runtime.decoding import DecodingParams, parse_word_list
from runtime.decoding.fields import SAMPLING_FIELDS
from runtime.adapters.prompt_tuning import check_prompt_table, table_digest

from .legacy import tensor_names as tn
from .legacy.inference_request import InferenceRequest
from .guided_decoding import check_guide
from .scheduling.llm_request import RequestSpec
from .lora import PeftCacheManagerConfig, adapter_ref, tensor_int
from .adapters.peft_cache import AdapterRef

logger = logging.getLogger(__name__)

INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8, torch.uint32, torch.uint64)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# Accepted and validated, but not implemented by this version: a request that sets them is refused.
_UNSUPPORTED = (tn.POSITION_IDS,)


class RequestError(ValueError):
    """A request that cannot be admitted; the message names the tensor and the value."""


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
    model_config: Any = None     # runtime ModelConfig: LoRA modules and the prompt table's hidden size
    peft_cache_config: PeftCacheManagerConfig = field(default_factory=PeftCacheManagerConfig)
    max_draft_tokens: int = 0    # longest draft a request may bring (0: drafts refused)
    guides: Any = None           # the engine's GrammarCompiler when guided decoding is configured
    adapter_weights: Any = None  # the PEFT cache's AdapterWeights (thread-safe): the Executor checks re-sent weights
    max_batch_size: int = 1 << 30    # sequences one step may run: a request's beams or samples must fit


def _tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise RequestError(f"{name}: expected a torch tensor, got {type(value).__name__}")
    if value.device.type == "meta":
        raise RequestError(f"{name}: a tensor on the meta device (no values), shape {list(value.shape)}")
    return value


def _scalar(tensors: dict, name: str, kind: str, default=None):
    """Read a one-element tensor ([1], [1, 1] or []) as an int, float or bool."""
    if name not in tensors:
        return default
    t = _tensor(name, tensors[name])
    if t.numel() != 1 or t.dim() > 2:
        raise RequestError(f"{name}: expected one value (shape [1] or [1, 1]), got shape {list(t.shape)}")
    if kind == "int":
        if t.dtype not in INT_DTYPES:
            raise RequestError(f"{name}: expected an integer tensor, got {t.dtype}")
        return int(t.item())
    if kind == "float":
        if t.dtype not in _FLOAT_DTYPES:
            raise RequestError(f"{name}: expected a float32 tensor, got {t.dtype}")
        value = float(t.item())
        if not math.isfinite(value):
            raise RequestError(f"{name}: must be finite, got {value}")
        return value
    if t.dtype != torch.bool and t.dtype not in INT_DTYPES:
        raise RequestError(f"{name}: expected a bool tensor, got {t.dtype}")
    return bool(t.item())


def _token_ids(name: str, value, shapes: str) -> list[int]:
    """An integer tensor [n] or [1, n] -> its ids as Python ints (also for unsigned dtypes, which
    have no min/max kernels); `shapes` words the accepted shapes in the error."""
    t = _tensor(name, value)
    if t.dtype not in INT_DTYPES:
        raise RequestError(f"{name}: expected int32, got {t.dtype}")
    if t.dim() != 1 and not (t.dim() == 2 and t.shape[0] == 1):
        raise RequestError(f"{name}: expected shape {shapes}, got {list(t.shape)}")
    return t.reshape(-1).tolist()


def _input_ids(tensors: dict, limits: AdmissionLimits, num_virtual_tokens: int = 0) -> list[int]:
    if tn.INPUT_IDS not in tensors:
        raise RequestError(f"{tn.INPUT_IDS}: missing (required)")
    prompt = _token_ids(tn.INPUT_IDS, tensors[tn.INPUT_IDS], "[L] or [1, L]")
    check_prompt(prompt, limits, tn.INPUT_IDS, num_virtual_tokens)
    return prompt


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


def _seed(tensors: dict) -> int:
    """random_seed as uint64: an int64 tensor's negative values wrap (two's complement)."""
    seed = _scalar(tensors, tn.RANDOM_SEED, "int", 0)
    check_range(tn.RANDOM_SEED, seed, -(1 << 63), (1 << 64) - 1)
    return seed & ((1 << 64) - 1)


def _word_list(tensors: dict, name: str, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    if name not in tensors:
        return ()
    t = _tensor(name, tensors[name])
    if t.dtype not in INT_DTYPES:
        raise RequestError(f"{name}: expected an int32 tensor, got {t.dtype}")
    try:
        return parse_word_list(t, name, vocab_size)
    except ValueError as e:
        raise RequestError(str(e)) from None


# DecodingParams field -> the request tensor that sets it, for error messages.
_TENSOR_NAMES = {f.param: f.tensor for f in SAMPLING_FIELDS}


def _decoding_params(tensors: dict, limits: AdmissionLimits, normalize_log_probs: bool) -> DecodingParams:
    """The request's decoding settings, checked by the one validator (DecodingParams.validate)."""
    end_id = _scalar(tensors, tn.END_ID, "int", None)
    scalars = {f.param: _scalar(tensors, f.tensor, f.kind, f.default) for f in SAMPLING_FIELDS
               if f.param != "random_seed"}
    params = DecodingParams(
        **scalars,
        random_seed=_seed(tensors),
        end_id=None if end_id == -1 else end_id,   # -1: no end id, as unset
        normalize_log_probs=normalize_log_probs,
        bad_words=_word_list(tensors, tn.BAD_WORDS_LIST, limits.vocab_size),
        stop_words=_word_list(tensors, tn.STOP_WORDS_LIST, limits.vocab_size),
        embedding_bias=_embedding_bias(tensors, limits.vocab_size))
    return check_decoding(params, limits, _TENSOR_NAMES)


def check_decoding(params: DecodingParams, limits: AdmissionLimits, names: dict[str, str]) -> DecodingParams:
    """The one validator (DecodingParams.validate) against the engine; `names` maps a field to
    the name the user knows."""
    try:
        params.validate(limits.vocab_size, limits.max_beam_width, names=names)
    except ValueError as e:
        raise RequestError(str(e)) from None
    return params


def _embedding_bias(tensors: dict, vocab_size: int):
    """float32 [V] (from [V] or [1, V]) or None."""
    if tn.EMBEDDING_BIAS not in tensors:
        return None
    t = _tensor(tn.EMBEDDING_BIAS, tensors[tn.EMBEDDING_BIAS])
    if t.dtype not in _FLOAT_DTYPES:
        raise RequestError(f"{tn.EMBEDDING_BIAS}: expected a float32 tensor, got {t.dtype}")
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.shape != (vocab_size,):
        raise RequestError(f"{tn.EMBEDDING_BIAS}: expected shape [{vocab_size}] or [1, {vocab_size}], "
                           f"got {list(tensors[tn.EMBEDDING_BIAS].shape)}")
    t = t.detach().to("cpu", torch.float32).clone()
    if not bool(torch.isfinite(t).all()):
        raise RequestError(f"{tn.EMBEDDING_BIAS}: must be finite (NaN or inf found)")
    return t


def to_spec(request: InferenceRequest, limits: AdmissionLimits, normalize_log_probs: bool = True) -> RequestSpec:
    tensors = request.input_tensors
    unknown = set(tensors) - tn.INPUT_NAMES
    if unknown:
        raise RequestError(f"unknown input tensor names {sorted(unknown)}")
    for name in _UNSUPPORTED:
        if name in tensors:
            raise RequestError(f"{name}: not supported by this version")
    table = _prompt_table(tensors, limits)
    prompt = _input_ids(tensors, limits, 0 if table is None else table.shape[0])
    lora = _lora(tensors, limits)
    if tn.MAX_NEW_TOKENS not in tensors:
        raise RequestError(f"{tn.MAX_NEW_TOKENS}: missing (required)")
    max_new_tokens = _scalar(tensors, tn.MAX_NEW_TOKENS, "int")
    flag_names = {"return_log_probs": tn.RETURN_LOG_PROBS, "return_context_logits": tn.RETURN_CONTEXT_LOGITS,
                  "return_generation_logits": tn.RETURN_GENERATION_LOGITS}
    return make_spec(
        request.request_id, prompt, max_new_tokens, limits,
        pad_id=lambda: _scalar(tensors, tn.PAD_ID, "int", 0),
        decoding=lambda: _decoding_params(tensors, limits, normalize_log_probs),
        output_flags=lambda: {field: _scalar(tensors, name, "bool", False) for field, name in flag_names.items()},
        is_streaming=bool(request.is_streaming), logits_post_processor=request.logits_post_processor,
        use_batched_post_processor=bool(getattr(request, "use_batched_logits_post_processor", False)),
        drafts=lambda: _drafts(tensors, limits),
        guide=lambda: check_guide(getattr(request, "guided_decoding_params", None), limits.guides,
                                  "guided_decoding_params"),
        lora=lora, prompt_table=table, cache_salt=cache_salt(lora, table))


def _lora(tensors: dict, limits: AdmissionLimits) -> AdapterRef | None:
    try:
        return adapter_ref(tensor_int(tn.LORA_TASK_ID, tensors.get(tn.LORA_TASK_ID)), tensors.get(tn.LORA_WEIGHTS),
                           tensors.get(tn.LORA_CONFIG), limits.model_config, limits.peft_cache_config)
    except ValueError as e:
        raise RequestError(str(e)) from None


def _prompt_table(tensors: dict, limits: AdmissionLimits):
    """float32 [T, hidden] or None; prompt_vocab_size must come with it and equal T."""
    has_table, has_size = tn.PROMPT_EMBEDDING_TABLE in tensors, tn.PROMPT_VOCAB_SIZE in tensors
    if has_table != has_size:
        missing = tn.PROMPT_VOCAB_SIZE if has_table else tn.PROMPT_EMBEDDING_TABLE
        raise RequestError(f"{missing}: missing; {tn.PROMPT_EMBEDDING_TABLE} and {tn.PROMPT_VOCAB_SIZE} come together")
    if not has_table:
        return None
    try:
        table = check_prompt_table(tensors[tn.PROMPT_EMBEDDING_TABLE], limits.model_config.hidden_size)
    except ValueError as e:
        raise RequestError(str(e)) from None
    size = _scalar(tensors, tn.PROMPT_VOCAB_SIZE, "int")
    if size != table.shape[0]:
        raise RequestError(f"{tn.PROMPT_VOCAB_SIZE}: {size}, but {tn.PROMPT_EMBEDDING_TABLE} has {table.shape[0]} rows")
    return table


def cache_salt(lora: AdapterRef | None, table) -> bytes | None:
    """What keys a request's cached KV besides its tokens: its adapter and its prompt table."""
    if lora is None and table is None:
        return None
    task = b"" if lora is None else lora.task_id.to_bytes(8, "little")
    return task + b"|" + (b"" if table is None else table_digest(table))


def _drafts(tensors: dict, limits: AdmissionLimits) -> tuple[list[int], torch.Tensor | None]:
    """draft_input_ids int [1, D] or [D] and the optional draft_logits float [D, V] or [1, D, V]."""
    if tn.DRAFT_INPUT_IDS not in tensors:
        if tn.DRAFT_LOGITS in tensors:
            raise RequestError(f"{tn.DRAFT_LOGITS}: given without {tn.DRAFT_INPUT_IDS}")
        return [], None
    drafts = _token_ids(tn.DRAFT_INPUT_IDS, tensors[tn.DRAFT_INPUT_IDS], "[1, D] or [D]")
    draft_logits = None
    if tn.DRAFT_LOGITS in tensors:
        draft_logits = _tensor(tn.DRAFT_LOGITS, tensors[tn.DRAFT_LOGITS])
        if draft_logits.dtype not in _FLOAT_DTYPES:
            raise RequestError(f"{tn.DRAFT_LOGITS}: expected a float32 tensor, got {draft_logits.dtype}")
        if draft_logits.dim() == 3 and draft_logits.shape[0] == 1:
            draft_logits = draft_logits[0]
    return check_drafts(drafts, draft_logits, limits, tn.DRAFT_INPUT_IDS, tn.DRAFT_LOGITS)


def check_drafts(drafts: list[int], draft_logits: torch.Tensor | None, limits: AdmissionLimits, name: str,
                 logits_name: str) -> tuple[list[int], torch.Tensor | None]:
    """The draft checks both front-ends share -> (drafts, draft_logits float32 [D, V] on the CPU)."""
    if not drafts:
        raise RequestError(f"{name}: must not be empty")
    if len(drafts) > limits.max_draft_tokens:
        hint = " (set max_draft_tokens to accept drafts)" if not limits.max_draft_tokens else ""
        raise RequestError(f"{name}: {len(drafts)} draft tokens exceed max_draft_tokens={limits.max_draft_tokens}{hint}")
    bad = [t for t in drafts if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestError(f"{name}: token ids must be in [0, {limits.vocab_size}), got {bad[0]}")
    if draft_logits is None:
        return drafts, None
    if tuple(draft_logits.shape) != (len(drafts), limits.vocab_size):
        raise RequestError(f"{logits_name}: expected shape [{len(drafts)}, {limits.vocab_size}] (one row per draft "
                           f"token), got {list(draft_logits.shape)}")
    draft_logits = draft_logits.detach().to("cpu", torch.float32).clone()
    if not bool(torch.isfinite(draft_logits).all()):
        raise RequestError(f"{logits_name}: must be finite (NaN or inf found)")
    return drafts, draft_logits


_FIELD_NAMES = {"max_new_tokens": tn.MAX_NEW_TOKENS, "pad_id": tn.PAD_ID, "draft_input_ids": tn.DRAFT_INPUT_IDS,
                "num_return_sequences": tn.NUM_RETURN_SEQUENCES, "beam_width": tn.BEAM_WIDTH,
                "return_context_logits": tn.RETURN_CONTEXT_LOGITS,
                "return_generation_logits": tn.RETURN_GENERATION_LOGITS}


def make_spec(request_id, prompt: list[int], max_new_tokens: int, limits: AdmissionLimits, *,
              pad_id: Callable[[], int], decoding: Callable[[], DecodingParams],
              output_flags: Callable[[], dict[str, bool]], names: dict[str, str] = _FIELD_NAMES,
              drafts: Callable[[], tuple[list[int], Any]] = lambda: ([], None),
              guide: Callable[[], Any] = lambda: None, **fields) -> RequestSpec:
    """The checks every front door shares, after its own parsing (the prompt is checked by
    `check_prompt`). `pad_id`, `decoding` and `output_flags` (return_log_probs,
    return_context_logits, return_generation_logits) are read when their turn comes, so the first
    bad field is reported in one order. `fields`: the other RequestSpec fields; `request_id` only
    names the request in the log."""
    if max_new_tokens <= 0:
        raise RequestError(f"{names['max_new_tokens']}: must be positive, got {max_new_tokens}")
    if len(prompt) + max_new_tokens > limits.max_seq_len:
        clamped = limits.max_seq_len - len(prompt)
        logger.warning("request %s: prompt %d + %s %d exceeds max_seq_len %d; clamped to %d new tokens",
                       request_id, len(prompt), names['max_new_tokens'], max_new_tokens, limits.max_seq_len,
                       clamped)
        max_new_tokens = clamped
    pad = pad_id()
    check_range(names["pad_id"], pad, -(1 << 31), (1 << 31) - 1)   # written into int32 output_ids
    params = decoding()
    num_sequences = params.num_sequences   # beams, or independent samples (they share KV like beams)
    if num_sequences > limits.max_batch_size:
        field = names["num_return_sequences" if params.num_return_sequences > 1 else "beam_width"]
        raise RequestError(f"{field}: {num_sequences} sequences exceed max_batch_size {limits.max_batch_size}")
    draft_tokens, draft_logits = drafts()
    if draft_tokens and num_sequences > 1:
        raise RequestError(f"{names['draft_input_ids']}: draft tokens need beam width 1, got {params.beam_width}"
                           + (f" and num_return_sequences {params.num_return_sequences}"
                              if params.num_return_sequences > 1 else ""))
    fields.update(output_flags())
    if fields["return_context_logits"] and not limits.gather_context_logits:
        raise RequestError(f"{names['return_context_logits']}: true, but the engine was not built with "
                           "gather_context_logits")
    if fields["return_generation_logits"] and not limits.gather_generation_logits:
        raise RequestError(f"{names['return_generation_logits']}: true, but the engine was not built with "
                           "gather_generation_logits")
    need_blocks = -(-(len(prompt) + max_new_tokens) // limits.tokens_per_block)
    if num_sequences > 1:  # each beam's own table plus one copy-on-write block (beam_blocks.max_beam_blocks)
        need_blocks = num_sequences * (need_blocks + 1)
    if need_blocks > limits.max_num_blocks:
        raise RequestError(f"{names['max_new_tokens']}: prompt {len(prompt)} + {max_new_tokens} new tokens need "
                           f"{need_blocks} KV blocks; the whole pool has {limits.max_num_blocks}")
    try:   # last: its grammar starts compiling (off this thread) only for an otherwise valid request
        compiled = guide()
    except ValueError as e:
        raise RequestError(str(e)) from None
    if draft_logits is not None or compiled is not None:
        params = replace(params, draft_logits=draft_logits, guide=compiled)
    return RequestSpec(prompt=prompt, max_new_tokens=max_new_tokens, decoding=params, pad_id=pad,
                       draft_tokens=tuple(draft_tokens), **fields)
