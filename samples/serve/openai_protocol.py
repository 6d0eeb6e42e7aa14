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

import functools
import math
import secrets
from dataclasses import dataclass

from samples.serve.token_bytes import TokenBytes
from samples.serve.tool_calls import (ToolCallFormat, ToolChoice, ToolError, parse_tool_choice,
                                      tool_conversation, tool_grammar)
from samples.serve.value_repr import short_repr, some_sorted

TYPE_OF_STATUS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                  413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's; chat's default is what the context has left
MAX_CHOICES = 128                     # n times the number of prompts
MAX_STOP_STRINGS = 16
# NOTE: a generous bound on the characters of one token: text longer than the context times this
# cannot fit the context whatever the tokenizer, so it is refused before tokenizing (which would
# hold the GIL for the id list) rather than after; natural text averages ~4 characters a token.
MAX_CHARS_PER_TOKEN = 64
MAX_ID_DIGITS = 20                    # a logit_bias key longer than any uint64 is no token id

COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options",
                 "presence_penalty", "frequency_penalty", "logit_bias", "user", "logprobs",
                 "top_k", "min_tokens", "repetition_penalty", "ignore_eos"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                               "tool_choice", "functions", "function_call", "parallel_tool_calls"}
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}
# What vllm-router adds to each request it forwards (vLLM's and SGLang's extensions), accepted with
# the value it sends, which is this server's behaviour; another value is refused by name.
ROUTER_DEFAULTS = {"no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False}
ROUTER_CHAT_DEFAULTS = {**ROUTER_DEFAULTS, "continue_final_message": False}
REASONING_FIELDS = {"separate_reasoning", "stream_reasoning", "include_reasoning"}   # no reasoning parser: any bool


class OpenAIError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s   # a refusal for load (429): when to try again

    @property
    def headers(self) -> dict[str, str]:
        """Retry-After (whole seconds, at least 1) on a 429."""
        if self.status != 429:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s or 1)))}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPE_OF_STATUS.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def bad(field: str, problem: str) -> OpenAIError:
    return OpenAIError(400, f"{field}: {problem}", field)


@dataclass(frozen=True)
class ModelInfo:
    """What the handlers need to know of the served model and its tokenizer."""
    name: str                  # the `model` clients must send
    tokenizer: object          # a transformers tokenizer
    vocab_size: int            # the engine's (logit_bias ids are checked against it)
    max_seq_len: int           # prompt + generated tokens, the engine's limit
    end_id: int | None         # the first end id (generation config, else the tokenizer's), inside the vocabulary
    other_end_ids: tuple[int, ...] = ()   # the generation config's other end ids (stop words of one token)
    can_guide: bool = False    # the engine has a grammar compiler (tools need it)
    tool_format: ToolCallFormat = ToolCallFormat("generic", False, False)   # from the chat template

    @functools.cached_property
    def token_bytes(self) -> TokenBytes:
        return TokenBytes(self.tokenizer)

    @property
    def max_text_chars(self) -> int:
        """The most characters a prompt (or a rendered conversation) may have before tokenizing."""
        return self.max_seq_len * MAX_CHARS_PER_TOKEN


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


def _text(field: str, value) -> str:
    if not isinstance(value, str):
        raise bad(field, f"expected a string, got {short_repr(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:   # a lone surrogate ("\ud800" in the JSON)
        raise bad(field, f"not valid Unicode text ({e.reason} at index {e.start})") from None
    return value


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS:
        raise bad("stop", f"expected a string or a list of at most {MAX_STOP_STRINGS} strings, got {short_repr(value)}")
    for i, stop in enumerate(stops):
        if not _text(f"stop[{i}]" if isinstance(value, list) else "stop", stop):
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


def _check_num_chars(field: str, what: str, num_chars: int, info: ModelInfo) -> None:
    if num_chars > info.max_text_chars:
        raise bad(field, f"{num_chars} characters{what}, more than this server's limit of {info.max_text_chars} "
                         f"({MAX_CHARS_PER_TOKEN} per token of the model's context of {info.max_seq_len} tokens)")


def _prompts(value, info: ModelInfo) -> list[list[int]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of such lists."""
    def encode(field: str, text) -> list[int]:
        if isinstance(text, str):
            _check_num_chars(field, "", len(text), info)
        ids = list(info.tokenizer.encode(_text(field, text), add_special_tokens=True))
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


def _messages(value) -> list[dict]:
    """Chat messages with text content -> the conversation the chat template renders. Assistant
    messages may carry `tool_calls` (content then may be null); `tool` messages a tool_call_id."""
    if not isinstance(value, list) or not value:
        raise bad("messages", f"expected a non-empty list of messages, got {short_repr(value)}")
    conversation = []
    for i, message in enumerate(value):
        field = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(field, f"expected an object with role and content, got {short_repr(message)}")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:   # a list is unhashable
            raise bad(f"{field}.role", f"expected one of {sorted(CHAT_ROLES)}, got {short_repr(role, 40)}")
        allowed = {"role", "content", "name"} | {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}.get(role, set())
        unknown = set(message) - allowed
        if unknown:
            raise bad(field, f"unsupported keys {short_repr(some_sorted(unknown), 120)} (a {role} message has "
                             f"{', '.join(sorted(allowed))})")
        out = {"role": role}
        calls = message.get("tool_calls")
        if calls is not None:
            out["tool_calls"] = _tool_calls(f"{field}.tool_calls", calls)
        content = message.get("content")
        out["content"] = "" if content is None and calls else _content(f"{field}.content", content)
        if "name" in message:
            out["name"] = _text(f"{field}.name", message["name"])
        if role == "tool":
            out["tool_call_id"] = _text(f"{field}.tool_call_id", message.get("tool_call_id"))
        conversation.append(out)
    return conversation


def _content(field: str, content) -> str:
    """A string, or text parts (joined)."""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or set(part) != {"type", "text"}:
                raise bad(f"{field}[{j}]", f"only {{\"type\": \"text\", \"text\": ...}} parts are supported, "
                                          f"got {short_repr(part)}")
            texts.append(_text(f"{field}[{j}].text", part["text"]))
        return "".join(texts)
    return _text(field, content)


def _tool_calls(field: str, calls) -> list[dict]:
    """An assistant's earlier calls: [{"id", "type": "function", "function": {"name", "arguments"}}]."""
    if not isinstance(calls, list) or not calls:
        raise bad(field, f"expected a non-empty list of tool calls, got {short_repr(calls)}")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise bad(f"{field}[{j}]", f"expected {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                                       f"\"arguments\"}}}}, got {short_repr(call)}")
        out.append({"id": _text(f"{field}[{j}].id", call.get("id", "")), "type": "function",
                    "function": {"name": _text(f"{field}[{j}].function.name", function.get("name")),
                                 "arguments": _text(f"{field}[{j}].function.arguments",
                                                    function.get("arguments", "{}"))}})
    return out


def render_chat(conversation: list[dict], info: ModelInfo, tools: ToolChoice | None = None) -> list[int]:
    """The tokenizer's own chat template (tokenizer_config.json's chat_template), rendered with the
    assistant's generation prompt; its text is tokenized without adding special tokens (the
    template writes them). Tools, earlier calls and tool results go in as `tool_calls.tool_conversation`
    says. Contents and names, then the rendered text, are bounded by info.max_text_chars first."""
    tokenizer = info.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise bad("messages", "the tokenizer has no chat template (tokenizer_config.json: chat_template)")
    num_chars = sum(len(m["content"]) + len(m.get("name", "")) + sum(
        len(c["function"]["arguments"]) + len(c["function"]["name"]) for c in m.get("tool_calls", ()))
        for m in conversation)
    _check_num_chars("messages", " of content and names", num_chars, info)
    fmt = info.tool_format
    messages = tool_conversation(conversation, tools, fmt)
    extra = {"tools": [f.openai() for f in tools.functions]} if tools is not None and fmt.renders_tools else {}
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
    except Exception as e:   # the template's own raise_exception (roles must alternate, ...) or a Jinja error
        raise bad("messages", f"the chat template refused the conversation: {e}") from None
    _check_num_chars("messages", " in the rendered conversation", len(text), info)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _router_fields(body: dict, is_chat: bool) -> None:
    for field, only in (ROUTER_CHAT_DEFAULTS if is_chat else ROUTER_DEFAULTS).items():
        if field in body and _boolean(field, body[field]) != only:
            raise bad(field, f"not supported (only {str(only).lower()})")
    for field in REASONING_FIELDS & set(body):
        _boolean(field, body[field])


def parse_request(body, is_chat: bool, info: ModelInfo) -> CompletionSpec:
    """Check an OpenAI request body; raise OpenAIError (400 naming the field, 404 for another model)."""
    if not isinstance(body, dict):
        raise bad("body", f"expected a JSON object, got {type(body).__name__}")
    accepted = CHAT_FIELDS | set(ROUTER_CHAT_DEFAULTS) | REASONING_FIELDS if is_chat \
        else COMPLETION_FIELDS | set(ROUTER_DEFAULTS)
    unknown = set(body) - accepted
    if unknown:
        raise bad(min(unknown), f"unknown field; accepted: {sorted(accepted)}")
    _router_fields(body, is_chat)
    model = _text("model", body.get("model"))
    if model != info.name:
        raise OpenAIError(404, f"model: {short_repr(model)} is not served here; this server serves {info.name!r}",
                          "model", "model_not_found")
    n = _integer("n", body.get("n", 1), 1, MAX_CHOICES)
    _refuse_unsupported(body, n)
    if body.get("user") is not None:
        _text("user", body["user"])
    stream = _boolean("stream", body.get("stream", False))
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad("stream_options", "only allowed with stream: true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad("stream_options", f"expected {{\"include_usage\": bool}}, got {short_repr(options)}")
    include_usage = _boolean("stream_options.include_usage", (options or {}).get("include_usage", False))
    tools = _tools(body, info) if is_chat else None
    echo = not is_chat and _boolean("echo", body.get("echo", False))
    if is_chat:
        prompts = [render_chat(_messages(body.get("messages")), info, tools)]
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
                          tool_grammar(tools) if tools is not None else None)


def _echo_texts(prompts: list[list[int]], info: ModelInfo) -> tuple[str, ...]:
    return tuple(info.tokenizer.decode(p, skip_special_tokens=True) for p in prompts)


def _tools(body: dict, info: ModelInfo) -> ToolChoice | None:
    try:
        tools = parse_tool_choice(body)
    except ToolError as e:
        raise bad(e.field, e.problem) from None
    if tools is not None and tools.parses_calls and not info.can_guide:
        raise bad("tools", "tool calls need the grammar engine, which this server runs without (the tokenizer has "
                           "no tokenizer.json, or one the grammar engine cannot use: see the server's log)")
    return tools


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
