"""Tokenizer and chat template, built from GGUF metadata or a Hugging Face checkpoint directory.

The text <-> ids work is done by the `tokenizers` library; this module only assembles a
`tokenizers.Tokenizer` from what a GGUF file stores (`tokenizer.ggml.*`), adds BOS/EOS handling,
chat templates (jinja2, sandboxed, with the helpers Hugging Face templates expect) and an
incremental decoder for streaming.

The GGUF assembly follows what transformers builds from the same file, because transformers is
the reference the tests compare against. Where transformers and llama.cpp differ, transformers
wins (see `_BYTE_LEVEL_SPLITS` for the one difference that shows on real text).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import numpy as np
import tokenizers
from gguf import GGUFValueType
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from rjax.loaders.errors import ModelFileError

log = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

SUPPORTED_GGUF_MODELS = ("gpt2", "llama")

# --- byte-level (GPT-2 style) pre-tokenizer splits, by `tokenizer.ggml.pre` ---------------------

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# None means the GPT-2 rule built into the ByteLevel pre-tokenizer.
# `smollm` (and the starcoder family): llama.cpp and the original SmolLM2 tokenizer.json first cut
# every digit out on its own (`\p{N}`), then apply the GPT-2 rule. transformers' GGUF loader does
# not, and the two differ on whitespace runs before digits ("x  12": transformers gives
# "x", " ", " 12" -> Ġ Ġ 1 2; the digit-first rule gives "x", "  ", "1", "2" -> ĠĠ 1 2). We match
# transformers, the reference the tests use.
_BYTE_LEVEL_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt2": None,
    "gpt-2": None,
    "smollm": None,
    "starcoder": None,
    "refact": None,
    "mpt": None,
    "olmo": None,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}

# Architectures whose sentencepiece GGUF follows Gemma's conventions (see `_sentencepiece_backend`).
_GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3", "gemma3n"})

# Control tokens that end a turn in common chat formats: generation stops on them as on EOS.
_END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|return|>",
)


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, as byte-level BPE vocabularies spell bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


# --- chat templates ----------------------------------------------------------------------------

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


# --- the tokenizer -----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Tokenizer:
    """Text <-> token ids for one model, plus its chat template. Host-side; never traced.

    `backend` does the work; the fields record what the model file says about BOS/EOS and turns.
    Build one with `Tokenizer.from_gguf` or `Tokenizer.from_hf_dir`.
    """

    backend: tokenizers.Tokenizer
    bos_id: int | None
    eos_id: int | None
    eos_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    # True when `chat_template` is a built-in fallback, not one from the model file.
    chat_template_is_fallback: bool = False
    special_tokens: Mapping[str, str | None] = field(default_factory=dict)  # bos_token, eos_token, ... as text
    special_ids: frozenset[int] = frozenset()  # ids decode(skip_special=True) drops
    byte_fallback_ids: frozenset[int] = frozenset()  # <0x00>..<0xFF> of a byte-fallback vocabulary

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader) -> Tokenizer:
        """From a GGUF file's `tokenizer.ggml.*` metadata: a `gguf.GGUFReader`, or a path to open one."""
        if isinstance(reader, (str, os.PathLike)):
            from rjax.loaders.gguf import open_gguf

            reader = open_gguf(reader)
        source = getattr(getattr(reader, "data", None), "filename", None) or "<gguf>"  # the memory-mapped file
        meta = _GGUFMetadata(reader, source)
        kind = meta.typed("tokenizer.ggml.model", str)
        architecture = meta.typed("general.architecture", str, "")
        tokens = meta.strings("tokenizer.ggml.tokens")
        if not tokens:
            meta.fail("tokenizer.ggml.tokens", "is missing" if tokens is None else "is empty")
        token_types = meta.array("tokenizer.ggml.token_type", len(tokens))
        if token_types is None:
            token_types = np.full(len(tokens), TOKEN_NORMAL, dtype=np.int32)
        if kind == "gpt2":
            pre = meta.typed("tokenizer.ggml.pre", str, "default")
            if pre not in _BYTE_LEVEL_SPLITS:
                meta.fail("tokenizer.ggml.pre", f"{pre!r} is not supported; supported: {sorted(_BYTE_LEVEL_SPLITS)}")
            merges = meta.strings("tokenizer.ggml.merges")
            if merges is None:
                meta.fail("tokenizer.ggml.merges", "is missing; a gpt2 tokenizer needs it")

            def build():
                return _byte_level_backend(tokens, token_types, merges, _BYTE_LEVEL_SPLITS[pre])

            default_add_bos = False
        elif kind == "llama":
            scores = meta.array("tokenizer.ggml.scores", len(tokens))
            unk_id = meta.token_id("tokenizer.ggml.unknown_token_id", len(tokens))
            add_space_prefix = meta.typed("tokenizer.ggml.add_space_prefix", bool, True)
            if scores is None and architecture not in _GEMMA_ARCHITECTURES:
                meta.fail("tokenizer.ggml.scores", "is missing; a sentencepiece (llama) tokenizer needs it")

            def build():
                return _sentencepiece_backend(tokens, token_types, scores, unk_id=unk_id,
                                              add_space_prefix=add_space_prefix,
                                              gemma=architecture in _GEMMA_ARCHITECTURES)

            # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
            default_add_bos = True
        else:
            meta.fail("tokenizer.ggml.model",
                      f"{kind!r} is not supported; supported: {list(SUPPORTED_GGUF_MODELS)}")
        try:  # the tokenizers library refuses a damaged vocabulary with a bare Exception
            backend = build()
        except Exception as e:  # noqa: BLE001
            raise ModelFileError(f"{source}: the {kind} vocabulary (tokenizer.ggml.tokens"
                                 f"{', merges' if kind == 'gpt2' else ''}) does not make a tokenizer: {e}") from e

        def token_text(index: int | None) -> str | None:
            return None if index is None else tokens[index]

        bos_id = meta.token_id("tokenizer.ggml.bos_token_id", len(tokens))
        eos_id = meta.token_id("tokenizer.ggml.eos_token_id", len(tokens))
        marked = {meta.token_id("tokenizer.ggml.eot_token_id", len(tokens)),
                  meta.token_id("tokenizer.ggml.eom_token_id", len(tokens)), eos_id}
        specials = {
            "bos_token": token_text(bos_id),
            "eos_token": token_text(eos_id),
            "unk_token": token_text(meta.token_id("tokenizer.ggml.unknown_token_id", len(tokens))),
            "pad_token": token_text(meta.token_id("tokenizer.ggml.padding_token_id", len(tokens))),
        }
        template = meta.typed("tokenizer.chat_template", str)
        return cls._assemble(
            backend,
            bos_id=bos_id,
            eos_id=eos_id,
            marked_eos={i for i in marked if i is not None},
            add_bos=meta.typed("tokenizer.ggml.add_bos_token", bool, default_add_bos),
            add_eos=meta.typed("tokenizer.ggml.add_eos_token", bool, False),
            chat_template=template,
            architecture=architecture,
            special_tokens=specials,
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """From a Hugging Face checkpoint directory: tokenizer.json, tokenizer_config.json,
        chat_template.jinja (when present), generation_config.json and config.json for EOS ids."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelFileError(f"{root}: no tokenizer.json (only fast-tokenizer checkpoints are supported)")
        try:  # the tokenizers library refuses a damaged file with a bare Exception
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # noqa: BLE001
            raise ModelFileError(f"{tokenizer_file}: not a tokenizer the tokenizers library can read: {e}") from e
        tok_config = _read_json(root / "tokenizer_config.json")
        gen_config = _read_json(root / "generation_config.json")
        model_config = _read_json(root / "config.json")
        n_ids = backend.get_vocab_size(with_added_tokens=True)

        def token_name(value) -> str | None:
            value = value.get("content") if isinstance(value, Mapping) else value
            return value if isinstance(value, str) else None

        specials = {name: token_name(tok_config.get(name)) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}

        def first_id(*candidates) -> int | None:
            for value in candidates:
                if isinstance(value, list):
                    value = value[0] if value else None
                if isinstance(value, str):
                    value = backend.token_to_id(value)
                if _is_id(value, n_ids):
                    return value
            return None

        bos_id = first_id(specials["bos_token"], gen_config.get("bos_token_id"), model_config.get("bos_token_id"))
        eos_id = first_id(specials["eos_token"], gen_config.get("eos_token_id"), model_config.get("eos_token_id"))
        marked = {eos_id}
        for source in (gen_config.get("eos_token_id"), model_config.get("eos_token_id")):
            marked.update(i for i in (source if isinstance(source, list) else [source]) if _is_id(i, n_ids))
        if specials["bos_token"] is None and bos_id is not None:
            specials["bos_token"] = backend.id_to_token(bos_id)
        if specials["eos_token"] is None and eos_id is not None:
            specials["eos_token"] = backend.id_to_token(eos_id)

        # What the file's post-processor adds around a text, unless the config states it.
        probe_plain = backend.encode("a", add_special_tokens=False).ids
        probe_full = backend.encode("a", add_special_tokens=True).ids
        start = _find_sublist(probe_full, probe_plain)
        added_before, added_after = probe_full[:start], probe_full[start + len(probe_plain):]
        add_bos = tok_config.get("add_bos_token", bos_id is not None and added_before == [bos_id])
        add_eos = tok_config.get("add_eos_token", eos_id is not None and added_after == [eos_id])

        template_file = root / "chat_template.jinja"
        try:
            template = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                        else tok_config.get("chat_template"))
        except UnicodeDecodeError as e:
            raise ModelFileError(f"{template_file}: not UTF-8 text ({e})") from e
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template
                     if isinstance(t, Mapping) and isinstance(t.get("name"), str)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise ModelFileError(f"{root / 'tokenizer_config.json'}: chat_template = {template!r:.80} is not a string")
        return cls._assemble(
            backend,
            bos_id=bos_id,
            eos_id=eos_id,
            marked_eos={i for i in marked if isinstance(i, int)},
            add_bos=bool(add_bos) and bos_id is not None,
            add_eos=bool(add_eos) and eos_id is not None,
            chat_template=template,
            architecture=str(model_config.get("model_type", "")),
            special_tokens=specials,
        )

    @classmethod
    def _assemble(
        cls,
        backend: tokenizers.Tokenizer,
        *,
        bos_id: int | None,
        eos_id: int | None,
        marked_eos: set[int],
        add_bos: bool,
        add_eos: bool,
        chat_template: str | None,
        architecture: str,
        special_tokens: Mapping[str, str | None],
    ) -> Tokenizer:
        added = backend.get_added_tokens_decoder()
        special_texts = {t.content for t in added.values() if t.special}
        byte_fallback_ids = set()
        if getattr(backend.model, "byte_fallback", False):
            byte_fallback_ids = {backend.token_to_id(f"<0x{b:02X}>") for b in range(256)} - {None}
        eos_ids = set(marked_eos)
        for text in _END_OF_TURN_TOKENS:
            index = backend.token_to_id(text)
            if index is not None and text in special_texts:
                eos_ids.add(index)
        is_fallback = False
        if not chat_template:
            chat_template = _fallback_template(architecture, backend, special_texts)
            is_fallback = chat_template is not None
        return cls(
            backend=backend,
            bos_id=bos_id,
            eos_id=eos_id,
            eos_ids=frozenset(eos_ids),
            add_bos=add_bos,
            add_eos=add_eos,
            chat_template=chat_template,
            chat_template_is_fallback=is_fallback,
            special_tokens=dict(special_tokens),
            special_ids=frozenset(i for i, t in added.items() if t.special),
            byte_fallback_ids=frozenset(byte_fallback_ids),
        )

    # -- text <-> ids --------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. `<|im_start|>`) become
        their ids. With `add_bos=None` the model file decides (BOS, and EOS where the file asks
        for it: transformers' add_special_tokens=True); `add_bos=False` adds nothing
        (add_special_tokens=False); `add_bos=True` adds BOS only."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        if add_bos is None and self.add_eos and self.eos_id is not None:
            ids = [*ids, self.eos_id]
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids`; special tokens are dropped when `skip_special`."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, index: int) -> str | None:
        return self.backend.id_to_token(int(index))

    def stream_decoder(self, skip_special: bool = True) -> StreamDecoder:
        """A fresh incremental decoder for one generated sequence."""
        return StreamDecoder(self, skip_special=skip_special)

    # -- chat ----------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The conversation rendered as the model expects it (text, to be encoded with
        `encode_chat` or `encode(..., add_bos=False)` when the template writes BOS itself)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template, and no built-in one fits its vocabulary")
        context = {name: value for name, value in self.special_tokens.items()}
        context.update(tools=None, documents=None)
        context.update(extra)
        return compile_chat_template(self.chat_template).render(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **context
        )

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Ids of the rendered conversation. Like transformers' apply_chat_template(tokenize=True),
        no BOS/EOS is added around the template's text: the template writes what it needs."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_bos=False)


class StreamDecoder:
    """Incremental detokenization: feed ids one at a time, get text as soon as it is whole.

    Text is emitted only when the decoded tail does not end in U+FFFD, so a character spread over
    several byte tokens (an emoji) comes out once, complete. Each step decodes only a window that
    starts at the last emitted token boundary, so a step costs O(window), not O(sequence).
    The concatenation of every `add` result and `flush()` equals `tokenizer.decode(all_ids)`,
    invalid byte sequences included: a sentencepiece byte-fallback vocabulary decodes a run of
    byte tokens all at once (one bad byte turns the whole run into U+FFFD), so such a run is held
    until a token that is not a byte ends it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._ids: list[int] = []
        self._prefix = 0  # window start: first id of the last emitted chunk's window
        self._read = 0  # ids before this are fully emitted
        self._last_visible: int | None = None  # last id that decode keeps

    @property
    def ids(self) -> list[int]:
        return list(self._ids)

    def _window_text(self, start: int, stop: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special=self._skip_special)

    def add(self, token_id: int) -> str:
        """Add one id; return the text that became complete ("" while a character is still partial)."""
        token_id = int(token_id)
        self._ids.append(token_id)
        if not (self._skip_special and token_id in self._tokenizer.special_ids):
            self._last_visible = token_id
        if self._last_visible in self._tokenizer.byte_fallback_ids:
            return ""
        seen = self._window_text(self._prefix, self._read)
        text = self._window_text(self._prefix)
        if len(text) > len(seen) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(seen):]
        return ""

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """Whatever is still held back (a partial character at the end decodes as U+FFFD, as in decode)."""
        seen = self._window_text(self._prefix, self._read)
        text = self._window_text(self._prefix)
        self._prefix = self._read = len(self._ids)
        return text[len(seen):]


# --- GGUF assembly -----------------------------------------------------------------------------


_TYPE_NAMES = {str: "a string", int: "an integer", bool: "a bool"}


class _GGUFMetadata:
    """Typed access to a GGUFReader's key/value fields; a value that cannot be read or has the
    wrong type is a ModelFileError naming the file and the key."""

    def __init__(self, reader, source):
        self._fields = reader.fields
        self._source = source

    def fail(self, key: str, problem: str):
        raise ModelFileError(f"{self._source}: {key} {problem}")

    def get(self, key: str, default=None):
        f = self._fields.get(key)
        if f is None:
            return default
        try:
            value = f.contents()
        except Exception as e:  # noqa: BLE001 - e.g. a string that is not UTF-8
            self.fail(key, f"cannot be read ({type(e).__name__}: {e})")
        return default if value is None else value

    def typed(self, key: str, kind: type, default=None):
        """A str, an int (not a bool) or a bool (an integer 0/1 too) value, or `default` if absent."""
        value = self.get(key)
        if value is None:
            return default
        if kind is bool and isinstance(value, int) and value in (0, 1):
            return bool(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            self.fail(key, f"= {value!r:.80} is not {_TYPE_NAMES[kind]}")
        return value

    def token_id(self, key: str, n_tokens: int) -> int | None:
        """A token id; one outside the vocabulary is ignored with a warning, as llama.cpp does."""
        value = self.typed(key, int)
        if value is not None and not 0 <= value < n_tokens:
            log.warning("%s: %s = %d is outside the vocabulary of %d tokens; ignored", self._source, key, value,
                        n_tokens)
            return None
        return value

    def strings(self, key: str) -> list[str] | None:
        f = self._fields.get(key)
        if f is None:
            return None
        if not f.types or f.types[0] != GGUFValueType.ARRAY or (f.data and f.types[-1] != GGUFValueType.STRING):
            self.fail(key, "is not an array of strings")
        out = []
        for n, i in enumerate(f.data):
            try:
                out.append(bytes(f.parts[i]).decode("utf-8"))
            except UnicodeDecodeError as e:
                self.fail(key, f"entry {n} is not UTF-8 ({e.reason} at byte {e.start})")
        return out

    def array(self, key: str, length: int) -> np.ndarray | None:
        """A numeric array of `length` items, or None if absent."""
        f = self._fields.get(key)
        if f is None:
            return None
        if not f.types or f.types[0] != GGUFValueType.ARRAY or (
                f.data and f.types[-1] in (GGUFValueType.STRING, GGUFValueType.ARRAY)):
            self.fail(key, "is not an array of numbers")
        values = np.asarray(self.get(key))
        if values.shape != (length,):
            self.fail(key, f"has {values.size} entries for {length} tokens")
        return values


def _is_id(value, n_ids: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n_ids


def _byte_level_backend(
    tokens: list[str], token_types: np.ndarray, merges: list[str], split: str | None
) -> tokenizers.Tokenizer:
    """GPT-2 style byte-level BPE with the file's merges."""
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    # Tokens written with characters outside the byte alphabet are respelled byte by byte.
    vocab = {
        (t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))): i for i, t in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a mislabel in the file (llama.cpp's
    # converter) and is left a plain vocabulary entry, as transformers does.
    _add_marked_tokens(backend, tokens, token_types, vocab, lambda t: set(t) <= spelled)
    return backend


def _sentencepiece_backend(
    tokens: list[str],
    token_types: np.ndarray,
    scores: np.ndarray | None,
    *,
    unk_id: int | None,
    add_space_prefix: bool,
    gemma: bool,
) -> tokenizers.Tokenizer:
    """SentencePiece-style BPE over "▁"-for-space pieces, with byte fallback.

    GGUF stores no merges for these; they are recovered from the vocabulary: every way to cut a
    token into two tokens is a merge, ranked by the merged token's priority. Gemma files need two
    fixes: their tokens of several spaces are stored as real spaces (respelled "▁▁…" to be reachable),
    and their priority is the token's position in the file, which (unlike their scores) follows
    the merge order.
    """
    stored = tokens
    if gemma:
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        priority = {t: -i for i, t in enumerate(tokens)}
    else:
        if scores is None:
            raise ValueError("a sentencepiece (llama) GGUF tokenizer needs tokenizer.ggml.scores, which the file lacks")
        priority = {t: float(s) for t, s in zip(tokens, scores)}
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_from_vocab(vocab, priority),
            unk_token=tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", "▁")
    else:
        scheme = "first" if add_space_prefix else "never"
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
        if add_space_prefix:
            steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    # Looked up by their stored spelling: the respelled space runs are then not added tokens, so
    # BPE builds them, as in transformers.
    _add_marked_tokens(backend, stored, token_types, vocab, lambda t: True)
    return backend


def _merges_from_vocab(vocab: dict[str, int], priority: dict[str, float]) -> list[tuple[str, str]]:
    """Every (left, right) with left, right and left+right in the vocabulary, best merged token
    first; ties by longer left part, then longer right part, then vocabulary order (the order
    transformers gives them, which decides between two cuts of the same token)."""
    ranked = []
    for token, score in priority.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, -cut, cut - len(token), left, right))
    ranked.sort(key=lambda r: r[:3])  # stable: equal keys keep vocabulary order
    return [(r[3], r[4]) for r in ranked]


def _add_marked_tokens(backend, tokens, token_types, vocab, eligible) -> None:
    """CONTROL tokens match whole in the text as special tokens; USER_DEFINED ones match whole
    as plain added tokens (like llama.cpp), otherwise BPE would cut them into pieces."""
    types = np.asarray(token_types)
    control = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i in np.flatnonzero(types == TOKEN_CONTROL)
        if eligible(tokens[i])
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i in np.flatnonzero(types == TOKEN_USER_DEFINED)
        if tokens[i] in vocab
    ]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def _fallback_template(architecture: str, backend: tokenizers.Tokenizer, special_texts: set[str]) -> str | None:
    """A built-in chat template for a model file that has none: Gemma's turn format for the Gemma
    family, ChatML for a vocabulary with <|im_start|>/<|im_end|> special tokens, else none."""
    if architecture.split("_")[0] in _GEMMA_ARCHITECTURES and backend.token_to_id("<start_of_turn>") is not None:
        return GEMMA_FALLBACK_TEMPLATE
    if {"<|im_start|>", "<|im_end|>"} <= special_texts:
        return CHATML_FALLBACK_TEMPLATE
    return None


# --- small helpers -----------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise ModelFileError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _find_sublist(haystack: list[int], needle: list[int]) -> int:
    for start in range(len(haystack) - len(needle) + 1):
        if haystack[start:start + len(needle)] == needle:
            return start
    return 0
