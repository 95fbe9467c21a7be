"""Chat templates: the jinja2 environment Hugging Face templates expect. A model file without
a template gets none (a base model: rjax generate and chat say so and complete raw text): a
guessed template makes a base model answer with garbage, silently."""

from __future__ import annotations

import ctypes
import functools
import json
import re
import threading
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.nodes
import jinja2.runtime
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _render_content(content: Any) -> str:
    """A message's content as text: a string, or the text parts of an OpenAI-style list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping) and part.get("type") == "text")
    return "" if content is None else str(content)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text in some HF templates; render it as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters, which no chat format wants.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# A template is code from a model file (or a user's --chat-template). The sandbox stops it from
# reaching Python's internals; these bound what it may spend: characters in any one value it
# builds and in its output, and seconds of rendering.
MAX_RENDER_CHARS = 1 << 22
RENDER_TIMEOUT_S = 5.0
_WIDE_FORMAT = re.compile(r"\d{7,}")  # a field width or precision of a million or more


class ChatTemplateError(ValueError):
    """A chat template that does not compile, or cannot render a conversation: the message names
    the template (its file) and, where one is to blame, the message index."""


class _TemplateLimit(jinja2.exceptions.TemplateRuntimeError):
    pass


class _RenderTimeout(BaseException):
    """Raised inside a render that runs past its time (a BaseException: no template catches it)."""


def _size(value) -> int:
    return len(value) if isinstance(value, (str, list, tuple, dict)) else 0


def _check(size: int, what: str) -> None:
    if size > MAX_RENDER_CHARS:
        raise _TemplateLimit(f"{what} would hold {size:,} items or characters, more than the "
                             f"{MAX_RENDER_CHARS:,} a chat template may build")


def _check_arguments(name: str, subject, args, kwargs) -> None:
    """Refuse a call that would build an outsized value before it runs: a width or count past the
    limit, a format with a huge field width, a join or replace whose result is past the limit."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_RENDER_CHARS:
            raise _TemplateLimit(f"{name}() was given {value:,}, past the {MAX_RENDER_CHARS:,} a chat template "
                                 f"may use as a size")
        if isinstance(value, str) and name in ("format", "format_map") and _WIDE_FORMAT.search(value):
            raise _TemplateLimit(f"{name}() was given a format with a field of a million characters or more")
    if isinstance(subject, str) and name in ("format", "format_map", "center", "ljust", "rjust", "zfill") \
            and _WIDE_FORMAT.search(subject):
        raise _TemplateLimit(f"{name}() on a format with a field of a million characters or more")
    if name == "join":
        sep, items = (subject, args[0]) if isinstance(subject, str) and args else (args[0] if args else "", subject)
        if isinstance(items, (list, tuple)) and isinstance(sep, str):
            _check(sum(_size(x) or 8 for x in items) + len(sep) * len(items), "join()")
    if name == "replace" and isinstance(subject, str) and len(args) >= 2 and isinstance(args[1], str):
        _check(len(subject) * (len(args[1]) + 1), "replace()")


def _checked_filter(name: str, fn):
    @functools.wraps(fn)
    def checked(*args, **kwargs):
        values = [a for a in args if not isinstance(a, (jinja2.runtime.Context, jinja2.Environment,
                                                         jinja2.nodes.EvalContext))]
        _check_arguments(name, values[0] if values else None, values[1:], kwargs)
        result = fn(*args, **kwargs)
        _check(_size(result), f"the filter {name!r}")
        return result

    return checked


class _Codegen(jinja2.compiler.CodeGenerator):
    """`a ~ b` joins through the environment, so its size is checked like `a + b`."""

    def visit_Concat(self, node, frame):
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    code_generator_class = _Codegen
    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def call_binop(self, context, operator, left, right):
        if operator == "*" and isinstance(right, int) and _size(left):
            _check(_size(left) * right, "a repetition")
        elif operator == "*" and isinstance(left, int) and _size(right):
            _check(_size(right) * left, "a repetition")
        elif operator == "+":
            _check(_size(left) + _size(right), "a concatenation")
        elif operator == "**" and isinstance(right, (int, float)) and abs(right) > 1024 and left not in (0, 1, -1):
            raise _TemplateLimit(f"a power of {right!r:.40} is more than a chat template may compute")
        elif operator == "%" and isinstance(left, str) and _WIDE_FORMAT.search(left):
            raise _TemplateLimit("a % format with a field of a million characters or more")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (the sandbox's own signature)
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        _check_arguments(getattr(method, "__name__", ""), getattr(method, "__self__", None), args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        _check(_size(result), f"{getattr(__obj, '__name__', 'a call')}()")
        return result

    @staticmethod
    def concat(values) -> str:
        parts = [str(v) for v in values]
        _check(sum(map(len, parts)), "a ~ concatenation")
        return "".join(parts)


@lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled as Hugging Face does: sandboxed, trim_blocks + lstrip_blocks,
    loop controls, and the helpers templates call (raise_exception, strftime_now, tojson); with
    limits on the size of what it builds (see `render_chat_template` for the rest)."""
    env = _LimitedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.filters.update({name: _checked_filter(name, fn) for name, fn in env.filters.items()})
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["render_content"] = _render_content
    return env.from_string(source)


def check_chat_template(source: str, name: str) -> None:
    """Compile `source` now; a ChatTemplateError naming `name` (where it came from) if it does not."""
    try:
        compile_chat_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{name}: the chat template does not compile: line {e.lineno}: {e.message}") from None
    except (RecursionError, MemoryError, jinja2.TemplateError) as e:
        raise ChatTemplateError(f"{name}: the chat template does not compile: {type(e).__name__}: {e}") from None


def _render_limited(template: jinja2.Template, context: dict) -> str:
    """The template's text, rendered on a thread of its own so that a render past RENDER_TIMEOUT_S
    can be stopped (an exception raised into that thread) and its output bounded as it grows."""
    out: list[str] = []
    failure: list[BaseException] = []

    def run():
        try:
            size = 0
            for chunk in template.generate(**context):
                size += len(chunk)
                _check(size, "the rendered conversation")
                out.append(chunk)
        except BaseException as e:  # noqa: BLE001 (handed to the caller)
            failure.append(e)

    thread = threading.Thread(target=run, name="rjax-chat-template", daemon=True)
    thread.start()
    thread.join(RENDER_TIMEOUT_S)
    if thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_RenderTimeout))
        thread.join(1.0)
        raise _TemplateLimit(f"rendering took more than {RENDER_TIMEOUT_S:g} s")
    if failure:
        if isinstance(failure[0], _RenderTimeout):
            raise _TemplateLimit(f"rendering took more than {RENDER_TIMEOUT_S:g} s")
        raise failure[0]
    return "".join(out)


def _describe(e: BaseException) -> str:
    if isinstance(e, (_TemplateLimit, jinja2.TemplateError)) and str(e):
        return str(e)
    if isinstance(e, RecursionError):
        return "it recursed too deeply"
    return f"{type(e).__name__}: {e}"[:400]


def render_chat_template(source: str, name: str, messages: list[dict], **context) -> str:
    """`source` rendered over `messages`, or a ChatTemplateError naming `name` (the template's
    origin), the message it failed on (found by rendering shorter conversations) and why."""
    check_chat_template(source, name)
    template = compile_chat_template(source)
    try:
        return _render_limited(template, dict(context, messages=messages))
    except Exception as e:  # noqa: BLE001 (a template can raise anything its operations raise)
        error = e
    where = ""
    if not isinstance(error, _TemplateLimit):  # a quick failure: find the first message it fails on
        for k in range(1, len(messages)):
            try:
                _render_limited(template, dict(context, messages=messages[:k], add_generation_prompt=False))
            except Exception:  # noqa: BLE001
                where = f" at message {k - 1} (role {messages[k - 1].get('role')!r:.40})"
                break
        else:
            where = f" at message {len(messages) - 1} (role {messages[-1].get('role')!r:.40})" if messages else ""
    raise ChatTemplateError(f"{name}: the chat template failed{where}: {_describe(error)}") from None
