"""GptManager's parsing: an InferenceRequest's tensors into a RequestSpec (`to_spec`), with the checks
the tensor doors share (`batch_manager.doors.tensor_checks`). The door parses, then
`runtime.request.make_spec` checks. A bad request is a RequestError (a ValueError) that names the
field and the value; nothing is changed for a rejected request."""
from __future__ import annotations

import math

import torch

from runtime.adapters.prompt_tuning import check_prompt_table
from runtime.decoding import DecodingParams, parse_word_list
from runtime.decoding.fields import SAMPLING_FIELDS
from runtime.request import AdmissionLimits, RequestError, RequestSpec, check_prompt, check_range, make_spec

from ..adapters.lora import adapter_ref, tensor_int
from ..adapters.peft_cache import AdapterRef
from ..doors.tensor_checks import INT_DTYPES, cache_salt, finite_rows
from ..guided_decoding import parse_guide
from . import tensor_names as tn
from .inference_request import InferenceRequest

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# Accepted and validated, but not implemented by this version: a request that sets them is refused.
_UNSUPPORTED = (tn.POSITION_IDS,)


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
    end_id = _scalar(tensors, tn.END_ID, "int", None)
    scalars = {f.param: _scalar(tensors, f.tensor, f.kind, f.default) for f in SAMPLING_FIELDS
               if f.param != "random_seed"}
    return DecodingParams(
        **scalars,
        random_seed=_seed(tensors),
        end_id=None if end_id == -1 else end_id,   # -1: no end id, as unset
        normalize_log_probs=normalize_log_probs,
        bad_words=_word_list(tensors, tn.BAD_WORDS_LIST, limits.vocab_size),
        stop_words=_word_list(tensors, tn.STOP_WORDS_LIST, limits.vocab_size),
        embedding_bias=_embedding_bias(tensors, limits.vocab_size))


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
    draft_tokens, draft_logits = _drafts(tensors)
    try:
        guide = parse_guide(getattr(request, "guided_decoding_params", None), limits.guides, "guided_decoding_params")
    except ValueError as e:
        raise RequestError(str(e)) from None
    return make_spec(
        prompt, _scalar(tensors, tn.MAX_NEW_TOKENS, "int"), limits,
        _decoding_params(tensors, limits, normalize_log_probs), names=_FIELD_NAMES, decoding_names=_TENSOR_NAMES,
        request_id=request.request_id, pad_id=_scalar(tensors, tn.PAD_ID, "int", 0),
        draft_tokens=draft_tokens, draft_logits=draft_logits, guide=guide,
        **{field: _scalar(tensors, name, "bool", False) for field, name in _FLAG_NAMES.items()},
        is_streaming=bool(request.is_streaming), logits_post_processor=request.logits_post_processor,
        use_batched_post_processor=bool(getattr(request, "use_batched_logits_post_processor", False)),
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


def _drafts(tensors: dict) -> tuple[list[int] | None, torch.Tensor | None]:
    """draft_input_ids int [1, D] or [D] and the optional draft_logits float [D, V] or [1, D, V]."""
    if tn.DRAFT_INPUT_IDS not in tensors:
        if tn.DRAFT_LOGITS in tensors:
            raise RequestError(f"{tn.DRAFT_LOGITS}: given without {tn.DRAFT_INPUT_IDS}")
        return None, None
    drafts = _token_ids(tn.DRAFT_INPUT_IDS, tensors[tn.DRAFT_INPUT_IDS], "[1, D] or [D]")
    if tn.DRAFT_LOGITS not in tensors:
        return drafts, None
    draft_logits = _tensor(tn.DRAFT_LOGITS, tensors[tn.DRAFT_LOGITS])
    if draft_logits.dtype not in _FLOAT_DTYPES:
        raise RequestError(f"{tn.DRAFT_LOGITS}: expected a float32 tensor, got {draft_logits.dtype}")
    return drafts, finite_rows(tn.DRAFT_LOGITS, draft_logits[0] if draft_logits.dim() == 3 and
                               draft_logits.shape[0] == 1 else draft_logits)


_FIELD_NAMES = {"max_new_tokens": tn.MAX_NEW_TOKENS, "pad_id": tn.PAD_ID, "draft_input_ids": tn.DRAFT_INPUT_IDS,
                "draft_logits": tn.DRAFT_LOGITS, "num_return_sequences": tn.NUM_RETURN_SEQUENCES,
                "beam_width": tn.BEAM_WIDTH, "return_context_logits": tn.RETURN_CONTEXT_LOGITS,
                "return_generation_logits": tn.RETURN_GENERATION_LOGITS}
_FLAG_NAMES = {"return_log_probs": tn.RETURN_LOG_PROBS, "return_context_logits": tn.RETURN_CONTEXT_LOGITS,
               "return_generation_logits": tn.RETURN_GENERATION_LOGITS}
