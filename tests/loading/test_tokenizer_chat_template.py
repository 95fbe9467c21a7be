"""Chat templates are code from a model file: every way one can fail ends in a ChatTemplateError
that names the template's source (and the message it failed on, where one is to blame), within
bounded time and memory; never a bare jinja2 exception, a RecursionError or an out-of-memory kill."""
from __future__ import annotations

import resource
import time

import pytest

from rjax.loading.tokenizer import ChatTemplateError, chat_template
from rjax.loading.tokenizer.chat_template import check_chat_template, render_chat_template

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
NAME = "/models/x/chat_template.jinja"
LIMIT = f"{chat_template.MAX_RENDER_CHARS:,}"


def _render(source, messages=MESSAGES):
    return render_chat_template(source, NAME, messages, add_generation_prompt=True)


def test_a_plain_template_renders():
    assert _render("{% for m in messages %}{{ m.role }}:{{ m['content'] ~ '|' }}{% endfor %}") == \
        "system:be brief|user:hi|assistant:hello|user:again|"


@pytest.mark.parametrize("source, message", [
    # failures of the template's own logic, each at the message that triggers it
    ("{% for m in messages %}{% if m.role == 'assistant' %}{{ raise_exception('no assistant turns') }}"
     "{% endif %}{% endfor %}", r"at message 2 \(role 'assistant'\): no assistant turns"),
    ("{% for m in messages %}{{ m.content + loop.index }}{% endfor %}",
     r"at message 0 \(role 'system'\): TypeError: can only concatenate str"),
    ("{{ messages[9].content }}", r"at message 0 .*: list object has no element 9"),
    ("{{ undefined_thing.attr }}", r"'undefined_thing' is undefined"),
    ("{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}", r"it recursed too deeply"),
    # the sandbox
    ("{{ ''.__class__.__mro__ }}", r"access to attribute '__class__' of 'str' object is unsafe"),
    ("{{ messages.append(1) }}", r"unsafe"),
    # values past the size limit, refused before they are built
    ("{{ 'a' * 10 ** 10 }}", rf"a repetition would hold 10,000,000,000 .* more than the {LIMIT}"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     r"a ~ concatenation would hold"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     r"a concatenation would hold"),
    ("{{ 'a' | center(10 ** 9) }}", r"center\(\) was given 1,000,000,000"),
    ("{{ 'a'.ljust(10 ** 9) }}", r"ljust\(\) was given 1,000,000,000"),
    ("{{ '%1000000000d' % 1 }}", r"a % format with a field of a million"),
    ("{{ '{:>1000000000}'.format(1) }}", r"format\(\) on a format with a field of a million"),
    ("{{ (['x' * 1000000] * 1000) | join }}", r"join\(\) would hold 1,000,000,000"),
    ("{{ ('x' * 1000000) | replace('x', 'yyyyyyyyyy') }}", r"replace\(\) would hold 11,000,000"),
    # output past the limit, stopped as it grows
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", r"the rendered conversation would hold"),
])
def test_a_failing_template_is_a_chat_template_error_naming_it(source, message):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=rf"^{NAME}: the chat template failed.*{message}"):
        _render(source)
    assert time.perf_counter() - start < 2.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 << 10  # KiB: nothing large was built


def test_a_render_past_its_time_is_stopped(monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_TIMEOUT_S", 0.3)
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=rf"^{NAME}: the chat template failed: rendering took more than 0.3 s"):
        _render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    assert time.perf_counter() - start < 2.0
    assert _render("{{ messages | length }}") == "4"  # the next render is unaffected


@pytest.mark.parametrize("source, message", [
    ("{% for m in messages %}{{ m.content }}", r"line 1: Unexpected end of template"),
    ("{{ messages }", r"line 1: unexpected '}'"),
    ("\n\n{% if %}", r"line 3: Expected an expression"),
    ("{{" + "(" * 5000 + "1" + ")" * 5000 + "}}", r"RecursionError"),
])
def test_a_template_that_does_not_compile_is_named(source, message):
    with pytest.raises(ChatTemplateError, match=rf"^{NAME}: the chat template does not compile: {message}"):
        check_chat_template(source, NAME)
