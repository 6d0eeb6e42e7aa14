"""The HTTP request body of samples.serve -> an InferenceRequest's tensors. Checks JSON types
here (a ValueError naming the field and the value: a 400); values are checked by GptManager's
own validation, whose error message the server also returns as a 400."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batch_manager import InferenceRequest, tensor_names as tn
from runtime.decoding import to_word_list

# body field -> (wire tensor name, kind, torch dtype)
SCALAR_FIELDS = {
    "end_id": (tn.END_ID, "int", torch.int32),
    "pad_id": (tn.PAD_ID, "int", torch.int32),
    "beam_width": (tn.BEAM_WIDTH, "int", torch.int32),
    "temperature": (tn.TEMPERATURE, "float", torch.float32),
    "top_k": (tn.RUNTIME_TOP_K, "int", torch.int32),
    "top_p": (tn.RUNTIME_TOP_P, "float", torch.float32),
    "seed": (tn.RANDOM_SEED, "int", torch.int64),
    "min_length": (tn.MIN_LENGTH, "int", torch.int32),
    "repetition_penalty": (tn.REPETITION_PENALTY, "float", torch.float32),
    "presence_penalty": (tn.PRESENCE_PENALTY, "float", torch.float32),
    "frequency_penalty": (tn.FREQUENCY_PENALTY, "float", torch.float32),
    "length_penalty": (tn.LENGTH_PENALTY, "float", torch.float32),
    "early_stopping": (tn.EARLY_STOPPING, "int", torch.int32),
    "no_repeat_ngram_size": (tn.NO_REPEAT_NGRAM_SIZE, "int", torch.int32),
    "return_log_probs": (tn.RETURN_LOG_PROBS, "bool", torch.bool),
}
WORD_LIST_FIELDS = {"stop_words": tn.STOP_WORDS_LIST, "bad_words": tn.BAD_WORDS_LIST}
OTHER_FIELDS = {"input_ids", "text", "max_new_tokens", "stream", "embedding_bias"}
ALL_FIELDS = frozenset(SCALAR_FIELDS) | frozenset(WORD_LIST_FIELDS) | OTHER_FIELDS


@dataclass
class GenerateParams:
    input_ids: list[int]
    max_new_tokens: int
    is_streaming: bool
    return_log_probs: bool
    tensors: dict[str, torch.Tensor]  # wire name -> tensor, everything but input_ids / request_output_len

    def to_request(self, request_id: int) -> InferenceRequest:
        r = InferenceRequest(request_id)
        r.input_ids = torch.tensor(self.input_ids, dtype=torch.int32)
        r.max_new_tokens = torch.tensor([[self.max_new_tokens]], dtype=torch.int32)
        r.is_streaming = self.is_streaming
        for name, tensor in self.tensors.items():
            r.emplace_input_tensor(name, tensor)
        return r


def _int(field: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{field}: expected an integer, got {value!r}")
    return value


def _token_ids(field: str, value, tokenizer) -> list[int]:
    """A list of token ids, or a string when a tokenizer is loaded."""
    if isinstance(value, str):
        if tokenizer is None:
            raise ValueError(f"{field}: text needs a tokenizer (start the server with --tokenizer DIR)")
        return list(tokenizer.encode(value, add_special_tokens=False))
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"{field}: expected a list of integer token ids, got {value!r:.80}")
    return value


def word_list(field: str, words, tokenizer) -> torch.Tensor:
    """[[ids...], ...] (or strings with a tokenizer) -> int32 [1, 2, L]: row 0 the concatenated
    tokens, row 1 the inclusive prefix sums of the word lengths, padded with -1 (the legacy format)."""
    if not isinstance(words, list) or not words:
        raise ValueError(f"{field}: expected a non-empty list of words (token-id lists or strings), got {words!r:.80}")
    ids = []
    for i, word in enumerate(words):
        ids.append(_token_ids(f"{field}[{i}]", word, tokenizer))
        if not ids[-1]:
            raise ValueError(f"{field}[{i}]: empty word")
    return to_word_list(ids)[None]


def _scalar(field: str, kind: str, dtype: torch.dtype, value) -> torch.Tensor:
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{field}: expected true or false, got {value!r}")
    elif kind == "int":
        value = _int(field, value)
    elif not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{field}: expected a number, got {value!r}")
    return torch.tensor([value], dtype=dtype)


def parse_generate_body(body, tokenizer=None, default_max_new_tokens: int = 64) -> GenerateParams:
    """Check the JSON body's fields and types; raise ValueError(field: problem) for a 400."""
    if not isinstance(body, dict):
        raise ValueError(f"body: expected a JSON object, got {type(body).__name__}")
    unknown = set(body) - ALL_FIELDS
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}; accepted: {sorted(ALL_FIELDS)}")
    if ("input_ids" in body) == ("text" in body):
        raise ValueError("input_ids / text: give exactly one of them")
    if "text" in body:
        if not isinstance(body["text"], str):
            raise ValueError(f"text: expected a string, got {body['text']!r:.80}")
        input_ids = _token_ids("text", body["text"], tokenizer)
    else:
        input_ids = _token_ids("input_ids", body["input_ids"], None)
    max_new_tokens = _int("max_new_tokens", body.get("max_new_tokens", default_max_new_tokens))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ValueError(f"stream: expected true or false, got {stream!r}")
    tensors = {}
    for field, (name, kind, dtype) in SCALAR_FIELDS.items():
        if field in body:
            tensors[name] = _scalar(field, kind, dtype, body[field])
    for field, name in WORD_LIST_FIELDS.items():
        if field in body:
            tensors[name] = word_list(field, body[field], tokenizer)
    if "embedding_bias" in body:
        bias = body["embedding_bias"]
        if not isinstance(bias, list) or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bias):
            raise ValueError(f"embedding_bias: expected a list of numbers (one per vocabulary entry), got {bias!r:.80}")
        tensors[tn.EMBEDDING_BIAS] = torch.tensor([bias], dtype=torch.float32)
    return GenerateParams(input_ids, max_new_tokens, stream, bool(body.get("return_log_probs", False)), tensors)
