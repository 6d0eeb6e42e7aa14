"""What users hand the Executor (`Request`, `SamplingConfig`, `OutputConfig` and the feature
configs) and what they get back (`Response`, `Result`, `FinishReason`). Plain values: parsed by
`conversion.to_spec` and checked by `runtime.request.make_spec` at `Executor.enqueue_request`."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from runtime.decoding.fields import SAMPLING_FIELDS


def _alias(kwargs: dict, old: str, new: str, value):
    """`value` of the new name, or that of the older one (not both)."""
    if old not in kwargs:
        return value
    old_value = kwargs.pop(old)
    if value is not None and old_value is not None and value != old_value:
        raise ValueError(f"{new}: given twice, as {new}={value!r} and {old}={old_value!r}")
    return old_value if old_value is not None else value


def _no_more(kwargs: dict, cls: str) -> None:
    if kwargs:
        raise TypeError(f"{cls}: unexpected arguments {sorted(kwargs)}")


class SamplingConfig:
    """None = the default of the field (DecodingParams). `random_seed` and `min_length` are the
    older names of `seed` and `min_tokens`."""
    # Its attributes: the field table's (runtime.decoding.fields); __init__ spells each once.
    FIELDS = tuple(f.executor_sampling for f in SAMPLING_FIELDS if f.executor_sampling is not None)

    def __init__(self, beam_width=1, top_k=None, top_p=None, top_p_min=None, top_p_reset_ids=None,
                 top_p_decay=None, seed=None, temperature=None, min_tokens=None, beam_search_diversity_rate=None,
                 repetition_penalty=None, length_penalty=None, early_stopping=None, no_repeat_ngram_size=None,
                 presence_penalty=None, frequency_penalty=None, min_p=None, num_return_sequences=None,
                 **older_names):
        seed = _alias(older_names, "random_seed", "seed", seed)
        min_tokens = _alias(older_names, "min_length", "min_tokens", min_tokens)
        _no_more(older_names, "SamplingConfig")
        values = locals()
        for name in self.FIELDS:
            setattr(self, name, values[name])

    def resolved(self) -> dict[str, Any]:
        """attribute -> its value, the unset ones as their defaults."""
        defaults = {f.executor_sampling: f.default for f in SAMPLING_FIELDS if f.executor_sampling is not None}
        return {name: defaults[name] if getattr(self, name) is None else getattr(self, name) for name in self.FIELDS}

    random_seed = property(lambda self: self.seed, lambda self, v: setattr(self, "seed", v))
    min_length = property(lambda self: self.min_tokens, lambda self, v: setattr(self, "min_tokens", v))

    def __repr__(self) -> str:
        set_fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.FIELDS if getattr(self, n) is not None)
        return f"SamplingConfig({set_fields})"


@dataclass
class OutputConfig:
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = False
    num_top_log_probs: int = 0   # per generated token, the k most likely ids and their log probs


@dataclass
class ExternalDraftTokensConfig:
    tokens: list[int]
    logits: Any = None
    acceptance_threshold: float | None = None


@dataclass
class PromptTuningConfig:
    """embedding_table float [T, hidden] (or [1, T, hidden]): prompt ids vocab_size + j take row j."""
    embedding_table: Any


@dataclass
class LoraConfig:
    """task_id in [0, 2**63); weights [N, W] float and config int32 [N, 3] (TensorRT-LLM's format,
    batch_manager.load_peft_adapter makes them) with a task's first request, the id alone later."""
    task_id: int
    weights: Any = None
    config: Any = None


@dataclass
class ContextPhaseParams:
    """What a context-only request's final result hands to the generation-only request:
    first_gen_tokens [the first token], req_id (the context side's request id), opaque_state
    (msgpack bytes: where its KV blocks are and what the request asked for)."""
    first_gen_tokens: list[int]
    req_id: int
    opaque_state: bytes | None = None
    MAX_BYTES: ClassVar[int] = 1 << 16   # from_bytes refuses more (this module's params are ~600 bytes)

    def to_bytes(self) -> bytes:
        return msgpack.packb({"first_gen_tokens": list(self.first_gen_tokens), "req_id": self.req_id,
                              "opaque_state": self.opaque_state}, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> "ContextPhaseParams":
        """ValueError naming context_phase_params for bytes that are not a to_bytes() output (or
        more than MAX_BYTES of them)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"context_phase_params: expected the bytes of a ContextPhaseParams, got "
                             f"{type(data).__name__}")
        num_bytes = data.nbytes if isinstance(data, memoryview) else len(data)
        if num_bytes > cls.MAX_BYTES:
            raise ValueError(f"context_phase_params: {num_bytes} bytes (a ContextPhaseParams is at most "
                             f"{cls.MAX_BYTES})")
        try:
            value = msgpack.unpackb(bytes(data), raw=False)
        except (TypeError, ValueError, msgpack.UnpackException) as e:
            raise ValueError(f"context_phase_params: not the bytes of a ContextPhaseParams ({e})") from None
        if not isinstance(value, dict) or set(value) != {"first_gen_tokens", "req_id", "opaque_state"}:
            raise ValueError(f"context_phase_params: not the bytes of a ContextPhaseParams (got {str(value)[:80]})")
        tokens, state = value["first_gen_tokens"], value["opaque_state"]
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens) or type(value["req_id"]) is not int \
                or not isinstance(state, (bytes, type(None))):
            raise ValueError("context_phase_params: first_gen_tokens, req_id or opaque_state of the wrong type")
        return cls(tokens, value["req_id"], state)


class RequestType(enum.IntEnum):
    """REQUEST_TYPE_CONTEXT_AND_GENERATION (the default): a whole request on one instance;
    CONTEXT_ONLY: the prompt and its first token, its KV kept for GENERATION_ONLY on another."""
    REQUEST_TYPE_CONTEXT_AND_GENERATION = 0
    REQUEST_TYPE_CONTEXT_ONLY = 1
    REQUEST_TYPE_GENERATION_ONLY = 2


class Request:
    """One generation request. `max_new_tokens` is the older name of `max_tokens`. Word lists
    are lists of words, each a list of token ids; `embedding_bias` a float tensor [V]; `priority`
    in [0, 1]. `logits_post_processor_name` names an entry of the executor's
    `LogitsPostProcessorConfig.processor_map`, or `BATCHED_POST_PROCESSOR_NAME` for its batched
    processor. `request_type` / `context_phase_params`: disaggregated context and generation
    (disaggregated.py; README "Disaggregated context and generation"). `ttft_budget_ms`: refused
    at enqueue (QueueFullError) when its predicted time to first token is longer (ttft.py);
    `allotted_time_ms`: unfinished that long after enqueue, it ends with FinishReason.TIMED_OUT."""
    BATCHED_POST_PROCESSOR_NAME = "batched"
    FIELDS = ("input_token_ids", "max_tokens", "streaming", "sampling_config", "output_config", "end_id", "pad_id",
              "bad_words", "stop_words", "embedding_bias", "external_draft_tokens_config", "prompt_tuning_config",
              "lora_config", "logits_post_processor_name", "client_id", "return_all_generated_tokens", "priority",
              "guided_decoding_params", "request_type", "context_phase_params", "allotted_time_ms", "ttft_budget_ms")

    def __init__(self, input_token_ids, max_tokens=None, streaming=False, sampling_config=None, output_config=None,
                 end_id=None, pad_id=None, bad_words=None, stop_words=None, embedding_bias=None,
                 external_draft_tokens_config=None, prompt_tuning_config=None, lora_config=None,
                 logits_post_processor_name=None, client_id=None, return_all_generated_tokens=False,
                 priority=0.5, guided_decoding_params=None, request_type=None, context_phase_params=None,
                 allotted_time_ms=None, ttft_budget_ms=None, **older_names):
        max_tokens = _alias(older_names, "max_new_tokens", "max_tokens", max_tokens)
        _no_more(older_names, "Request")
        sampling_config = SamplingConfig() if sampling_config is None else sampling_config
        output_config = OutputConfig() if output_config is None else output_config
        request_type = RequestType.REQUEST_TYPE_CONTEXT_AND_GENERATION if request_type is None else request_type
        values = locals()
        for name in self.FIELDS:
            setattr(self, name, values[name])

    max_new_tokens = property(lambda self: self.max_tokens, lambda self, v: setattr(self, "max_tokens", v))

    def __repr__(self) -> str:
        return (f"Request(input_token_ids=<{_len(self.input_token_ids)} tokens>, max_tokens={self.max_tokens!r}, "
                f"streaming={self.streaming!r}, priority={self.priority!r})")


def _len(value) -> Any:
    try:
        return len(value)
    except TypeError:
        return "?"


class FinishReason(enum.IntEnum):
    NOT_FINISHED = 0
    END_ID = 1
    STOP_WORDS = 2
    LENGTH = 3
    TIMED_OUT = 4
    CANCELLED = 5


@dataclass
class Result:
    """output_token_ids: per beam. Streaming: the new tokens since the last result (beam width 1
    and each of num_return_sequences, unless return_all_generated_tokens) or every beam's generated
    tokens whole (beams reorder);
    otherwise prompt + generated (generated only with exclude_input_from_output).
    cum_log_probs float32 [beams], log_probs float32 [beams, n], context_logits float32
    [prompt_len, V] (final result only), generation_logits float32 [beams, n, V]: when asked."""
    is_final: bool
    output_token_ids: list[list[int]]
    finish_reasons: list[FinishReason]
    cum_log_probs: Any = None
    log_probs: Any = None
    context_logits: Any = None
    generation_logits: Any = None
    top_log_probs: Any = None       # float32 [beams, n, k], with OutputConfig.num_top_log_probs
    top_log_prob_ids: Any = None    # int32 [beams, n, k]
    # num_return_sequences n > 1: each result is one sequence's (0 <= sequence_index < n), as
    # TensorRT-LLM's; beam search keeps every beam in one result with index 0.
    sequence_index: int = 0
    decoding_iter: int = 0
    is_sequence_final: bool = False   # the last result of its sequence (is_final: of the request)
    # A context-only request's final result when its first token did not end it (finish reason
    # NOT_FINISHED): what its generation-only request takes; None otherwise.
    context_phase_params: "ContextPhaseParams | None" = None


@dataclass
class Response:
    request_id: int
    result: Result | None = None
    error_msg: str = ""
    client_id: int | None = None

    def has_error(self) -> bool:
        return self.result is None
