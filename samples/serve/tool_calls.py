"""Tool calling on /v1/chat/completions (samples.serve), the request side: `tools`,
`tool_choice` and `parallel_tool_calls` -> a `ToolChoice`; the conversation with the tools
offered and earlier calls and results written back (`tool_conversation`); the grammar that
holds the reply to the tools' JSON schemas (`tool_grammar`, Lark text for llguidance). The reply
side is `tool_call_parser`.

The call format: the model's own where its chat template uses Hermes-style tags (Qwen 2.5,
Hermes: `<tool_call>` in the template); otherwise this generic one, the same text:

    <tool_call>
    {"name": "<function name>", "arguments": <JSON object for the function's schema>}
    </tool_call>

one block per call, blocks separated by a newline. A template that renders `tools` itself gets
them as `tools=`; otherwise the functions are listed in the system message with these
instructions. A template that renders `tool_calls` and `tool` messages gets them as they came;
otherwise an assistant's calls become the blocks above in its content and a tool result a user
message `<tool_response>\\n...\\n</tool_response>` (as Qwen's template writes it).

tool_choice: "none" (no grammar, the reply is text), "auto" (the default with tools: a grammar
with a text alternative: a reply that begins with `<tool_call>` is held to the schemas, any
other is text, so a text reply cannot begin with "<"), "required" (one or more calls, one with
parallel_tool_calls false) or {"type": "function", "function": {"name": N}} (exactly one call of
N). A forced call is valid JSON for its schema whenever the reply ends other than by max_tokens.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from samples.serve.value_repr import short_repr

CALL_START = "<tool_call>\n"
CALL_END = "\n</tool_call>"
CALL_SEPARATOR = "\n"
MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
ANY_OBJECT_SCHEMA = {"type": "object"}
# llguidance's JSON layout: json.dumps's separators, no other whitespace (fewer tokens, one form)
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolError(ValueError):
    """A bad `tools` / `tool_choice` / message field: (field, problem)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict           # its arguments' JSON schema

    def openai(self) -> dict:
        """The tool as OpenAI's body has it (what a template that renders `tools` expects)."""
        function = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    functions: tuple[Function, ...]
    mode: str                  # "none", "auto", "required" or "named"
    named: str | None = None   # mode "named": the function called
    parallel: bool = True      # more than one call allowed (required / auto)

    @property
    def is_forced(self) -> bool:
        return self.mode in ("required", "named")

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none"


@dataclass(frozen=True)
class ToolCallFormat:
    """How the chat template takes tools (the call text itself is the same for both formats)."""
    name: str                      # "hermes" (the template's own tags) or "generic"
    renders_tools: bool            # the template lists `tools=` itself
    renders_tool_messages: bool    # the template writes assistant `tool_calls` and `tool` messages


def detect_format(chat_template: str | None) -> ToolCallFormat:
    template = chat_template or ""
    if "<tool_call>" in template:
        return ToolCallFormat("hermes", "tools" in template, "tool_calls" in template)
    return ToolCallFormat("generic", False, False)


def parse_tool_choice(body: dict) -> ToolChoice | None:
    """The body's tools fields -> a ToolChoice, or None without tools (ToolError for bad ones)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", f"expected true or false, got {short_repr(parallel)}")
    if tools is None:
        if choice not in (None, "none"):
            raise ToolError("tool_choice", f"{short_repr(choice, 80)} needs tools")
        return None
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise ToolError("tools", f"expected a list of 1 to {MAX_TOOLS} tools, got {short_repr(tools)}")
    functions = tuple(_function(f"tools[{i}]", tool) for i, tool in enumerate(tools))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("tools", f"function names must differ, got {sorted(names)}")
    if choice is None or choice in ("none", "auto", "required"):
        return ToolChoice(functions, choice or "auto", parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and set(choice) == {"type", "function"}:
        name = choice["function"].get("name")
        if name not in names:
            raise ToolError("tool_choice", f"function {short_repr(name, 80)} is not among the tools {names}")
        return ToolChoice(functions, "named", name, parallel=False)
    raise ToolError("tool_choice", f"expected \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                                   f"\"function\": {{\"name\": ...}}}}, got {short_repr(choice)}")


def _function(field: str, tool) -> Function:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ToolError(field, f"expected {{\"type\": \"function\", \"function\": {{...}}}}, got {short_repr(tool)}")
    function = tool["function"]
    unknown = set(function) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise ToolError(f"{field}.function", f"unknown keys {sorted(unknown)}")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise ToolError(f"{field}.function.name", f"expected 1 to 64 of a-z, A-Z, 0-9, _ and -, got "
                                                  f"{short_repr(name, 80)}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{field}.function.description", f"expected a string, got {short_repr(description)}")
    parameters = function.get("parameters", ANY_OBJECT_SCHEMA)
    if not isinstance(parameters, dict):
        raise ToolError(f"{field}.function.parameters", f"expected a JSON schema object, got {short_repr(parameters)}")
    return Function(name, description, parameters)


# -- the prompt ------------------------------------------------------------------------------------

def call_text(name: str, arguments: str) -> str:
    """One call block, as the grammar makes the model write it (`arguments` as the JSON text)."""
    return f'{CALL_START}{{"name": {json.dumps(name)}, "arguments": {arguments}}}{CALL_END}'


def tools_instructions(functions: tuple[Function, ...]) -> str:
    listed = "\n".join(json.dumps(f.openai()["function"], ensure_ascii=False) for f in functions)
    return ("You can call these functions (JSON schemas of their arguments):\n" + listed + "\n"
            "To call a function, reply with exactly:\n"
            f'{CALL_START}{{"name": <function name>, "arguments": <arguments as a JSON object>}}{CALL_END}')


def tool_conversation(conversation: list[dict], tools: ToolChoice | None, fmt: ToolCallFormat) -> list[dict]:
    """The messages for the chat template: tools listed (unless the template does it), earlier
    calls and results in the form the template can write."""
    out = []
    for message in conversation:
        if fmt.renders_tool_messages:
            out.append(message)
        elif message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        elif message.get("tool_calls"):
            calls = CALL_SEPARATOR.join(call_text(c["function"]["name"], c["function"]["arguments"])
                                        for c in message["tool_calls"])
            text = message.get("content") or ""
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        else:
            out.append({k: v for k, v in message.items() if k != "tool_calls"})
    if tools is not None and not fmt.renders_tools:
        instructions = tools_instructions(tools.functions)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{instructions}"}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


# -- the grammar -----------------------------------------------------------------------------------

def tool_grammar(tools: ToolChoice) -> str | None:
    """Lark text for llguidance (None for "none"): the call blocks of the allowed functions, each
    function's arguments held to its schema (`%json`, laid out as json.dumps does unless the
    schema says otherwise in llguidance's "x-guidance"); "auto" adds a text alternative."""
    if not tools.parses_calls:
        return None
    functions = [f for f in tools.functions if tools.mode != "named" or f.name == tools.named]
    lit = json.dumps
    lines = ["start: calls" + (" | TEXT" if tools.mode == "auto" else ""),
             f"calls: call ({lit(CALL_SEPARATOR)} call)*" if tools.parallel else "calls: call",
             f"call: {lit(CALL_START)} ({' | '.join(f'fn_{i}' for i in range(len(functions)))}) {lit(CALL_END)}"]
    for i, f in enumerate(functions):
        head = '{"name": ' + lit(f.name) + ', "arguments": '
        lines.append(f"fn_{i}: {lit(head)} args_{i} {lit('}')}")
        lines.append(f"args_{i}: %json {_laid_out(f.parameters)}")
    if tools.mode == "auto":
        lines.append(r"TEXT: /[^<][\s\S]*/")
    return "\n".join(lines) + "\n"


def _laid_out(parameters: dict) -> str:
    """The schema as `%json` takes it, json.dumps's layout unless its own "x-guidance" says otherwise."""
    return json.dumps({**parameters, "x-guidance": parameters.get("x-guidance", COMPACT_JSON)}, ensure_ascii=False)


def arguments_grammar(parameters: dict) -> str:
    """Lark text for a function's arguments alone (what the server compiles to check the schema)."""
    return f"start: %json {_laid_out(parameters)}\n"
