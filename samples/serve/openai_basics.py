"""What the OpenAI endpoints of samples.serve share: errors in OpenAI's shape (`OpenAIError`,
`bad`), the served model as the handlers see it (`ModelInfo`), and the checks of a text field."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from samples.serve.token_bytes import TokenBytes
from samples.serve.tool_calls import ToolCallFormat
from samples.serve.value_repr import short_repr

TYPE_OF_STATUS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                  413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}
# NOTE: a generous bound on the characters of one token: text longer than the context times this
# cannot fit the context whatever the tokenizer, so it is refused before tokenizing (which would
# hold the GIL for the id list) rather than after; natural text averages ~4 characters a token.
MAX_CHARS_PER_TOKEN = 64
MAX_SAMPLES_PER_REQUEST = 64   # the engine's bound on num_return_sequences (runtime.decoding.params)


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
    # the most samples one engine request may hold (num_return_sequences: 64, and the engine's
    # max_batch_size); more choices of a prompt are split over several requests
    max_samples_per_request: int = MAX_SAMPLES_PER_REQUEST

    @functools.cached_property
    def token_bytes(self) -> TokenBytes:
        return TokenBytes(self.tokenizer)

    @functools.cached_property
    def grammar_checker(self):
        """The server's own grammar compiler (runtime.decoding.guided.GrammarCompiler) over the
        tokenizer's tokenizer.json, which compiles the tools' schemas before a request is queued;
        None without the grammar engine. Built on first use."""
        if not self.can_guide:
            return None
        from runtime.decoding.guided import GrammarCompiler, make_tokenizer
        stops = [t for t in (self.end_id, *self.other_end_ids) if t is not None] or None
        return GrammarCompiler(make_tokenizer(self.tokenizer.backend_tokenizer.to_str(), self.vocab_size, stops), stops)

    @property
    def max_text_chars(self) -> int:
        """The most characters a prompt (or a rendered conversation) may have before tokenizing."""
        return self.max_seq_len * MAX_CHARS_PER_TOKEN


def text_field(field: str, value) -> str:
    if not isinstance(value, str):
        raise bad(field, f"expected a string, got {short_repr(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:   # a lone surrogate ("\ud800" in the JSON)
        raise bad(field, f"not valid Unicode text ({e.reason} at index {e.start})") from None
    return value


def check_num_chars(field: str, what: str, num_chars: int, info: ModelInfo) -> None:
    if num_chars > info.max_text_chars:
        raise bad(field, f"{num_chars} characters{what}, more than this server's limit of {info.max_text_chars} "
                         f"({MAX_CHARS_PER_TOKEN} per token of the model's context of {info.max_seq_len} tokens)")
