"""samples.serve's request bodies without a server (openai_protocol.parse_request, params.parse_generate_body):
text is bounded by characters before it is tokenized, and every client value Python cannot convert
or show (a 5,000-digit logit_bias key, NaN, infinities, huge integers, bools for numbers, values nested
thousands deep) is a 400 naming its field, never another exception."""
from __future__ import annotations

import re
import time

import pytest

from samples.serve.openai_basics import MAX_CHARS_PER_TOKEN, ModelInfo, OpenAIError
from samples.serve.openai_protocol import parse_request
from samples.serve.params import parse_generate_body
from samples.serve.value_repr import short_repr, some_sorted
from tests.samples.scripted_model import VOCAB_SIZE, write_tokenizer

MAX_SEQ_LEN = 64
MAX_TEXT_CHARS = MAX_SEQ_LEN * MAX_CHARS_PER_TOKEN


@pytest.fixture(scope="module")
def info(tmp_path_factory):
    import transformers
    directory = str(tmp_path_factory.mktemp("bpe"))
    write_tokenizer(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return ModelInfo("m", tokenizer, VOCAB_SIZE, MAX_SEQ_LEN, tokenizer.eos_token_id)


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def refusal(info: ModelInfo, fields: dict, is_chat: bool = False) -> OpenAIError:
    body = {"model": "m", **({"messages": [{"role": "user", "content": "hi"}]} if is_chat else {"prompt": "Say:"}),
            "max_tokens": 2, **fields}
    with pytest.raises(OpenAIError) as e:
        parse_request(body, is_chat, info)
    assert e.value.status == 400 and e.value.message.startswith(e.value.param + ": "), e.value.message
    return e.value


def text(num_chars: int) -> str:
    return ("Hello world " * (num_chars // 12 + 1))[:num_chars]


# -- text bounded before tokenizing ---------------------------------------------------------------


def test_a_prompt_over_the_character_limit_is_refused_by_its_length(info):
    assert info.max_text_chars == MAX_TEXT_CHARS
    error = refusal(info, {"prompt": text(MAX_TEXT_CHARS + 1)})
    assert error.param == "prompt" and error.message.startswith(f"prompt: {MAX_TEXT_CHARS + 1} characters")
    assert f"limit of {MAX_TEXT_CHARS}" in error.message
    assert refusal(info, {"prompt": ["Say:", text(MAX_TEXT_CHARS + 1)]}).param == "prompt[1]"
    # at the limit the text is tokenized: too many tokens for the context, refused by max_tokens
    error = refusal(info, {"prompt": text(MAX_TEXT_CHARS)})
    assert error.param == "max_tokens" and "with a prompt of" in error.message


def test_a_conversation_over_the_character_limit_is_refused_by_its_length(info):
    half = text(MAX_TEXT_CHARS // 2 + 1)
    for messages in ([{"role": "user", "content": text(MAX_TEXT_CHARS + 1)}],
                     [{"role": "system", "content": half}, {"role": "user", "content": half}],
                     [{"role": "user", "content": [{"type": "text", "text": half}] * 2}],
                     [{"role": "user", "content": half, "name": half}]):
        error = refusal(info, {"messages": messages}, is_chat=True)
        assert error.param == "messages" and "characters of content and names" in error.message
        assert f"limit of {MAX_TEXT_CHARS}" in error.message
    # short contents, but the template's own text per message takes the rendered conversation over:
    # the bounded render (samples/serve/chat_template.py) stops it there
    error = refusal(info, {"messages": [{"role": "user", "content": ""}] * MAX_TEXT_CHARS}, is_chat=True)
    assert error.param == "messages" and "the chat template was stopped: it rendered a conversation" in error.message
    assert f"limit of {MAX_TEXT_CHARS}" in error.message


def test_token_ids_beyond_the_context_are_refused_before_each_is_checked(info):
    error = refusal(info, {"prompt": [5] * (MAX_SEQ_LEN + 1)})
    assert error.param == "prompt" and f"{MAX_SEQ_LEN + 1} token ids" in error.message
    assert refusal(info, {"prompt": [[5], ["x"] * (MAX_SEQ_LEN + 1)]}).param == "prompt[1]"


def test_generate_text_and_words_over_the_limit_are_refused(info):
    tokenizer = info.tokenizer
    assert parse_generate_body({"text": "Say:"}, tokenizer, 8, max_text_chars=4).tensors["input_ids"].numel() > 0
    for body, field in [({"text": "Say: hi"}, "text"),
                        ({"text": "Say:", "stop_words": ["ok", "Hello world"]}, "stop_words[1]"),
                        ({"input_ids": [5], "bad_words": ["Hello world"]}, "bad_words[0]")]:
        with pytest.raises(ValueError, match=rf"^{re.escape(field)}: \d+ characters, more than this server's "
                                             r"limit of 4 "):
            parse_generate_body(body, tokenizer, 8, max_text_chars=4)
    parse_generate_body({"text": text(10_000)}, tokenizer, 8)   # None: unbounded


# -- client values Python cannot convert ------------------------------------------------------------


@pytest.mark.parametrize("key", ["1" * 5000, "0" * 30 + "7", "-1", "+1", "1.5", "1e2", " 1", "", "٣", "²",
                                 str(VOCAB_SIZE)])
def test_logit_bias_keys_that_are_no_token_id_are_400(info, key):
    error = refusal(info, {"logit_bias": {key: 1.0}})
    assert error.param == "logit_bias" and "expected a token id" in error.message


def test_logit_bias_keys_with_leading_zeros_are_token_ids(info):
    spec = parse_request({"model": "m", "prompt": "Say:", "logit_bias": {"0007": 5, "12": -1.5}}, False, info)
    bias = spec.engine_fields["embedding_bias"]
    assert bias[7] == 5.0 and bias[12] == -1.5 and sum(map(abs, bias)) == 6.5


@pytest.mark.parametrize("fields, param", [
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": -float("inf")}, "top_p"),
    ({"presence_penalty": 10 ** 400}, "presence_penalty"),         # float() would raise OverflowError
    ({"frequency_penalty": True}, "frequency_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias[5]"),
    ({"logit_bias": {"5": 10 ** 5000}}, "logit_bias[5]"),           # repr() would raise ValueError
    ({"logit_bias": {"5": False}}, "logit_bias[5]"),
    ({"n": 10 ** 5000}, "n"),
    ({"n": True}, "n"),
    ({"n": 2.0}, "n"),
    ({"seed": float("inf")}, "seed"),
    ({"seed": 1 << 64}, "seed"),
    ({"max_tokens": True}, "max_tokens"),
    ({"top_k": float("nan")}, "top_k"),
    ({"min_tokens": 1e400}, "min_tokens"),
    ({"logprobs": True}, "logprobs"),                              # completions: an integer 0-5
    ({"best_of": True}, "best_of"),                                # True == 1 == n
    ({"best_of": 1.0}, "best_of"),
    ({"prompt": [5, True]}, "prompt[1]"),
    ({"prompt": nested(5000)}, "prompt[0][0]"),                    # repr() would raise RecursionError
    ({"temperature": nested(5000)}, "temperature"),
    ({"stop": nested(5000)}, "stop[0]"),
    ({"stream": True, "stream_options": nested(5000)}, "stream_options"),
    ({"response_format": {"type": nested(5000)}}, "response_format"),
])
def test_values_python_cannot_convert_are_400_naming_the_field(info, fields, param):
    assert refusal(info, fields).param == param


@pytest.mark.parametrize("fields, param", [
    ({"logprobs": 0}, "logprobs"),                                 # chat: true or false
    ({"parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
    ({"messages": nested(5000)}, "messages[0]"),
    ({"messages": [nested(5000)]}, "messages[0]"),
    ({"messages": [{"role": nested(5000), "content": "hi"}]}, "messages[0].role"),   # unhashable: a TypeError
    ({"messages": [{"role": "user", "content": [nested(5000)]}]}, "messages[0].content[0]"),
])
def test_chat_values_python_cannot_convert_are_400_naming_the_field(info, fields, param):
    assert refusal(info, fields, is_chat=True).param == param


def test_values_are_shown_short_and_cheaply():
    values = ([list(range(1000))] * 10_000, nested(100_000), "x" * 10_000_000, [10 ** 5000],
              {str(i): [i] for i in range(10 ** 6)})
    start = time.perf_counter()
    shown = [short_repr(v) for v in values]
    names = some_sorted(values[-1].keys())
    assert time.perf_counter() - start < 0.1, "no value is copied, sorted or walked whole"
    assert all(len(s) <= 80 for s in shown), shown
    assert shown[3] == "[an integer of 16610 bits]" and short_repr(-(1 << 63)) == str(-(1 << 63))
    assert shown[4] == "{'0': [0], '1': [1], '2': [2], '3': [3], ...}"     # the client's order
    assert len(names) == 17 and names[-1] == "..." and some_sorted({"b", "a"}) == ["a", "b"]
