"""The HTTP request body of samples.serve -> `GenerateParams`, plain values that either engine
door builds its request from: GptManager's InferenceRequest tensors (`to_inference_request`) or
the Executor's Request (`to_executor_request`). Checks JSON types and that each value fits the
engines' dtypes here, before anything is queued (a ValueError naming the field and the value: a
400); values are checked by the engine's own validation, whose error the server also returns as a
400, led by the body field it names (`name_body_field`). Text to tokenize is refused past
`max_text_chars` characters before tokenizing; the server parses off its event loop."""
from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass

import torch

from batch_manager import InferenceRequest, tensor_names as tn
from batch_manager.executor import LoraConfig, OutputConfig, Request, SamplingConfig
from runtime.decoding import to_word_list
from runtime.decoding.fields import BY_PARAM, SAMPLING_FIELDS
from samples.serve.value_repr import short_repr, some_sorted

# body field -> (wire tensor name, kind, torch dtype): the sampling settings of the field table
# (runtime.decoding.fields; the seed is int64, as GptManager's random_seed), then the request's own.
SCALAR_FIELDS = {
    **{f.body: (f.tensor, f.kind, torch.int64 if f.param == "random_seed" else
                torch.int32 if f.kind == "int" else torch.float32) for f in SAMPLING_FIELDS if f.body is not None},
    "end_id": (tn.END_ID, "int", torch.int32),
    "pad_id": (tn.PAD_ID, "int", torch.int32),
    "return_log_probs": (tn.RETURN_LOG_PROBS, "bool", torch.bool),
}
WORD_LIST_FIELDS = {"stop_words": tn.STOP_WORDS_LIST, "bad_words": tn.BAD_WORDS_LIST}
OTHER_FIELDS = {"input_ids", "text", "max_new_tokens", "stream", "embedding_bias"}
ALL_FIELDS = frozenset(SCALAR_FIELDS) | frozenset(WORD_LIST_FIELDS) | OTHER_FIELDS
# wire tensor name -> body field, to name the field in GptManager's errors
WIRE_TO_FIELD = {name: field for field, (name, _, _) in SCALAR_FIELDS.items()} | {
    name: field for field, name in WORD_LIST_FIELDS.items()} | {
    tn.INPUT_IDS: "input_ids", tn.MAX_NEW_TOKENS: "max_new_tokens", tn.EMBEDDING_BIAS: "embedding_bias"}

INT_RANGES = {torch.int32: (-(1 << 31), (1 << 31) - 1), torch.int64: (-(1 << 63), (1 << 63) - 1)}
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)   # int64 or uint64, as GptManager's random_seed
FLOAT32_MAX = 3.4028234663852886e38
ADMISSION_ERROR_PREFIX = "Cannot process new request: "   # GptManager's (samples.serve.bridge)

Words = tuple[tuple[int, ...], ...]   # words, each its token ids


@dataclass(frozen=True)
class GenerateParams:
    input_ids: tuple[int, ...]           # int32 token ids
    max_new_tokens: int
    is_streaming: bool = False
    # (DecodingParams field, value) per sampling field the body set (SAMPLING_FIELDS' `param`):
    # floats rounded to float32, as both engines hold them; the seed as uint64
    sampling: tuple[tuple[str, int | float], ...] = ()
    end_id: int | None = None
    pad_id: int | None = None
    return_log_probs: bool = False
    stop_words: Words | None = None
    bad_words: Words | None = None
    embedding_bias: tuple[float, ...] | None = None   # one per vocabulary entry (float32 values)
    # Set by the OpenAI endpoints, not the /generate body: n samples of the prompt in one request,
    # and a grammar (batch_manager.GuidedDecodingParams) the output is held to.
    num_return_sequences: int = 1
    guided_decoding_params: object = None
    # Set by the OpenAI endpoints for a `model` naming a loaded LoRA adapter (lora_routes.LoadedAdapter:
    # task_id, weights, config), sent with every request
    lora: object = None

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """GptManager's request tensors: wire name -> tensor (the seed as int64: the uint64's two's
        complement, which GptManager reads back as the same uint64)."""
        tensors = {tn.INPUT_IDS: torch.tensor(self.input_ids, dtype=torch.int32),
                   tn.MAX_NEW_TOKENS: torch.tensor([[self.max_new_tokens]], dtype=torch.int32)}
        scalars = {BY_PARAM[param].body: value for param, value in self.sampling} | {   # body field -> value
            "end_id": self.end_id, "pad_id": self.pad_id, "return_log_probs": self.return_log_probs or None}
        for field, value in scalars.items():
            name, _, dtype = SCALAR_FIELDS[field]
            if field == "seed" and value >= 1 << 63:
                value -= 1 << 64
            if value is not None:
                tensors[name] = torch.tensor([value], dtype=dtype)
        for field, name in WORD_LIST_FIELDS.items():
            if getattr(self, field) is not None:
                tensors[name] = to_word_list(getattr(self, field))[None]   # int32 [1, 2, L], the legacy format
        if self.embedding_bias is not None:
            tensors[tn.EMBEDDING_BIAS] = torch.tensor([self.embedding_bias], dtype=torch.float32)
        if self.num_return_sequences > 1:
            tensors[tn.NUM_RETURN_SEQUENCES] = torch.tensor([[self.num_return_sequences]], dtype=torch.int32)
        if self.lora is not None:
            tensors[tn.LORA_TASK_ID] = torch.tensor([self.lora.task_id], dtype=torch.uint64)
            tensors[tn.LORA_WEIGHTS], tensors[tn.LORA_CONFIG] = self.lora.weights, self.lora.config
        return tensors

    def to_inference_request(self, request_id: int) -> InferenceRequest:
        """For --api gpt_manager. Cannot fail: every value was range-checked by parse_generate_body."""
        r = InferenceRequest(request_id, self.tensors)
        r.is_streaming, r.guided_decoding_params = self.is_streaming, self.guided_decoding_params
        return r

    def to_executor_request(self, request_id: int = 0) -> Request:
        """For --api executor (request_id unused: the Executor numbers its requests)."""
        sampling, output = {}, {"return_log_probs": self.return_log_probs, "exclude_input_from_output": True}
        for param, value in self.sampling:   # SamplingConfig's attributes, or OutputConfig's ("output_config.x")
            executor = BY_PARAM[param].executor
            (output if "." in executor else sampling)[executor.removeprefix("output_config.")] = value
        if self.num_return_sequences > 1:
            sampling["num_return_sequences"] = self.num_return_sequences
        words = {field: None if getattr(self, field) is None else [list(w) for w in getattr(self, field)]
                 for field in WORD_LIST_FIELDS}
        bias = None if self.embedding_bias is None else torch.tensor(self.embedding_bias, dtype=torch.float32)
        return Request(list(self.input_ids), self.max_new_tokens, streaming=self.is_streaming,
                       sampling_config=SamplingConfig(**sampling), output_config=OutputConfig(**output),
                       end_id=self.end_id, pad_id=self.pad_id, embedding_bias=bias,
                       guided_decoding_params=self.guided_decoding_params, **words,
                       lora_config=None if self.lora is None else LoraConfig(self.lora.task_id, self.lora.weights,
                                                                              self.lora.config))


def _int(field: str, value, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{field}: expected an integer, got {short_repr(value)}")
    if not low <= value <= high:
        raise ValueError(f"{field}: {short_repr(value)} outside [{low}, {high}]")
    return value


def _float(field: str, value) -> float:
    """A JSON number that a float32 holds (finite, |x| <= FLOAT32_MAX), rounded to that float32."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{field}: expected a number, got {short_repr(value)}")
    if isinstance(value, int) and abs(value) > FLOAT32_MAX:   # float(10**400) would raise OverflowError
        raise ValueError(f"{field}: {short_repr(value)} outside the float32 range")
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise ValueError(f"{field}: must be a finite float32 number, got {value!r}")
    return struct.unpack("f", struct.pack("f", value))[0]


def _text(field: str, value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:   # a lone surrogate (JSON "\ud800")
        raise ValueError(f"{field}: not valid Unicode text ({e.reason} at index {e.start})") from None
    return value


def _token_ids(field: str, value, tokenizer, max_text_chars: int | None = None) -> list[int]:
    """A list of int32 token ids, or a string (of at most max_text_chars) when a tokenizer is loaded."""
    if isinstance(value, str):
        if tokenizer is None:
            raise ValueError(f"{field}: text needs a tokenizer (start the server with --tokenizer DIR)")
        if max_text_chars is not None and len(value) > max_text_chars:
            raise ValueError(f"{field}: {len(value)} characters, more than this server's limit of {max_text_chars} "
                             f"(a multiple of the model's context)")
        return list(tokenizer.encode(_text(field, value), add_special_tokens=False))
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"{field}: expected a list of integer token ids, got {short_repr(value)}")
    low, high = INT_RANGES[torch.int32]
    for token in value:
        if not low <= token <= high:
            raise ValueError(f"{field}: token id {short_repr(token)} outside the int32 range [{low}, {high}]")
    return value


def _words(field: str, words, tokenizer, max_text_chars: int | None = None) -> Words:
    """[[ids...], ...] (or strings with a tokenizer) -> the words' token ids."""
    if not isinstance(words, list) or not words:
        raise ValueError(f"{field}: expected a non-empty list of words (token-id lists or strings), "
                         f"got {short_repr(words)}")
    ids = []
    for i, word in enumerate(words):
        ids.append(tuple(_token_ids(f"{field}[{i}]", word, tokenizer, max_text_chars)))
        if not ids[-1]:
            raise ValueError(f"{field}[{i}]: empty word")
    return tuple(ids)


def _scalar(field: str, kind: str, dtype: torch.dtype, value) -> int | float | bool:
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{field}: expected true or false, got {short_repr(value)}")
        return value
    if field == "seed":   # int64 or uint64: kept as the uint64 (an int64's two's complement)
        return _int(field, value, *SEED_RANGE) % (1 << 64)
    return _int(field, value, *INT_RANGES[dtype]) if kind == "int" else _float(field, value)


def _prompt(body: dict, tokenizer, max_text_chars: int | None) -> list[int]:
    if ("input_ids" in body) == ("text" in body):
        raise ValueError("input_ids / text: give exactly one of them")
    if "text" in body:
        if not isinstance(body["text"], str):
            raise ValueError(f"text: expected a string, got {short_repr(body['text'])}")
        return _token_ids("text", body["text"], tokenizer, max_text_chars)
    return _token_ids("input_ids", body["input_ids"], None)


def _embedding_bias(bias) -> tuple[float, ...]:
    if not isinstance(bias, list):
        raise ValueError(f"embedding_bias: expected a list of numbers (one per vocabulary entry), "
                         f"got {short_repr(bias)}")
    return tuple(_float(f"embedding_bias[{i}]", b) for i, b in enumerate(bias))


def parse_generate_body(body, tokenizer=None, default_max_new_tokens: int = 64,
                        max_text_chars: int | None = None) -> GenerateParams:
    """Check the JSON body's fields, types and dtype ranges; raise ValueError(field: problem) for a 400.
    max_text_chars bounds each text to tokenize (None: unbounded)."""
    if not isinstance(body, dict):
        raise ValueError(f"body: expected a JSON object, got {type(body).__name__}")
    unknown = set(body) - ALL_FIELDS
    if unknown:
        raise ValueError(f"body: unknown fields {short_repr(some_sorted(unknown), 200)}; "
                         f"accepted: {sorted(ALL_FIELDS)}")
    input_ids = tuple(_prompt(body, tokenizer, max_text_chars))
    max_new_tokens = _int("max_new_tokens", body.get("max_new_tokens", default_max_new_tokens),
                          *INT_RANGES[torch.int32])
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ValueError(f"stream: expected true or false, got {short_repr(stream)}")
    scalars = {field: _scalar(field, kind, dtype, body[field])
               for field, (_, kind, dtype) in SCALAR_FIELDS.items() if field in body}
    words = {field: _words(field, body[field], tokenizer, max_text_chars) if field in body else None
             for field in WORD_LIST_FIELDS}
    bias = _embedding_bias(body["embedding_bias"]) if "embedding_bias" in body else None
    return GenerateParams(input_ids, max_new_tokens, stream,
                          tuple((f.param, scalars[f.body]) for f in SAMPLING_FIELDS if f.body in scalars),
                          scalars.get("end_id"), scalars.get("pad_id"), scalars.get("return_log_probs", False),
                          embedding_bias=bias, **words)


def name_body_field(manager_error: str) -> str:
    """Lead GptManager's admission error ("...: <wire name>: problem") with the body field it names;
    an error naming no body field loses the admission prefix, so it leads with the engine's own
    field name (as the Executor's errors do)."""
    for part in manager_error.split(": ")[1:]:
        field = WIRE_TO_FIELD.get(part)
        if field is not None:
            return f"{field}: {manager_error}"
    return re.sub(r"^request \d+: ", "", manager_error.removeprefix(ADMISSION_ERROR_PREFIX))
