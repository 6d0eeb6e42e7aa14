"""The tokenizer's chat template rendered under bounds (samples.serve): the same sandboxed Jinja
environment as transformers' `apply_chat_template` (its filters, globals and tags), plus a
deadline (`MAX_RENDER_S`) checked at every loop iteration, call, attribute and item access, and
a size bound (the server's `max_text_chars`) on the output and on every string or list the
template builds (repetition, concatenation, padding widths, joins), checked before it is built
where it can be. A template past either bound raises `TemplateBoundError`; callers render off
the event loop."""
from __future__ import annotations

import functools
import re
import threading
import time

from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg
from jinja2.visitor import NodeTransformer

MAX_RENDER_S = 2.0         # a real template renders in milliseconds
_SIZED = (str, list, tuple, dict)
_WIDTH = re.compile(r"%[-+ #0*]*(\d+)|\{[^{}]*?:[^{}]*?(\d+)[^{}]*\}")


class TemplateBoundError(ValueError):
    """The chat template ran past a bound (time or size)."""


_bounds = threading.local()   # this thread's render: deadline (monotonic s), max_chars


def _tick() -> None:
    if time.monotonic() > _bounds.deadline:
        raise TemplateBoundError(f"ran longer than {MAX_RENDER_S:g} s")


def _refuse_size(num: int, what: str) -> None:
    if num > _bounds.max_chars:
        raise TemplateBoundError(f"{what} of {num} characters or items, more than this server's limit of "
                                 f"{_bounds.max_chars}")


def _sized(value):
    if isinstance(value, _SIZED):
        _refuse_size(len(value), "built a value")
    return value


def _check_numbers(values) -> None:
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool):
            _refuse_size(abs(value), "asked for a width or count")


def _check_format(text) -> None:
    """The widths of a format string ('%999999999s', '{:>999999999}')."""
    if isinstance(text, str):
        for match in _WIDTH.finditer(text):
            digits = match.group(1) or match.group(2)
            _refuse_size(int(digits[:18]) if len(digits) <= 18 else 10 ** 18, "asked for a width")


def _check_amplifier(name: str, target, args: tuple) -> None:
    """sep.join(items) and s.replace(old, new) can outgrow their inputs many times over."""
    if name == "join" and isinstance(target, str) and args and isinstance(args[0], _SIZED):
        _refuse_size(len(target) * len(args[0]), "would join a value")
    if name == "replace" and isinstance(target, str) and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        _refuse_size(len(target) + (len(target) // max(len(args[0]), 1) + 1) * len(args[1]), "would replace into a value")


def _bounded_iter(iterable):
    for item in iterable:
        _tick()
        yield item


def _bounded_concat(*parts) -> str:
    texts = [str(p) for p in parts]
    _refuse_size(sum(map(len, texts)), "would concatenate a value")
    return "".join(texts)


class _BoundLoops(NodeTransformer):
    """Every `for` iterates through _bounded_iter; every `~` goes through _bounded_concat."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.Name("_bounded_iter", "load"), [node.iter], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        self.generic_visit(node)
        return nodes.Call(nodes.Name("_bounded_concat", "load"), node.nodes, [], None, None, lineno=node.lineno)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def call_binop(self, context, operator, left, right):
        _tick()
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if isinstance(sequence, _SIZED) and isinstance(count, int):
                    _refuse_size(len(sequence) * count, "would repeat a value")
        elif operator == "+" and isinstance(left, _SIZED) and isinstance(right, _SIZED):
            _refuse_size(len(left) + len(right), "would add a value")
        elif operator == "**" and isinstance(right, (int, float)) and right > 64:
            raise TemplateBoundError(f"raised a number to the power {right}")
        elif operator == "%" and isinstance(left, str):
            _check_format(left)
        return _sized(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's signature
        _tick()
        _check_numbers([*args, *kwargs.values()])
        _check_amplifier(getattr(__obj, "__name__", ""), getattr(__obj, "__self__", None), args)
        if getattr(__obj, "__name__", "") in ("format", "format_map") and isinstance(getattr(__obj, "__self__", None), str):
            _check_format(__obj.__self__)
        return _sized(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj, attribute):
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _tick()
        return super().getitem(obj, argument)


def _bounded_filter(name: str, f):
    num_leading = 2 if _PassArg.from_obj(f) is not None else 1   # (context,) value

    @functools.wraps(f)
    def bounded(*args, **kwargs):
        _tick()
        extra = args[num_leading:]
        _check_numbers([*extra, *kwargs.values()])
        if name == "format" and num_leading <= len(args):
            _check_format(args[num_leading - 1])
        value = args[num_leading - 1] if len(args) >= num_leading else None
        if name in ("join", "replace"):
            separator = extra[0] if extra else kwargs.get("d", "")
            if name == "join":
                _check_amplifier("join", separator, (value,))
            else:
                _check_amplifier("replace", value, extra)
        return _sized(f(*args, **kwargs))
    return bounded


@functools.lru_cache(maxsize=8)
def compile_template(chat_template: str):
    """A template as transformers compiles it (the same environment settings, filters, globals
    and tags), its loops and concatenations bounded, its calls checked."""
    from transformers.utils.chat_template_utils import _compile_jinja_template
    reference = _compile_jinja_template("").environment   # its settings (compiling the template there would
                                                         # fold its constants unbounded)
    env = BoundedEnvironment(trim_blocks=reference.trim_blocks, lstrip_blocks=reference.lstrip_blocks,
                             extensions=[type(e) for e in reference.extensions.values()])
    env.filters = {name: _bounded_filter(name, f) for name, f in reference.filters.items()}
    env.globals.update(reference.globals)
    env.globals.update(_bounded_iter=_bounded_iter, _bounded_concat=_bounded_concat)
    tree = _BoundLoops().visit(env.parse(chat_template))
    return env.from_string(tree)


def render_chat_template(tokenizer, messages: list[dict], max_chars: int, **variables) -> str:
    """The tokenizer's chat template over `messages` with the generation prompt (and `variables`,
    as apply_chat_template passes them: tools, special tokens), at most max_chars characters and
    MAX_RENDER_S seconds; TemplateBoundError past either, Jinja's errors as they come."""
    _bounds.deadline, _bounds.max_chars = time.monotonic() + MAX_RENDER_S, max_chars   # compiling folds constants
    template = compile_template(tokenizer.chat_template)
    context = {**tokenizer.special_tokens_map, "messages": messages, "tools": None, "documents": None,
               "add_generation_prompt": True, **variables}
    out, num_chars = [], 0
    for piece in template.generate(**context):
        num_chars += len(piece)
        _refuse_size(num_chars, "rendered a conversation")
        out.append(piece)
    return "".join(out)
