"""The OpenAI request bodies of samples.serve (/v1/completions, /v1/chat/completions) -> a
`CompletionSpec`: prompts as token ids (text through the tokenizer, messages through its chat
template) and, per choice, the sample's own /generate body (`engine_body`), which
`params.parse_generate_body` turns into a request. Errors are `OpenAIError`s naming the field.

Fields: model, prompt (text, texts, token ids or lists of them) or messages, max_tokens
(max_completion_tokens), temperature, top_p, seed, stop, n, stream, stream_options.include_usage,
logprobs (completions: 0-5; chat: true with top_logprobs 0-20), presence_penalty, frequency_penalty,
logit_bias, user, echo (completions), tools / tool_choice / parallel_tool_calls (chat: see
`tool_calls`), and vLLM's extensions top_k, min_tokens, repetition_penalty, ignore_eos.
The fields vllm-router adds (`ROUTER_DEFAULTS`) are accepted with the values it sends.
Known OpenAI fields this server cannot honour are refused by name, never silently ignored. Text
is bounded by characters before it is tokenized (`ModelInfo.max_text_chars`); callers run
`parse_request` off the event loop (it tokenizes)."""
from __future__ import annotations

import secrets
from dataclasses import dataclass

from samples.serve.openai_basics import ModelInfo, OpenAIError, bad, check_num_chars, text_field
from samples.serve.openai_chat import parse_messages, parse_tools, render_chat
from samples.serve.tool_calls import ToolChoice, tool_grammar
from samples.serve.value_repr import short_repr

COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's; chat's default is what the context has left
MAX_CHOICES = 128                     # n times the number of prompts
MAX_STOP_STRINGS = 16
MAX_ID_DIGITS = 20                    # a logit_bias key longer than any uint64 is no token id

COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options",
                 "presence_penalty", "frequency_penalty", "logit_bias", "user", "logprobs",
                 "top_k", "min_tokens", "repetition_penalty", "ignore_eos"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                               "tool_choice", "functions", "function_call", "parallel_tool_calls"}
# What vllm-router adds to each request it forwards (vLLM's and SGLang's extensions), accepted with
# the value it sends, which is this server's behaviour; another value is refused by name.
ROUTER_DEFAULTS = {"no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False}
ROUTER_CHAT_DEFAULTS = {**ROUTER_DEFAULTS, "continue_final_message": False}
REASONING_FIELDS = {"separate_reasoning", "stream_reasoning", "include_reasoning"}   # no reasoning parser: any bool


@dataclass(frozen=True)
class CompletionSpec:
    is_chat: bool
    prompts: tuple[tuple[int, ...], ...]   # token ids per prompt (chat: one)
    n: int                                 # choices per prompt; choice index = prompt index * n + j
    max_tokens: tuple[int, ...]            # per prompt
    stream: bool
    include_usage: bool                    # stream_options.include_usage
    stop: tuple[str, ...]
    logprobs: bool                         # the sampled token's log prob per token
    top_logprobs: int                      # and the k most likely tokens' (the engine's num_top_log_probs)
    seed: int                              # choice j draws with seed + j (a random seed when none was sent)
    engine_fields: dict                    # sampling fields of the sample's /generate body
    echo_texts: tuple[str, ...] = ()       # completions' echo: per prompt, its text (each choice begins with it)
    tools: ToolChoice | None = None        # chat with tools
    grammar: str | None = None             # Lark text the replies are held to (tool_calls.tool_grammar)
    lora_name: str | None = None           # `model` named a loaded LoRA adapter (lora_routes)

    def engine_body(self, prompt_index: int, j: int) -> dict:
        """The /generate body of choice j of a prompt: always streamed (text deltas, stop strings,
        TTFT); choice j draws with seed + j (mod 2**64), as n requests with those seeds would."""
        body = {**self.engine_fields, "input_ids": list(self.prompts[prompt_index]),
                "max_new_tokens": self.max_tokens[prompt_index], "stream": True, "return_log_probs": self.logprobs}
        if self.top_logprobs:
            body["num_top_log_probs"] = self.top_logprobs
        body["seed"] = (self.seed + j) % (1 << 64)
        return body


# the /generate body field -> the OpenAI field, to name it in the engine's errors
ENGINE_TO_OPENAI = {"max_new_tokens": "max_tokens", "embedding_bias": "logit_bias", "min_length": "min_tokens",
                    "return_log_probs": "logprobs", "num_top_log_probs": "top_logprobs",
                    "num_return_sequences": "n", "guided_decoding_params": "tools",
                    "guided_decoding_params.guide": "tools"}


def _number(field: str, value, low: float, high: float) -> float:
    """NaN fails both comparisons; infinities and integers too large for a float fall outside."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise bad(field, f"expected a number in [{low}, {high}], got {short_repr(value)}")
    return float(value)


def _integer(field: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad(field, f"expected an integer in [{low}, {high}], got {short_repr(value)}")
    return value


def _boolean(field: str, value) -> bool:
    if not isinstance(value, bool):
        raise bad(field, f"expected true or false, got {short_repr(value)}")
    return value


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS:
        raise bad("stop", f"expected a string or a list of at most {MAX_STOP_STRINGS} strings, got {short_repr(value)}")
    for i, stop in enumerate(stops):
        if not text_field(f"stop[{i}]" if isinstance(value, list) else "stop", stop):
            raise bad(f"stop[{i}]" if isinstance(value, list) else "stop", "empty string")
    return tuple(stops)


def _logit_bias(value, vocab_size: int) -> list[float]:
    """{"token id": bias in [-100, 100]} -> a bias per vocabulary entry (the engine's embedding_bias)."""
    if not isinstance(value, dict):
        raise bad("logit_bias", f"expected an object of token id -> bias, got {short_repr(value)}")
    bias = [0.0] * vocab_size
    for key, b in value.items():   # the length first: int() refuses over 4,300 digits
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= MAX_ID_DIGITS
                and int(key) < vocab_size):
            raise bad("logit_bias", f"key {short_repr(key, 40)}: expected a token id in [0, {vocab_size})")
        bias[int(key)] = _number(f"logit_bias[{key}]", b, -100.0, 100.0)
    return bias


def _refuse_unsupported(body: dict, n: int) -> None:
    """Known OpenAI fields whose only accepted values are the ones that change nothing."""
    if body.get("echo") and body.get("logprobs") is not None:
        raise bad("echo", "with logprobs: the prompt's log probs are not supported (echo without logprobs is)")
    if body.get("suffix") is not None:
        raise bad("suffix", "not supported (only null)")
    best_of = body.get("best_of")
    if best_of is not None and (isinstance(best_of, bool) or not isinstance(best_of, int) or best_of != n):
        raise bad("best_of", f"not supported (only null or equal to n={n}), got {short_repr(best_of, 40)}")
    for field in ("functions", "function_call"):
        if body.get(field) is not None:
            raise bad(field, "the deprecated function calling fields are not supported: use tools and tool_choice")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise bad("response_format", f"only {{\"type\": \"text\"}} is supported, got {short_repr(response_format)}")


def _sampling(body: dict, info: ModelInfo) -> dict:
    """OpenAI's sampling fields -> the /generate body's. OpenAI samples by default (temperature 1,
    top_p 1); temperature 0 is greedy. Penalties reach the engine as they are: its presence and
    frequency penalties also count the prompt's tokens (TensorRT-LLM's semantics)."""
    fields = {"temperature": _number("temperature", body.get("temperature", 1.0), 0.0, 2.0),
              "top_p": _number("top_p", body.get("top_p", 1.0), 0.0, 1.0)}
    top_k = _integer("top_k", body.get("top_k", -1), -1, 1 << 30)   # vLLM's -1 (or 0): every token
    fields["top_k"] = max(top_k, 0)
    for field in ("presence_penalty", "frequency_penalty"):
        if body.get(field) is not None:
            fields[field] = _number(field, body[field], -2.0, 2.0)
    if body.get("repetition_penalty") is not None:
        fields["repetition_penalty"] = _number("repetition_penalty", body["repetition_penalty"], 0.01, 100.0)
    if body.get("min_tokens") is not None:
        fields["min_length"] = _integer("min_tokens", body["min_tokens"], 0, info.max_seq_len)
    if body.get("logit_bias") is not None:
        fields["embedding_bias"] = _logit_bias(body["logit_bias"], info.vocab_size)
    if not _boolean("ignore_eos", body.get("ignore_eos", False)) and info.end_id is not None:
        fields["end_id"] = info.end_id
        if info.other_end_ids:
            fields["stop_words"] = [[token] for token in info.other_end_ids]
    return fields


def _log_probs(body: dict, is_chat: bool) -> tuple[bool, int]:
    """-> (the sampled tokens' log probs wanted, k top log probs per token)."""
    if is_chat:
        wanted = body.get("logprobs") is not None and _boolean("logprobs", body["logprobs"])
        top = body.get("top_logprobs")
        if top is not None:
            top = _integer("top_logprobs", top, 0, 20)
            if not wanted:
                raise bad("top_logprobs", "needs logprobs: true")
        return wanted, top or 0
    if body.get("logprobs") is None:
        return False, 0
    return True, _integer("logprobs", body["logprobs"], 0, 5)


def _max_tokens(body: dict, is_chat: bool, prompts: list[list[int]], info: ModelInfo) -> tuple[int, ...]:
    field = "max_completion_tokens" if is_chat and body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(field)
    if value is not None or not is_chat:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if value is None else _integer(field, value, 1, (1 << 31) - 1)
        longest = max(len(p) for p in prompts)
        if longest + max_tokens > info.max_seq_len:   # the engine would clamp it; OpenAI refuses
            raise bad(field, f"{max_tokens} with a prompt of {longest} tokens exceeds the model's context of "
                             f"{info.max_seq_len} tokens")
        return (max_tokens,) * len(prompts)
    room = info.max_seq_len - len(prompts[0])   # what the context has left
    if room < 1:
        raise bad("messages", f"the rendered conversation has {len(prompts[0])} tokens, the model's context "
                              f"{info.max_seq_len}: no room for a reply")
    return (room,)


def _prompts(value, info: ModelInfo) -> list[list[int]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of such lists."""
    def encode(field: str, text) -> list[int]:
        if isinstance(text, str):
            check_num_chars(field, "", len(text), info)
        ids = list(info.tokenizer.encode(text_field(field, text), add_special_tokens=True))
        if not ids:
            raise bad(field, "the text has no tokens")
        return ids

    def token_ids(field: str, ids) -> list[int]:
        if not ids:
            raise bad(field, "empty prompt")
        if len(ids) > info.max_seq_len:   # before checking each id
            raise bad(field, f"{len(ids)} token ids, more than the model's context of {info.max_seq_len} tokens")
        for i, t in enumerate(ids):
            _integer(f"{field}[{i}]", t, 0, info.vocab_size - 1)
        return ids

    if isinstance(value, str):
        return [encode("prompt", value)]
    if not isinstance(value, list) or not value:
        raise bad("prompt", f"expected a string, token ids, or a non-empty list of either, got {short_repr(value)}")
    if all(isinstance(v, str) for v in value):
        return [encode(f"prompt[{i}]", v) for i, v in enumerate(value)]
    if all(isinstance(v, list) for v in value):
        return [token_ids(f"prompt[{i}]", v) for i, v in enumerate(value)]
    return [token_ids("prompt", value)]


def _router_fields(body: dict, is_chat: bool) -> None:
    for field, only in (ROUTER_CHAT_DEFAULTS if is_chat else ROUTER_DEFAULTS).items():
        if field in body and _boolean(field, body[field]) != only:
            raise bad(field, f"not supported (only {str(only).lower()})")
    for field in REASONING_FIELDS & set(body):
        _boolean(field, body[field])


def parse_request(body, is_chat: bool, info: ModelInfo, adapter_names: frozenset[str] = frozenset()) -> CompletionSpec:
    """Check an OpenAI request body; raise OpenAIError (400 naming the field, 404 for another model).
    adapter_names: the loaded LoRA adapters, which `model` may name too."""
    if not isinstance(body, dict):
        raise bad("body", f"expected a JSON object, got {type(body).__name__}")
    accepted = CHAT_FIELDS | set(ROUTER_CHAT_DEFAULTS) | REASONING_FIELDS if is_chat \
        else COMPLETION_FIELDS | set(ROUTER_DEFAULTS)
    unknown = set(body) - accepted
    if unknown:
        raise bad(min(unknown), f"unknown field; accepted: {sorted(accepted)}")
    _router_fields(body, is_chat)
    model = text_field("model", body.get("model"))
    if model != info.name and model not in adapter_names:
        raise OpenAIError(404, f"model: {short_repr(model)} is not served here; this server serves {info.name!r}",
                          "model", "model_not_found")
    n = _integer("n", body.get("n", 1), 1, MAX_CHOICES)
    _refuse_unsupported(body, n)
    if body.get("user") is not None:
        text_field("user", body["user"])
    stream = _boolean("stream", body.get("stream", False))
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad("stream_options", "only allowed with stream: true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad("stream_options", f"expected {{\"include_usage\": bool}}, got {short_repr(options)}")
    include_usage = _boolean("stream_options.include_usage", (options or {}).get("include_usage", False))
    tools = parse_tools(body, info) if is_chat else None
    echo = not is_chat and _boolean("echo", body.get("echo", False))
    if is_chat:
        prompts = [render_chat(parse_messages(body.get("messages")), info, tools)]
    else:
        if "prompt" not in body:
            raise bad("prompt", "required")
        prompts = _prompts(body["prompt"], info)
    if n * len(prompts) > MAX_CHOICES:
        raise bad("n", f"{n} choices for each of {len(prompts)} prompts: more than {MAX_CHOICES} in all")
    seed = body.get("seed")
    if seed is not None:
        seed = _integer("seed", seed, -(1 << 63), (1 << 64) - 1)
    else:   # the engine's default seed is fixed: unseeded requests would all sample alike
        seed = secrets.randbits(64)
    return CompletionSpec(is_chat, tuple(map(tuple, prompts)), n, _max_tokens(body, is_chat, prompts, info), stream,
                          include_usage, _stop(body.get("stop")), *_log_probs(body, is_chat), seed,
                          _sampling(body, info), _echo_texts(prompts, info) if echo else (), tools,
                          tool_grammar(tools) if tools is not None else None,
                          model if model != info.name else None)


def _echo_texts(prompts: list[list[int]], info: ModelInfo) -> tuple[str, ...]:
    return tuple(info.tokenizer.decode(p, skip_special_tokens=True) for p in prompts)


def engine_field_to_openai(message: str, is_chat: bool) -> tuple[str, str]:
    """(OpenAI field, message) for an error the sample's request path raised naming its own field
    ("max_new_tokens: ..."): the field renamed to the one the client sent."""
    field, sep, rest = message.partition(": ")
    if not sep:
        return "body", message
    base = field.split("[")[0]
    if base == "input_ids":
        name = "messages" if is_chat else "prompt"
    else:
        name = ENGINE_TO_OPENAI.get(base, base)
    return name, f"{name}: {rest}"
