"""Chat templates: the jinja2 environment Hugging Face templates expect, and the built-in
templates for a model file that carries none."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rjax.tokenizer.gguf_vocab import _GEMMA_ARCHITECTURES

# Gemma's turn format, used when a Gemma GGUF carries no template (gemma-3-270m has none). The
# system message, if any, is prepended to the first user turn; the assistant's role is "model".
GEMMA_FALLBACK_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system_prefix = render_content(messages[0]['content']) + '\n\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set system_prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Gemma chat roles must alternate user/assistant/user/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (system_prefix if loop.first else '') }}"
    "{{ render_content(message['content']) | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

# ChatML, for a vocabulary that has <|im_start|>/<|im_end|> but no template.
CHATML_FALLBACK_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + render_content(message['content']) + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


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


@lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled as Hugging Face does: sandboxed, trim_blocks + lstrip_blocks,
    loop controls, and the helpers templates call (raise_exception, strftime_now, tojson)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["render_content"] = _render_content
    return env.from_string(source)


def _fallback_template(architecture: str, backend: tokenizers.Tokenizer, special_texts: set[str]) -> str | None:
    """A built-in chat template for a model file that has none: Gemma's turn format for the Gemma
    family, ChatML for a vocabulary with <|im_start|>/<|im_end|> special tokens, else none."""
    if architecture.split("_")[0] in _GEMMA_ARCHITECTURES and backend.token_to_id("<start_of_turn>") is not None:
        return GEMMA_FALLBACK_TEMPLATE
    if {"<|im_start|>", "<|im_end|>"} <= special_texts:
        return CHATML_FALLBACK_TEMPLATE
    return None
