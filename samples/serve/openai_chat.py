"""Chat bodies of samples.serve's /v1/chat/completions: the messages (text content, an
assistant's earlier tool calls, tool results) checked field by field, `tools` / `tool_choice`,
and the conversation rendered through the tokenizer's chat template."""
from __future__ import annotations

from samples.serve.chat_template import MAX_RENDER_S, TemplateBoundError, render_chat_template
from samples.serve.openai_basics import ModelInfo, bad, check_num_chars, text_field
from samples.serve.tool_calls import ToolChoice, ToolError, parse_tool_choice, tool_conversation
from samples.serve.tool_schemas import check_tool_schemas
from samples.serve.value_repr import short_repr, some_sorted

CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


def parse_messages(value) -> list[dict]:
    """Chat messages with text content -> the conversation the chat template renders. Assistant
    messages may carry `tool_calls` (content then may be null); `tool` messages a tool_call_id."""
    if not isinstance(value, list) or not value:
        raise bad("messages", f"expected a non-empty list of messages, got {short_repr(value)}")
    conversation = []
    for i, message in enumerate(value):
        field = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(field, f"expected an object with role and content, got {short_repr(message)}")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:   # a list is unhashable
            raise bad(f"{field}.role", f"expected one of {sorted(CHAT_ROLES)}, got {short_repr(role, 40)}")
        allowed = {"role", "content", "name"} | {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}.get(role, set())
        unknown = set(message) - allowed
        if unknown:
            raise bad(field, f"unsupported keys {short_repr(some_sorted(unknown), 120)} (a {role} message has "
                             f"{', '.join(sorted(allowed))})")
        out = {"role": role}
        calls = message.get("tool_calls")
        if calls is not None:
            out["tool_calls"] = _tool_calls(f"{field}.tool_calls", calls)
        content = message.get("content")
        out["content"] = "" if content is None and calls else _content(f"{field}.content", content)
        if "name" in message:
            out["name"] = text_field(f"{field}.name", message["name"])
        if role == "tool":
            out["tool_call_id"] = text_field(f"{field}.tool_call_id", message.get("tool_call_id"))
        conversation.append(out)
    return conversation


def _content(field: str, content) -> str:
    """A string, or text parts (joined)."""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or set(part) != {"type", "text"}:
                raise bad(f"{field}[{j}]", f"only {{\"type\": \"text\", \"text\": ...}} parts are supported, "
                                          f"got {short_repr(part)}")
            texts.append(text_field(f"{field}[{j}].text", part["text"]))
        return "".join(texts)
    return text_field(field, content)


def _tool_calls(field: str, calls) -> list[dict]:
    """An assistant's earlier calls: [{"id", "type": "function", "function": {"name", "arguments"}}]."""
    if not isinstance(calls, list) or not calls:
        raise bad(field, f"expected a non-empty list of tool calls, got {short_repr(calls)}")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise bad(f"{field}[{j}]", f"expected {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                                       f"\"arguments\"}}}}, got {short_repr(call)}")
        out.append({"id": text_field(f"{field}[{j}].id", call.get("id", "")), "type": "function",
                    "function": {"name": text_field(f"{field}[{j}].function.name", function.get("name")),
                                 "arguments": text_field(f"{field}[{j}].function.arguments",
                                                    function.get("arguments", "{}"))}})
    return out


def render_chat(conversation: list[dict], info: ModelInfo, tools: ToolChoice | None = None) -> list[int]:
    """The tokenizer's own chat template (tokenizer_config.json's chat_template), rendered with the
    assistant's generation prompt; its text is tokenized without adding special tokens (the
    template writes them). Tools, earlier calls and tool results go in as `tool_calls.tool_conversation`
    says. Contents and names, then the rendered text, are bounded by info.max_text_chars first."""
    tokenizer = info.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise bad("messages", "the tokenizer has no chat template (tokenizer_config.json: chat_template)")
    num_chars = sum(len(m["content"]) + len(m.get("name", "")) + sum(
        len(c["function"]["arguments"]) + len(c["function"]["name"]) for c in m.get("tool_calls", ()))
        for m in conversation)
    check_num_chars("messages", " of content and names", num_chars, info)
    fmt = info.tool_format
    messages = tool_conversation(conversation, tools, fmt)
    extra = {"tools": [f.openai() for f in tools.functions]} if tools is not None and fmt.renders_tools else {}
    try:
        text = render_chat_template(tokenizer, messages, info.max_text_chars, **extra)
    except TemplateBoundError as e:
        raise bad("messages", f"the chat template was stopped: it {e} (its render is bounded by "
                              f"{MAX_RENDER_S:g} s and the server's text limit)") from None
    except Exception as e:   # the template's own raise_exception (roles must alternate, ...) or a Jinja error
        raise bad("messages", f"the chat template refused the conversation: {e}") from None
    check_num_chars("messages", " in the rendered conversation", len(text), info)
    return list(tokenizer.encode(text, add_special_tokens=False))


def parse_tools(body: dict, info: ModelInfo) -> ToolChoice | None:
    try:
        tools = parse_tool_choice(body)
    except ToolError as e:
        raise bad(e.field, e.problem) from None
    if tools is not None and tools.parses_calls and not info.can_guide:
        raise bad("tools", "tool calls need the grammar engine, which this server runs without (the tokenizer has "
                           "no tokenizer.json, or one the grammar engine cannot use: see the server's log)")
    if tools is not None and tools.parses_calls:
        check_tool_schemas(tools, info)
    return tools
