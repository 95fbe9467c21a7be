"""The `Tokenizer`: one model's text <-> ids and chat template, from a GGUF file or a Hugging
Face checkpoint directory."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from rjax.loading.loaders.errors import ModelFileError, read_json
from rjax.loading.loaders.gguf_header import open_gguf
from rjax.loading.tokenizer.chat_template import ChatTemplateError, check_chat_template, render_chat_template
from rjax.loading.tokenizer.gguf_vocab import (SUPPORTED_GGUF_MODELS, TOKEN_NORMAL, _BYTE_LEVEL_SPLITS,
                                               _GEMMA_ARCHITECTURES, _GGUFMetadata, _byte_level_backend,
                                               _sentencepiece_backend)
from rjax.loading.tokenizer.stream import StreamDecoder

# Texts at least this long are encoded without holding the interpreter lock (see `encode`).
_LONG_TEXT = 4096

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
    # Where `chat_template` came from (a file and key), as its errors name it.
    chat_template_source: str = "the chat template"
    special_tokens: Mapping[str, str | None] = field(default_factory=dict)  # bos_token, eos_token, ... as text
    special_ids: frozenset[int] = frozenset()  # ids decode(skip_special=True) drops
    byte_fallback_ids: frozenset[int] = frozenset()  # <0x00>..<0xFF> of a byte-fallback vocabulary

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader) -> Tokenizer:
        """From a GGUF file's `tokenizer.ggml.*` metadata: a `gguf.GGUFReader`, or a path to open one."""
        if isinstance(reader, (str, os.PathLike)):
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
            template_source=f"{source} (tokenizer.chat_template)",
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
        template_source = (str(template_file) if template_file.is_file()
                           else f"{root / 'tokenizer_config.json'} (chat_template)")
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
            template_source=template_source,
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
        template_source: str,
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
        if chat_template:
            try:  # a template that does not compile is a damaged file, found at load
                check_chat_template(chat_template, template_source)
            except ChatTemplateError as e:
                raise ModelFileError(str(e)) from None
        return cls(
            backend=backend,
            bos_id=bos_id,
            eos_id=eos_id,
            eos_ids=frozenset(eos_ids),
            add_bos=add_bos,
            add_eos=add_eos,
            chat_template=chat_template or None,
            chat_template_source=template_source,
            special_tokens=dict(special_tokens),
            special_ids=frozenset(i for i, t in added.items() if t.special),
            byte_fallback_ids=frozenset(byte_fallback_ids),
        )

    # -- text <-> ids --------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """No token covers more characters of input text than this: the longest token's text
        (byte-level and byte-fallback tokens spell a byte in one character or more), times 4 where
        a normalizer may first compose several characters into one."""
        longest = max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)
        return longest * (1 if self.backend.normalizer is None else 4)

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(self.encode(text)) that costs no encoding: a text too long for a
        context is refused by its length alone."""
        return -(-len(text) // self.max_chars_per_token)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. `<|im_start|>`) become
        their ids. With `add_bos=None` the model file decides (BOS, and EOS where the file asks
        for it: transformers' add_special_tokens=True); `add_bos=False` adds nothing
        (add_special_tokens=False); `add_bos=True` adds BOS only."""
        if len(text) < _LONG_TEXT:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        else:  # encode holds the interpreter lock throughout; encode_batch lets other threads run
            ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
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

    def with_chat_template(self, template: str, source: str) -> Tokenizer:
        """This tokenizer with `template` (from `source`, a file name) as its chat template.
        Raises ChatTemplateError naming `source` if the template does not compile."""
        check_chat_template(template, source)
        return dataclasses.replace(self, chat_template=template, chat_template_source=source)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The conversation rendered as the model expects it (text, to be encoded with
        `encode_chat` or `encode(..., add_bos=False)` when the template writes BOS itself).
        A template that fails, or runs past its limits of size and time, raises ChatTemplateError
        naming the template's source and the message it failed on."""
        if self.chat_template is None:
            raise ValueError("the model file has no chat template (a base model): give one, or use raw text")
        context = {name: value for name, value in self.special_tokens.items()}
        context.update(tools=None, documents=None)
        context.update(extra)
        return render_chat_template(self.chat_template, self.chat_template_source, [dict(m) for m in messages],
                                    add_generation_prompt=add_generation_prompt, **context)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **extra: Any) -> list[int]:
        """Ids of the rendered conversation (`extra`: template variables, such as `tools`). Like
        transformers' apply_chat_template(tokenize=True), no BOS/EOS is added around the
        template's text: the template writes what it needs."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra), add_bos=False)


# --- small helpers -----------------------------------------------------------------------------


def _is_id(value, n_ids: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n_ids


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    value = read_json(path)
    if not isinstance(value, dict):
        raise ModelFileError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _find_sublist(haystack: list[int], needle: list[int]) -> int:
    for start in range(len(haystack) - len(needle) + 1):
        if haystack[start:start + len(needle)] == needle:
            return start
    return 0
