"""Property-based fuzz of samples.serve's request body against one running server: every body, valid
or not, gets a 200 or a 400 whose error leads with the field (or `body`) at fault, never a 5xx, and
leaves no handler waiting. Deterministic (derandomize) and small (tiny model, <= 8 new tokens)."""
from __future__ import annotations

import collections
import json
import re

import aiohttp
from hypothesis import HealthCheck, given, settings, strategies as st

from samples.serve.params import ALL_FIELDS
from tests.samples.conftest import run

NUM_EXAMPLES = 150
ERROR_LEAD = re.compile(r"^(body|input_ids / text|" + "|".join(map(re.escape, sorted(ALL_FIELDS)))
                        + r")(\[\d+\])*: ")

EDGE_INTS = [1 << 31, (1 << 31) - 1, -(1 << 31) - 1, 1 << 63, (1 << 64) - 1, 1 << 64, -(1 << 63) - 1, 10 ** 400]
text_chars = st.characters(categories=["Cs", "Lu", "Ll", "Nd", "Zs", "Po"])   # Cs: lone surrogates
scalars = (st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.sampled_from(EDGE_INTS)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(text_chars, max_size=8)
           | st.sampled_from(["NaN", "inf", "t5 t6", "", " "]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=12)
token_ids = (st.lists(st.integers(3, 127), min_size=1, max_size=12)
             | st.lists(st.integers(-2, 140) | st.sampled_from(EDGE_INTS[:3]), max_size=12))
words = (st.lists(st.integers(3, 127), min_size=1, max_size=3)
         | st.lists(st.sampled_from(["t5", "t9", "x"]), min_size=1, max_size=3).map(" ".join))
probability = st.floats(0.0, 1.0)
# body field -> a valid value (edge and invalid values come from json_values and EDGE_INTS)
VALID = {
    "input_ids": token_ids, "text": st.lists(st.integers(0, 130).map("t{}".format), max_size=8).map(" ".join),
    "max_new_tokens": st.integers(1, 8), "stream": st.booleans(), "end_id": st.integers(-1, 127),
    "pad_id": st.integers(0, 127), "beam_width": st.just(1), "temperature": st.floats(0.0, 2.0),
    "top_k": st.integers(0, 10), "top_p": probability, "seed": st.integers(-(1 << 63), (1 << 64) - 1),
    "min_length": st.integers(0, 4), "repetition_penalty": st.floats(0.1, 2.0),
    "presence_penalty": st.floats(-1.0, 1.0), "frequency_penalty": st.floats(-1.0, 1.0),
    "length_penalty": st.floats(-1.0, 1.0), "early_stopping": st.integers(0, 2),
    "no_repeat_ngram_size": st.integers(0, 3), "return_log_probs": st.booleans(),
    "num_top_log_probs": st.integers(0, 5), "min_p": probability, "top_p_decay": st.floats(0.1, 1.0),
    "top_p_min": st.floats(1e-6, 1.0), "top_p_reset_ids": st.integers(-1, 127),
    "beam_search_diversity_rate": st.floats(0.0, 1.0),
    "stop_words": st.lists(words, min_size=1, max_size=3), "bad_words": st.lists(words, min_size=1, max_size=3),
    "embedding_bias": st.lists(st.floats(-2.0, 2.0), min_size=128, max_size=128),
}
assert set(VALID) == ALL_FIELDS


@st.composite
def objects(draw) -> dict:
    """A prompt plus a few optional fields, each valid or anything; sometimes an unknown field."""
    body = {"input_ids" if draw(st.booleans()) else "text": None}
    for field in draw(st.lists(st.sampled_from(sorted(ALL_FIELDS - {"input_ids", "text"})), max_size=4)):
        body[field] = None
    for field in body:
        body[field] = draw(VALID[field] if draw(st.integers(0, 5)) else json_values)
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(text_chars, min_size=1, max_size=6))] = draw(json_values)
    if draw(st.integers(0, 9)) == 0:
        body["text" if "input_ids" in body else "input_ids"] = draw(json_values)
    return body


bodies = st.one_of(
    objects().map(lambda b: json.dumps(b).encode()),
    objects().map(lambda b: json.dumps(b).encode()),
    objects().map(lambda b: json.dumps(b).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),                               # not an object
    st.integers(500, 5000).map(lambda n: b'{"input_ids": ' + b"[" * n + b"]" * n + b"}"),  # deep nesting
    st.binary(max_size=24),
)


async def exchange(url: str, data: bytes) -> tuple[int, str, str, int]:
    """(status, content type, body text, /health's waiting count after the answer)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.post(url + "/generate", data=data) as response:
            status, content_type, text = response.status, response.content_type, await response.text()
        async with session.get(url + "/health") as response:
            waiting = (await response.json())["waiting_requests"]
    return status, content_type, text, waiting


def check_answer(status: int, content_type: str, text: str) -> None:
    assert status in (200, 400), (status, text)
    if status == 400:
        error = json.loads(text)["error"]
        assert ERROR_LEAD.match(error), error
    elif content_type == "text/event-stream":
        assert "event: error" not in text, text
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
        assert events and events[-1]["is_final"], text
    else:
        assert json.loads(text)["is_final"], text


def test_fuzzed_bodies_get_200_or_a_400_naming_the_field(server):
    statuses = collections.Counter()

    @settings(max_examples=NUM_EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(bodies)
    def check(data: bytes):
        status, content_type, text, waiting = run(exchange, server.url, data)
        check_answer(status, content_type, text)
        assert waiting == 0, (data[:200], waiting)
        statuses[status] += 1

    check()
    assert sum(statuses.values()) >= NUM_EXAMPLES and statuses[200] >= 10 and statuses[400] >= 10, statuses
    assert server.bridge.num_waiting_handlers() == 0
    assert server.bridge.num_active_requests() == 0
    print(f"fuzzed bodies: {dict(statuses)}")
