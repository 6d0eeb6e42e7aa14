"""The tools' JSON schemas checked before a chat request is queued (samples.serve): each schema
the reply would be held to is compiled by the server's own grammar compiler over the tokenizer
(llguidance: unsatisfiable bounds, bad patterns, dangling `$ref`s, unknown types or keywords, a
bad `x-guidance`), and a recursive schema must have a finite value. A bad one is a 400 naming
`tools[i].function.parameters`, never an engine error after the request was queued."""
from __future__ import annotations

import re

from samples.serve.openai_basics import ModelInfo, OpenAIError, bad
from samples.serve.tool_calls import ToolChoice, arguments_grammar

MAX_REFS = 256             # schemas with more `$ref`s skip the finite-value check (the engine still bounds them)
COMPILE_TIMEOUT_S = 120.0  # llguidance's own limits end a compile well before this


def check_tool_schemas(tools: ToolChoice, info: ModelInfo) -> None:
    """OpenAIError: 400 naming the first bad schema; 429 when the server's compiler is full."""
    compiler = info.grammar_checker
    for i, function in enumerate(tools.functions):
        if tools.mode == "named" and function.name != tools.named:
            continue   # not in the grammar
        field = f"tools[{i}].function.parameters"
        check_json_schema(field, function.parameters, arguments_grammar(function.parameters), compiler)


def check_json_schema(field: str, schema: dict, grammar: str, compiler) -> None:
    """Compile `grammar` (the Lark text holding a value to `schema`) on `compiler`; 400 naming `field`."""
    from runtime.decoding.guided import GrammarQueueFullError
    if not has_finite_value(schema):
        raise bad(field, "the schema has no finite value (a required property or item recurses without end)")
    try:
        compiler.compile("ebnf_grammar", grammar).result(COMPILE_TIMEOUT_S)
    except GrammarQueueFullError as e:
        raise OpenAIError(429, f"{field}: {e}".replace("guided_decoding_params: ", ""), field, "queue_full",
                          retry_after_s=1) from None
    except ValueError as e:
        raise bad(field, f"the grammar engine cannot use this JSON schema: {_first_line(str(e))}") from None
    except (RuntimeError, TimeoutError) as e:   # the compiler shut down, or a compile past every limit
        raise OpenAIError(503, f"{field}: the schema could not be checked ({e or 'timed out'})", field,
                          "shutting_down") from None


def _first_line(message: str) -> str:
    """llguidance's reason, without the field prefix and the grammar listing that follows it."""
    lines = []
    for line in message.split("\n"):
        if re.match(r"\s+\d+ \|", line):   # the listing of the grammar
            break
        lines.append(line.strip())
    reason = " ".join(line for line in lines if line)
    for marker in ("failed to compile JSON schema: ", "guide ("):
        if marker in reason:
            reason = reason.split(marker, 1)[1]
            break
    return reason.removesuffix(")") if reason.count(")") > reason.count("(") else reason


def has_finite_value(schema) -> bool:
    """False where every value the schema allows would nest without end (a required property,
    or the first items of a non-empty array, that leads back through `$ref`s to itself); True
    otherwise, and where it cannot tell. A least fixed point over the `#...` references."""
    refs = _refs(schema)
    if not refs or len(refs) > MAX_REFS:
        return True
    targets = {ref: _resolve(schema, ref) for ref in refs}
    is_productive = {ref: target is None for ref, target in targets.items()}   # unknown: leave it to the engine
    try:
        changed = True
        while changed:
            changed = False
            for ref, target in targets.items():
                if not is_productive[ref] and _finite(target, is_productive):
                    is_productive[ref] = changed = True
        return _finite(schema, is_productive)
    except RecursionError:
        return True


def _finite(schema, is_productive: dict) -> bool:
    if schema is False:
        return False
    if not isinstance(schema, dict):
        return True
    ref = schema.get("$ref")
    if isinstance(ref, str) and not is_productive.get(ref, True):
        return False
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options and not any(_finite(s, is_productive) for s in options):
            return False
    options = schema.get("allOf")
    if isinstance(options, list) and not all(_finite(s, is_productive) for s in options):
        return False
    kind = schema.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else None
    if kinds is None or kinds - {"object", "array"} or "enum" in schema or "const" in schema:
        return True
    return ("object" in kinds and _object_finite(schema, is_productive)) or \
        ("array" in kinds and _array_finite(schema, is_productive))


def _object_finite(schema: dict, is_productive: dict) -> bool:
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    extra = schema.get("additionalProperties", True)
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    return all(_finite(properties.get(name, extra), is_productive) for name in required if isinstance(name, str))


def _array_finite(schema: dict, is_productive: dict) -> bool:
    min_items = schema.get("minItems", 0)
    if not isinstance(min_items, int) or min_items <= 0:
        return True
    prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
    needed = prefix[:min_items] + ([schema.get("items", True)] if min_items > len(prefix) else [])
    return all(_finite(s, is_productive) for s in needed)


def _refs(schema) -> set[str]:
    """Every local `$ref` ("#" or "#/...") in the schema (iteratively: no recursion limit)."""
    refs, stack = set(), [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                refs.add(ref)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return refs


def _resolve(schema, ref: str):
    """The schema a local JSON pointer names, or None."""
    node = schema
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node

