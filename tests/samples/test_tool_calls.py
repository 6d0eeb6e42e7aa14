"""samples.serve's tool calling without a model: the body's tools fields, the grammar (compiled by
llguidance over a byte-level BPE: forced calls accept exactly their schemas' JSON, auto adds text
that does not begin with "<"), the format read from a chat template, the conversation written
back, and the streaming parser's deltas joining to the calls at any split."""
from __future__ import annotations

import json

import pytest

from samples.serve.tool_call_parser import ToolCallParser
from samples.serve.tool_calls import (ToolError, call_text, detect_format, parse_tool_choice, tool_conversation,
                                      tool_grammar)
from tests.samples.scripted_model import VOCAB_SIZE, write_tokenizer

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "time", "description": "now"}}]


@pytest.fixture(scope="module")
def matcher_of(tmp_path_factory):
    """grammar text -> a function telling whether llguidance accepts a whole reply."""
    import llguidance
    directory = tmp_path_factory.mktemp("bpe")
    write_tokenizer(str(directory))
    tokenizer = llguidance.LLTokenizer((directory / "tokenizer.json").read_text(), n_vocab=VOCAB_SIZE)

    def accepts(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, llguidance.grammar_from("grammar", grammar), log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        ids = tokenizer.tokenize_str(text)
        return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()
    return accepts


def choice(**body):
    return parse_tool_choice({"tools": TOOLS, **body})


def test_tool_choice_forms():
    assert parse_tool_choice({}) is None and parse_tool_choice({"tool_choice": "none"}) is None
    assert (choice().mode, choice().parallel) == ("auto", True)
    assert choice(tool_choice="required", parallel_tool_calls=False).parallel is False
    named = choice(tool_choice={"type": "function", "function": {"name": "time"}})
    assert (named.mode, named.named, named.is_forced) == ("named", "time", True)
    assert choice().functions[1].parameters == {"type": "object"}   # no parameters: any object


@pytest.mark.parametrize("body, field", [
    ({"tool_choice": "required"}, "tool_choice"),                               # without tools
    ({"tools": [], "tool_choice": "auto"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "code"}]}, "tools[0]"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),                                     # names repeat
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
])
def test_bad_tools_fields_name_the_field(body, field):
    with pytest.raises(ToolError) as e:
        parse_tool_choice(body)
    assert e.value.field == field


def test_forced_grammars_accept_exactly_the_schemas_json(matcher_of):
    named = tool_grammar(choice(tool_choice={"type": "function", "function": {"name": "weather"}}))
    good = call_text("weather", json.dumps({"city": "Rome", "days": 3}))
    assert matcher_of(named, good)
    for bad in (call_text("weather", '{"city": "Oslo", "days": 3}'),        # not in the enum
                call_text("weather", '{"city": "Rome", "days": 10}'),       # over the maximum
                call_text("weather", '{"city": "Rome"}'),                   # a required key missing
                call_text("weather", '{"city":"Rome","days":3}'),           # not json.dumps's layout
                call_text("time", "{}"),                                    # another function
                "It is sunny.", good + "\n" + good):                        # text; a second call
        assert not matcher_of(named, bad), bad
    required = tool_grammar(choice(tool_choice="required"))
    assert matcher_of(required, good + "\n" + call_text("time", '{"zone": "UTC"}'))   # parallel calls
    assert not matcher_of(required, "Hello")
    single = tool_grammar(choice(tool_choice="required", parallel_tool_calls=False))
    assert matcher_of(single, call_text("time", "{}")) and not matcher_of(single, good + "\n" + good)


def test_auto_grammar_takes_text_or_valid_calls(matcher_of):
    auto = tool_grammar(choice())
    assert matcher_of(auto, "It is sunny in Rome.")
    assert matcher_of(auto, call_text("weather", '{"city": "Paris", "days": 1}'))
    assert not matcher_of(auto, call_text("weather", '{"city": "Lyon", "days": 1}'))
    assert not matcher_of(auto, "<b>bold</b>")   # NOTE: a text reply cannot begin with "<"
    assert tool_grammar(choice(tool_choice="none")) is None


def test_the_format_follows_the_chat_template():
    assert detect_format("{{ messages }}").name == "generic"
    hermes = detect_format("{% if tools %}...{% endif %}<tool_call>{{ tool_call }}{% if message.tool_calls %}")
    assert (hermes.name, hermes.renders_tools, hermes.renders_tool_messages) == ("hermes", True, True)


def test_generic_conversation_lists_tools_and_writes_back_calls_and_results():
    arguments = '{"city": "Rome", "days": 2}'
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": arguments}}]},
                    {"role": "tool", "content": "Sunny", "tool_call_id": "c1"}]
    out = tool_conversation(conversation, choice(), detect_format(None))
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\nYou can call these functions")
    assert '"name": "weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": call_text("weather", arguments)}
    assert out[3] == {"role": "user", "content": "<tool_response>\nSunny\n</tool_response>"}
    assert tool_conversation(conversation[1:2], choice(), detect_format(None))[0]["role"] == "system"


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_streamed_deltas_join_to_the_calls_at_any_split(piece):
    arguments = ['{"q": "a}\\"b", "n": [1, {"x": 2}]}', "7", '"s"']
    text = "\n".join(call_text(f"f{i}", a) for i, a in enumerate(arguments))
    parser = ToolCallParser(is_forced=False)
    content, deltas = "", []
    for i in range(0, len(text), piece):
        c, d = parser.feed(text[i:i + piece])
        content, deltas = content + c, deltas + d
    c, d = parser.finish()
    assert content + c == "" and not d
    assert [(call.name, call.arguments) for call in parser.calls] == [(f"f{i}", a) for i, a in enumerate(arguments)]
    for i, call in enumerate(parser.calls):
        own = [delta for delta in deltas if delta.index == i]
        assert own[0].openai() == {"index": i, "id": call.id, "type": "function",
                                   "function": {"name": call.name, "arguments": ""}}
        assert "".join(delta.arguments for delta in own) == call.arguments


def test_auto_text_passes_through_once_it_cannot_be_a_call():
    parser = ToolCallParser(is_forced=False)
    assert parser.feed("<to") == ("", [])     # may still become a call: held
    assert parser.feed("ast>") == ("<toast>", [])
    assert parser.feed(" more") == (" more", []) and parser.is_text and not parser.calls


HERMES_TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for tool in tools %} {{ tool['function']['name'] }}{% endfor %}\n"
    "Call them in <tool_call></tool_call> tags.\n{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'tool' %}<|user|><tool_response>{{ message['content'] }}"
    "</tool_response>\n{% elif message.get('tool_calls') %}<|assistant|>{% for call in message['tool_calls'] %}"
    "<tool_call>{{ call['function']['name'] }} {{ call['function']['arguments'] }}</tool_call>{% endfor %}\n"
    "{% else %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_a_hermes_template_renders_tools_and_tool_messages_itself(tmp_path):
    import dataclasses

    import transformers

    from samples.serve.openai_basics import ModelInfo
    from samples.serve.openai_chat import parse_messages as _messages, render_chat
    write_tokenizer(str(tmp_path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    tokenizer.chat_template = HERMES_TEMPLATE
    info = ModelInfo("m", tokenizer, VOCAB_SIZE, 4096, None, tool_format=detect_format(HERMES_TEMPLATE))
    assert info.tool_format.name == "hermes"
    conversation = _messages([{"role": "user", "content": "Weather?"},
                              {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                                  "name": "weather", "arguments": '{"city": "Rome"}'}}]},
                              {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}])
    text = tokenizer.decode(render_chat(conversation, info, choice()))
    assert text == ("<|system|>Tools: weather timeCall them in <tool_call></tool_call> tags.\n<|user|>Weather?\n"
                    '<|assistant|><tool_call>weather {"city": "Rome"}</tool_call>'   # (Jinja's trim_blocks)
                    "<|user|><tool_response>Sunny</tool_response>\n<|assistant|>")
    generic = dataclasses.replace(info, tool_format=detect_format(None))
    assert "You can call these functions" in tokenizer.decode(render_chat(conversation, generic, choice()))


# -- schemas checked before a request is queued ------------------------------------------------------

REF_A = {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                                             "required": ["x"]}}}
BAD_SCHEMAS = {   # name -> (schema, words of the 400's message)
    "min over max": ({"type": "integer", "minimum": 5, "maximum": 3}, "minimum (5) is greater than maximum (3)"),
    "required, no properties": ({"type": "object", "required": ["a"], "additionalProperties": False},
                                "required property 'a' is unsatisfiable"),
    "bad pattern": ({"type": "object", "properties": {"s": {"type": "string", "pattern": "(a"}}}, "unclosed group"),
    "dangling ref": ({"$ref": "#/$defs/nope"}, "does not exist"),
    "unknown type": ({"type": "objekt"}, "objekt"),
    "not": ({"not": {}}, "not"),
    "bad x-guidance": ({"type": "object", "x-guidance": {"whitespace_flexible": "maybe"}}, "maybe"),
    "endless recursion": (REF_A, "no finite value"),
}


@pytest.mark.parametrize("name", BAD_SCHEMAS)
def test_a_schema_the_grammar_engine_refuses_is_a_400_naming_it(tmp_path_factory, name):
    import transformers
    from samples.serve.openai_basics import ModelInfo, OpenAIError
    from samples.serve.openai_protocol import parse_request
    directory = tmp_path_factory.mktemp("bpe")
    write_tokenizer(str(directory))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    info = ModelInfo("m", tokenizer, VOCAB_SIZE, 4096, tokenizer.eos_token_id, can_guide=True)
    schema, words = BAD_SCHEMAS[name]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [TOOLS[0], {"type": "function", "function": {"name": "bad", "parameters": schema}}]}
    with pytest.raises(OpenAIError) as e:
        parse_request(body, True, info)
    assert (e.value.status, e.value.param) == (400, "tools[1].function.parameters") and words in e.value.message
    # not compiled where no grammar holds the reply to it
    parse_request({**body, "tool_choice": "none"}, True, info)
    parse_request({**body, "tool_choice": {"type": "function", "function": {"name": "weather"}}}, True, info)


def test_finite_values_of_recursive_schemas():
    from samples.serve.tool_schemas import has_finite_value
    node = {"type": "object", "properties": {"next": {"$ref": "#"}}}
    assert has_finite_value(node)                                          # next is optional
    assert not has_finite_value({**node, "required": ["next"]})
    assert has_finite_value({**node, "required": ["next"], "type": ["object", "null"]})
    assert has_finite_value({"anyOf": [{"$ref": "#"}, {"type": "string"}]})
    assert not has_finite_value({"type": "array", "items": {"$ref": "#"}, "minItems": 1})
    assert has_finite_value({"type": "array", "items": {"$ref": "#"}})      # [] ends it
    assert not has_finite_value(REF_A) and has_finite_value({"$ref": "#/$defs/missing"})
