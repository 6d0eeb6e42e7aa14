"""samples.serve over both bridges with the grammar engine: a tool schema llguidance cannot compile
(or one with no finite value) is a 400 naming `tools[i].function.parameters` before anything is
queued, never an engine error (a 500, which the openai client retries)."""
from __future__ import annotations

import openai
import pytest

from tests.samples.conftest import ServerThread
from tests.samples.openai_client import API_KEY, MODEL, assert_idle, client
from tests.samples.test_tool_calls import BAD_SCHEMAS

GOOD = {"type": "object", "properties": {"n": {"type": "integer"}}}


@pytest.fixture(scope="module", params=["gpt_manager", "executor"])
def server(scripted, request):
    from samples.serve.generation_config import guided_decoding_config
    from samples.serve.launch import model_info
    tokenizer, script, engine_dir = scripted
    info = model_info(engine_dir, tokenizer, MODEL, True, tokenizer.name_or_path)
    guided = guided_decoding_config(tokenizer.name_or_path, (script.end_id,), info.vocab_size)
    assert guided is not None
    s = ServerThread(engine_dir, tokenizer, api=request.param, guided_decoding_config=guided, model_info=info,
                     api_key=API_KEY)
    yield s
    s.stop()


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.parametrize("name", BAD_SCHEMAS)
def test_a_bad_tool_schema_is_a_400_naming_it(server, name):
    schema, words = BAD_SCHEMAS[name]
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, tools=[tool("good", GOOD), tool("bad", schema)],
                                               tool_choice="required")
    error = e.value.body
    assert e.value.status_code == 400 and error["param"] == "tools[1].function.parameters"
    assert error["message"].startswith("tools[1].function.parameters: ") and words in error["message"]
    assert_idle(server)

