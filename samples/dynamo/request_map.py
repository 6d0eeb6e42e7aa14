"""A Dynamo request (the dict the frontend's preprocessor sends: token ids, `sampling_options`,
`stop_conditions`, `output_options`) -> an Executor `Request`, and a `Result`'s finish reason ->
Dynamo's name. Pure: no Dynamo import, no engine. An option the Executor cannot honour is an
`UnsupportedOption` naming its group and key; a value it refuses is a ValueError naming the same."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batch_manager.executor import FinishReason, OutputConfig, Request, SamplingConfig

# sampling_options key -> the SamplingConfig attribute it sets (None values are left at the default)
SAMPLING_TO_CONFIG = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                      "seed": "seed", "repetition_penalty": "repetition_penalty",
                      "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
# Keys the frontend may send that need no engine work, with the values that keep them so (ANY:
# every value; the frontend acts on it). A key set to anything else is unsupported: its value is
# what the user asked for and the engine cannot do. A key not listed is unsupported unless unset.
ANY = None
NEUTRAL_SAMPLING = {"best_of": (1,), "use_beam_search": (False,), "guided_decoding": (), "logit_bias": ({},),
                    "include_stop_str_in_output": (False,)}
NEUTRAL_STOP = {"stop": ANY, "stop_token_ids_hidden": ANY}   # stop strings: the frontend's detokenizer ends them
NEUTRAL_OUTPUT = {"prompt_logprobs": (0,), "skip_special_tokens": ANY, "formatted_prompt": ANY}
_UNSET_VALUES = (False, [], {})
MAX_TOP_LOG_PROBS = 20   # OpenAI's bound on top_logprobs

# Executor field (the start of its ValueError) -> the Dynamo field the user set
_EXECUTOR_TO_DYNAMO = {"input_token_ids": "token_ids", "max_tokens": "stop_conditions.max_tokens",
                       "stop_words": "stop_conditions.stop_token_ids",
                       "end_id": "stop_conditions.stop_token_ids_hidden",
                       "output_config.num_top_log_probs": "output_options.logprobs",
                       "sampling_config.min_tokens": "stop_conditions.min_tokens",
                       "sampling_config.num_return_sequences": "sampling_options.n",
                       **{f"sampling_config.{v}": f"sampling_options.{k}" for k, v in SAMPLING_TO_CONFIG.items()}}

FINISH_REASON_NAMES = {FinishReason.END_ID: "stop", FinishReason.STOP_WORDS: "stop", FinishReason.LENGTH: "length",
                       FinishReason.CANCELLED: "cancelled", FinishReason.TIMED_OUT: "length"}


class UnsupportedOption(ValueError):
    """An option of the request this engine does not implement; the message names it."""


@dataclass(frozen=True)
class EngineLimits:
    max_seq_len: int              # prompt + generated tokens, at most
    end_ids: tuple[int, ...]      # the model's end ids, used when the request names none


@dataclass(frozen=True)
class MappedRequest:
    request: Request
    num_sequences: int            # sampling_options.n: results carry sequence_index 0..n-1
    num_top_log_probs: int | None  # output_options.logprobs (None: no log probs)


def name_dynamo_field(message: str) -> str:
    """An Executor ValueError "<field>: ..." with the field as the Dynamo request spells it."""
    field, sep, rest = message.partition(": ")
    return f"{_EXECUTOR_TO_DYNAMO.get(field, field)}{sep}{rest}" if sep else message


def _group(request: dict, name: str) -> dict:
    value = request.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected an object, got {type(value).__name__}")
    return value


def _check_neutral(group: dict, group_name: str, known: set[str], neutral: dict) -> None:
    for key, value in group.items():
        if key in known or value is None:
            continue
        allowed = neutral.get(key, _UNSET_VALUES)
        if allowed is ANY or any(value == a and type(value) is type(a) for a in allowed):
            continue
        raise UnsupportedOption(f"{group_name}.{key}: not supported by this engine (got {str(value)[:80]})")


def _int_list(value: Any, field: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(type(t) is int for t in value):
        raise ValueError(f"{field}: expected a list of token ids, got {str(value)[:80]}")
    return list(value)


def _positive_int(value: Any, field: str, low: int) -> int:
    if type(value) is not int or value < low:
        raise ValueError(f"{field}: expected an integer >= {low}, got {value!r}")
    return value


def _max_tokens(stop: dict, prompt_len: int, limits: EngineLimits) -> int:
    """What the request asks (None: up to max_seq_len); past max_seq_len is refused, never clamped."""
    room = limits.max_seq_len - prompt_len
    if room < 1:
        raise ValueError(f"token_ids: prompt length {prompt_len} leaves no room to generate within the engine's "
                         f"max_seq_len {limits.max_seq_len}")
    asked = stop.get("max_tokens")
    if asked is None:
        return room
    asked = _positive_int(asked, "stop_conditions.max_tokens", 1)
    if asked > room:
        raise ValueError(f"stop_conditions.max_tokens: prompt length {prompt_len} + max_tokens {asked} exceeds the "
                         f"engine's max_seq_len {limits.max_seq_len}")
    return asked


def _end_ids(stop: dict, limits: EngineLimits) -> list[int]:
    """The ids that end the request unseen (the EOS of the model card, else the engine's); none
    with ignore_eos."""
    if stop.get("ignore_eos"):
        return []
    hidden = _int_list(stop.get("stop_token_ids_hidden"), "stop_conditions.stop_token_ids_hidden")
    return hidden or list(limits.end_ids)


def _sampling_config(options: dict, num_sequences: int, min_tokens: int | None) -> SamplingConfig:
    values = {attribute: options[key] for key, attribute in SAMPLING_TO_CONFIG.items() if options.get(key) is not None}
    if values.get("top_k") == -1:   # vLLM's and Dynamo's "every token"
        values["top_k"] = 0
    return SamplingConfig(**values, min_tokens=min_tokens,
                          num_return_sequences=num_sequences if num_sequences > 1 else None)


def _num_top_log_probs(output: dict) -> int | None:
    value = output.get("logprobs")
    if value is None:
        return None
    if type(value) is not int or not 0 <= value <= MAX_TOP_LOG_PROBS:
        raise ValueError(f"output_options.logprobs: expected an integer in [0, {MAX_TOP_LOG_PROBS}], got {value!r}")
    return value


def to_executor_request(request: dict, limits: EngineLimits) -> MappedRequest:
    """The Executor request of a Dynamo request, streaming. ValueError (UnsupportedOption for an
    option it cannot honour) naming the Dynamo field; the Executor checks the values at enqueue."""
    sampling = _group(request, "sampling_options")
    stop = _group(request, "stop_conditions")
    output = _group(request, "output_options")
    _check_neutral(sampling, "sampling_options", set(SAMPLING_TO_CONFIG) | {"n"}, NEUTRAL_SAMPLING)
    _check_neutral(stop, "stop_conditions", {"max_tokens", "min_tokens", "stop_token_ids", "ignore_eos"}, NEUTRAL_STOP)
    _check_neutral(output, "output_options", {"logprobs"}, NEUTRAL_OUTPUT)
    prompt = _int_list(request.get("token_ids"), "token_ids")
    num_sequences = _positive_int(sampling.get("n") if sampling.get("n") is not None else 1, "sampling_options.n", 1)
    min_tokens = stop.get("min_tokens")
    if min_tokens is not None:
        min_tokens = _positive_int(min_tokens, "stop_conditions.min_tokens", 0)
    end_ids = _end_ids(stop, limits)
    stop_ids = _int_list(stop.get("stop_token_ids"), "stop_conditions.stop_token_ids")
    stop_words = [[token] for token in end_ids[1:] + [t for t in stop_ids if t not in end_ids]]
    top = _num_top_log_probs(output)
    mapped = Request(prompt, _max_tokens(stop, len(prompt), limits), streaming=True,
                     sampling_config=_sampling_config(sampling, num_sequences, min_tokens),
                     output_config=OutputConfig(return_log_probs=top is not None, num_top_log_probs=top or 0,
                                                exclude_input_from_output=True),
                     end_id=end_ids[0] if end_ids else None, stop_words=stop_words or None)
    return MappedRequest(mapped, num_sequences, top)


def finish_reason_name(reason: FinishReason) -> str | None:
    """Dynamo's finish reason of ours (None while not finished)."""
    return FINISH_REASON_NAMES.get(reason)
