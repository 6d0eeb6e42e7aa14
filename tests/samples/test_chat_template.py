"""samples.serve.chat_template: the chat template renders as apply_chat_template does, and one that
runs long (nested loops) or builds huge text (repetition, doubling, padding, joins, the output
itself) is stopped within its bounds: a 400 naming the chat template, the server thread freed."""
from __future__ import annotations

import time

import pytest

from samples.serve.chat_template import MAX_RENDER_S, TemplateBoundError, render_chat_template
from tests.samples.scripted_model import VOCAB_SIZE, write_tokenizer
from tests.samples.test_tool_calls import HERMES_TEMPLATE, TOOLS

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Greet me 👋 {{ 'x' * 9 }}"},
            {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "100%s"}]
HOSTILE = {
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "repetition in a loop": "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
    "doubling by ~": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                     "{% endfor %}{{ ns.s|length }}",
    "doubling by +": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                     "{% endfor %}",
    "padding": "{{ 'x'.ljust(10 ** 9) }}",
    "a padding filter": "{{ 'x'|center(1000000000) }}",
    "a format width": "{{ '%999999999s' % 'a' }}",
    "a join": "{{ ('x' * 1000)|join('y' * 90000) }}",
    "a replace": "{{ ('ab' * 1000)|replace('', 'x' * 90000) }}",
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    import transformers
    directory = tmp_path_factory.mktemp("bpe")
    write_tokenizer(str(directory))
    return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


@pytest.mark.parametrize("template", [None, HERMES_TEMPLATE])
def test_renders_as_apply_chat_template(tokenizer, template):
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path, local_files_only=True)
    if template is not None:
        tokenizer.chat_template = template
    tools = [{"type": t["type"], "function": {"parameters": {}, **t["function"]}} for t in TOOLS]
    for extra in ({}, {"tools": tools}):
        expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, **extra)
        assert render_chat_template(tokenizer, MESSAGES, 10 ** 6, **extra) == expected


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_template_is_stopped_within_its_bounds(tokenizer, name):
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path, local_files_only=True)
    tokenizer.chat_template = HOSTILE[name]
    began = time.monotonic()
    with pytest.raises(TemplateBoundError):
        render_chat_template(tokenizer, MESSAGES, 100_000)
    assert time.monotonic() - began < MAX_RENDER_S + 30   # the deadline, and a busy machine's margin


def test_the_server_answers_400_naming_the_chat_template(tokenizer):
    from samples.serve.openai_basics import ModelInfo, OpenAIError
    from samples.serve.openai_protocol import parse_request
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path, local_files_only=True)
    tokenizer.chat_template = HOSTILE["repetition in a loop"]
    info = ModelInfo("m", tokenizer, VOCAB_SIZE, 256, tokenizer.eos_token_id)
    with pytest.raises(OpenAIError) as e:
        parse_request({"model": "m", "messages": MESSAGES[:2]}, True, info)
    assert (e.value.status, e.value.param) == (400, "messages") and "the chat template was stopped" in e.value.message
