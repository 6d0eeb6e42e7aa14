"""The Executor's two conversions: a `Request` into a `RequestSpec` (on the caller's thread,
parsed here, then checked as GptManager's tensors are: `runtime.request.make_spec`), and a
request's `RequestOutput` into a `Result` (on the worker thread, rendered as GptManager's
responses are: `batch_manager.doors.rendering.render_tensors`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from runtime.decoding import DecodingParams
from runtime.decoding.fields import SAMPLING_FIELDS

from runtime.adapters.prompt_tuning import check_prompt_table

from runtime.request import AdmissionLimits, RequestError, RequestOutput, RequestSpec, ResumedContext
from runtime.request import FinishReason as CoreFinishReason
from runtime.request import check_prompt, check_range, make_spec

from ..adapters.lora import adapter_ref
from ..doors.rendering import context_logits, render_tensors
from ..doors.tensor_checks import INT_DTYPES, cache_salt, finite_rows
from ..guided_decoding import parse_guide
from .request import (ExternalDraftTokensConfig, FinishReason, LoraConfig, OutputConfig, PromptTuningConfig, Request,
                      Result, SamplingConfig)

# DecodingParams field -> the name the Executor's user knows, for error messages.
_NAMES = {f.param: (f.executor if "." in f.executor else f"sampling_config.{f.executor}")
          for f in SAMPLING_FIELDS if f.executor is not None}
_NAMES.update(end_id="end_id", embedding_bias="embedding_bias",
              draft_acceptance_threshold="external_draft_tokens_config.acceptance_threshold")
_FIELD_NAMES = {"max_new_tokens": "max_tokens", "pad_id": "pad_id", "draft_input_ids": "external_draft_tokens_config",
                "draft_tokens": "external_draft_tokens_config.tokens", "draft_logits": "external_draft_tokens_config.logits",
                "num_return_sequences": "sampling_config.num_return_sequences",
                "beam_width": "sampling_config.beam_width",
                "return_context_logits": "output_config.return_context_logits",
                "return_generation_logits": "output_config.return_generation_logits"}
_LORA_NAMES = ("lora_config.task_id", "lora_config.weights", "lora_config.config")


@dataclass(frozen=True)
class OutputOptions:
    """What shapes a request's results, beside its RequestSpec."""
    exclude_input_from_output: bool
    return_all_generated_tokens: bool


def to_spec(request: Request, limits: AdmissionLimits, normalize_log_probs: bool,
            post_processors: dict[str, Callable], has_batched_post_processor: bool,
            resumed: ResumedContext | None = None, context_only: bool = False) -> tuple[RequestSpec, OutputOptions]:
    """ValueError (RequestError) naming the field and the value for bad input. `resumed`: a
    generation-only request's start; `context_only`: it runs to its first token."""
    if not isinstance(request, Request):
        raise RequestError(f"request: expected an executor Request, got {type(request).__name__}")
    prompt = _token_ids("input_token_ids", request.input_token_ids)
    table = _prompt_table(request.prompt_tuning_config, limits)
    check_prompt(prompt, limits, "input_token_ids", 0 if table is None else table.shape[0])
    lora = _lora(request.lora_config, limits)
    if request.max_tokens is None:
        raise RequestError("max_tokens: missing (required)")
    max_tokens = _int("max_tokens", request.max_tokens)
    output = request.output_config
    if not isinstance(output, OutputConfig):
        raise RequestError(f"output_config: expected an OutputConfig, got {type(output).__name__}")
    priority = request.priority
    if isinstance(priority, bool) or not isinstance(priority, (int, float)) or not 0.0 <= priority <= 1.0:
        raise RequestError(f"priority: {priority!r} outside [0, 1]")
    post_processor, use_batched = _post_processor(request.logits_post_processor_name, post_processors,
                                                 has_batched_post_processor)
    draft_tokens, draft_logits = _drafts(request.external_draft_tokens_config)
    try:
        guide = parse_guide(request.guided_decoding_params, limits.guides, "guided_decoding_params")
    except ValueError as e:
        raise RequestError(str(e)) from None
    spec = make_spec(
        prompt, max_tokens, limits, _decoding_params(request, limits, normalize_log_probs), names=_FIELD_NAMES,
        decoding_names=_NAMES, request_id="being enqueued",
        pad_id=0 if request.pad_id is None else _int("pad_id", request.pad_id),
        draft_tokens=draft_tokens, draft_logits=draft_logits, guide=guide, context_only=context_only,
        **{name: bool(getattr(output, name)) for name in
           ("return_log_probs", "return_context_logits", "return_generation_logits")},
        is_streaming=bool(request.streaming), logits_post_processor=post_processor,
        use_batched_post_processor=use_batched, priority=float(priority), client_id=_client_id(request.client_id),
        lora=lora, prompt_table=table, cache_salt=cache_salt(lora, table), resumed=resumed)
    _claim_adapter(spec.lora, limits)   # last: a refused request leaves no claim behind
    return spec, OutputOptions(bool(output.exclude_input_from_output), bool(request.return_all_generated_tokens))


def _drafts(config) -> tuple[list[int] | None, Any]:
    if config is None:
        return None, None
    if not isinstance(config, ExternalDraftTokensConfig):
        raise RequestError(f"external_draft_tokens_config: expected an ExternalDraftTokensConfig, "
                           f"got {type(config).__name__}")
    tokens = _token_ids("external_draft_tokens_config.tokens", config.tokens)
    logits = config.logits
    if logits is not None and (not isinstance(logits, torch.Tensor) or not logits.is_floating_point()
                               or logits.is_meta):
        raise RequestError(f"external_draft_tokens_config.logits: expected a float tensor [D, V] with values, "
                           f"got {getattr(logits, 'dtype', type(logits).__name__)}"
                           f"{' on the meta device' if getattr(logits, 'is_meta', False) else ''}")
    return tokens, None if logits is None else finite_rows("external_draft_tokens_config.logits", logits)


def _lora(config, limits: AdmissionLimits):
    if config is None:
        return None
    if not isinstance(config, LoraConfig):
        raise RequestError(f"lora_config: expected a LoraConfig, got {type(config).__name__}")
    try:
        return adapter_ref(config.task_id, config.weights, config.config, limits.model_config,
                           limits.peft_cache_config, _LORA_NAMES)
    except ValueError as e:
        raise RequestError(str(e)) from None


def _claim_adapter(ref, limits: AdmissionLimits) -> None:
    """Weights sent again for a cached (or queued) task id: refused when they differ (API.md);
    else the id is claimed for them until the worker caches them (adapter_weights.py)."""
    if ref is not None and ref.payload is not None and limits.adapter_weights is not None:
        error = limits.adapter_weights.claim(ref, _LORA_NAMES[1])
        if error is not None:
            raise RequestError(error)


def _prompt_table(config, limits: AdmissionLimits):
    if config is None:
        return None
    if not isinstance(config, PromptTuningConfig):
        raise RequestError(f"prompt_tuning_config: expected a PromptTuningConfig, got {type(config).__name__}")
    try:
        return check_prompt_table(config.embedding_table, limits.model_config.hidden_size,
                                  "prompt_tuning_config.embedding_table")
    except ValueError as e:
        raise RequestError(str(e)) from None


def _int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name}: expected an integer, got {value!r}")
    return value


def _client_id(value) -> int | None:
    """TensorRT-LLM's client id: None or a uint64 (handed back with every response)."""
    if value is None:
        return None
    check_range("client_id", _int("client_id", value), 0, (1 << 64) - 1)
    return value


def _token_ids(name: str, value) -> list[int]:
    """A list of ints or a 1-D integer tensor (as GptManager's input_ids: not bool, float or
    complex) -> list[int]."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in INT_DTYPES or value.dim() != 1:
            raise RequestError(f"{name}: expected a 1-D integer tensor, got {value.dtype} {list(value.shape)}")
        if value.device.type == "meta":
            raise RequestError(f"{name}: a tensor on the meta device (no values), shape {list(value.shape)}")
        return value.tolist()
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise RequestError(f"{name}: expected a list of token ids (ints), got {type(value).__name__}")
    return list(value)


def _words(name: str, value, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise RequestError(f"{name}: expected a list of words (lists of token ids), got {type(value).__name__}")
    words = []
    for word in value:
        tokens = _token_ids(name, word)
        if not tokens:
            raise RequestError(f"{name}: empty word")
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"{name}: token id {bad[0]} outside [0, {vocab_size})")
        words.append(tuple(tokens))
    return tuple(words)


def _decoding_params(request: Request, limits: AdmissionLimits, normalize_log_probs: bool) -> DecodingParams:
    sampling = request.sampling_config
    if not isinstance(sampling, SamplingConfig):
        raise RequestError(f"sampling_config: expected a SamplingConfig, got {type(sampling).__name__}")
    values = {}
    for f in SAMPLING_FIELDS:
        if f.executor_sampling is not None:
            value = getattr(sampling, f.executor_sampling)
            values[f.param] = f.default if value is None else value
    if isinstance(values["early_stopping"], bool):
        values["early_stopping"] = int(values["early_stopping"])
    if request.end_id is not None:
        _int("end_id", request.end_id)
    bias = request.embedding_bias
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.is_meta:
            got = "a tensor on the meta device" if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise RequestError(f"embedding_bias: expected a float tensor [{limits.vocab_size}] with values, got {got}")
        bias = bias.detach().cpu()
        if bias.dim() == 2 and bias.shape[0] == 1:
            bias = bias[0]
        if bias.dtype.is_floating_point:   # shape and finiteness: DecodingParams.validate
            bias = bias.to(torch.float32).clone()
    output = request.output_config
    threshold = getattr(request.external_draft_tokens_config, "acceptance_threshold", None)
    return DecodingParams(**values, end_id=request.end_id, normalize_log_probs=normalize_log_probs,
                          draft_acceptance_threshold=threshold,
                          num_top_log_probs=getattr(output, "num_top_log_probs", 0),
                          bad_words=_words("bad_words", request.bad_words, limits.vocab_size),
                          stop_words=_words("stop_words", request.stop_words, limits.vocab_size),
                          embedding_bias=bias)


def _post_processor(name, post_processors: dict[str, Callable], has_batched: bool) -> tuple[Callable | None, bool]:
    """-> (per-request processor, whether the batched one applies)."""
    if name is None:
        return None, False
    if name == Request.BATCHED_POST_PROCESSOR_NAME:
        if has_batched:
            return None, True
        raise RequestError(f"logits_post_processor_name: {name!r}, but the executor has no processor_batched")
    if name not in post_processors:
        raise RequestError(f"logits_post_processor_name: {name!r} not in the executor's processor_map "
                           f"{sorted(post_processors)}")
    return post_processors[name], False


# -- results ----------------------------------------------------------------------------------------

_FINISH_REASONS = {CoreFinishReason.END_ID: FinishReason.END_ID, CoreFinishReason.STOP_WORDS: FinishReason.STOP_WORDS,
                   CoreFinishReason.LENGTH: FinishReason.LENGTH, CoreFinishReason.STOPPED: FinishReason.CANCELLED}


def to_result(spec: RequestSpec, output: RequestOutput, start: int, is_final: bool, options: OutputOptions,
              has_exported_kv: bool = False) -> Result:
    """The next result of a request (streamed or final): generated tokens from `start` on.
    `has_exported_kv`: a context-only request whose KV blocks were kept for a generation instance."""
    if options.return_all_generated_tokens:
        start = 0   # every generated token so far, not only the new ones
    with_prompt = not spec.is_streaming and not options.exclude_input_from_output
    # Generation-only: its first token is the context instance's; its input is prompt + that token.
    num_first = 0 if spec.resumed is None else 1
    rendered = render_tensors(spec, output, max(start if spec.is_streaming else 0, num_first),
                              with_prompt and not num_first)
    token_ids = rendered.token_ids
    if with_prompt and num_first:
        token_ids = [spec.prompt + output.sequences[0].tokens[:num_first] + row for row in token_ids]
    if is_final and not has_exported_kv:   # a context-only request that left its KV is not finished
        reasons = [_FINISH_REASONS.get(s.finish_reason, FinishReason.NOT_FINISHED) for s in output.sequences]
    else:
        reasons = [FinishReason.NOT_FINISHED] * len(output.sequences)
    result = Result(is_final=is_final, output_token_ids=token_ids, finish_reasons=reasons,
                    decoding_iter=output.num_generated, is_sequence_final=is_final)
    if spec.return_log_probs:
        result.cum_log_probs, result.log_probs = rendered.cum_log_probs, rendered.log_probs
    if is_final:
        result.context_logits = context_logits(spec, output)
    result.generation_logits = rendered.generation_logits
    result.top_log_probs, result.top_log_prob_ids = rendered.top_log_probs, rendered.top_log_prob_ids
    return result


def is_samples(spec: RequestSpec) -> bool:
    """num_return_sequences > 1 (beam width 1): its results come one per sequence."""
    return spec.decoding.num_return_sequences > 1 and not spec.decoding.is_beam_search


def to_sequence_results(spec: RequestSpec, output: RequestOutput, sent: list[int], is_final: bool,
                        options: OutputOptions) -> list[Result]:
    """The next results of an `is_samples` request, one per sequence (TensorRT-LLM's shape):
    streaming, sequence i's tokens from sent[i] on, for the sequences with new ones (every
    sequence in the final response); otherwise each sequence whole, in the final response. The
    request's last result has is_final; every result of the final response is_sequence_final
    (a sample that ended early is seen as ended only then)."""
    with_prompt = not spec.is_streaming and not options.exclude_input_from_output
    rendered = render_tensors(spec, output, 0, with_prompt)
    prefix = len(spec.prompt) if with_prompt else 0
    logits = context_logits(spec, output) if is_final else None
    results = []
    for i, sequence in enumerate(output.sequences):
        start = 0 if options.return_all_generated_tokens or not spec.is_streaming else sent[i]
        if not is_final and len(sequence.tokens) <= start:
            continue
        reason = _FINISH_REASONS.get(sequence.finish_reason, FinishReason.NOT_FINISHED) if is_final \
            else FinishReason.NOT_FINISHED
        tokens = rendered.token_ids[i][:prefix] + rendered.token_ids[i][prefix + start:]
        result = Result(is_final=False, output_token_ids=[tokens], finish_reasons=[reason], sequence_index=i,
                        decoding_iter=output.num_generated, is_sequence_final=is_final, context_logits=logits)
        if spec.return_log_probs:
            result.cum_log_probs = rendered.cum_log_probs[i:i + 1]
            result.log_probs = rendered.log_probs[i:i + 1, start:len(sequence.log_probs)]
        if rendered.generation_logits is not None:
            result.generation_logits = rendered.generation_logits[i:i + 1, start:len(sequence.tokens)]
        results.append(result)
    if is_final:
        results[-1].is_final = True
    return results
