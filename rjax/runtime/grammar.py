"""Constrained decoding: JSON schemas, regular expressions and grammars as token masks, by
llguidance (its automaton walks the tokenizer's trie lazily, so a schema compiles in tens of
milliseconds and a mask over a 49k vocabulary takes tens of microseconds; no torch).

`Grammars(tokenizer, vocab_size, eos_ids)` builds llguidance's view of the tokenizer once (a few
seconds) and compiles each grammar once (cached by its text); `constraint(kind, spec)` -> a
fresh `Constraint` for one sequence, which the serving engine asks for the mask of allowed next
tokens (a bitmask: bit i of word i // 32 is token i) and tells each token it generates.
"""
from __future__ import annotations

import collections
import json
import threading
from typing import Any

import numpy as np

# What a request may constrain by: a JSON schema (dict, or True for any JSON object), a regular
# expression (Rust regex syntax), a grammar (Lark, or llama.cpp's GBNF), or llguidance's Lark.
KINDS = ("json_schema", "regex", "grammar", "lark")


class GrammarError(ValueError):
    """A schema, regex or grammar that llguidance cannot compile; the message says why."""


def mask_words(vocab_size: int) -> int:
    """int32 words of one token bitmask."""
    return (vocab_size + 31) // 32


class Constraint:
    """One sequence's automaton: `mask()` -> int32 [mask_words] of the tokens allowed next;
    `advance(token)` after each generated token (False once the token broke the grammar, which
    the mask prevents; a token after the grammar ended, such as the stop token, is ignored)."""

    def __init__(self, matcher, words: int, eos_ids):
        self._m, self._words, self._eos = matcher, words, eos_ids

    def mask(self) -> np.ndarray:
        import llguidance.numpy as lln

        out = np.zeros((1, self._words), np.int32)
        if self._m.is_stopped():   # complete: only the end of the sequence is left
            for t in self._eos:
                out[0, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
            return out[0]
        lln.fill_next_token_bitmask(self._m, out)
        return out[0]

    def advance(self, token: int) -> bool:
        if self._m.is_stopped():
            return True
        return self._m.consume_token(int(token))

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()


class Grammars:
    """Compiled grammars over one tokenizer (thread-safe)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, cache_size: int = 256):
        self._tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, sorted(int(i) for i in eos_ids)
        self._ll = None
        self._lock = threading.Lock()
        self._compiled: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._cache_size = cache_size
        self.words = mask_words(vocab_size)

    def _ll_tokenizer(self):
        with self._lock:
            if self._ll is None:
                import llguidance

                self._ll = llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self._vocab_size,
                                                  eos_token=self._eos)
            return self._ll

    def prepare(self) -> None:
        """Build llguidance's tokenizer now (seconds) rather than on the first constrained request."""
        self._ll_tokenizer()

    def constraint(self, kind: str, spec) -> Constraint:
        """A fresh automaton of `spec` (kind "json_schema": a schema dict, or True for any JSON
        object; "regex": a pattern; "grammar": Lark or GBNF text). GrammarError if it does not
        compile."""
        text = grammar_text(kind, spec)
        with self._lock:
            proto = self._compiled.get(text)
            if proto is not None:
                self._compiled.move_to_end(text)
        if proto is None:
            import llguidance

            proto = llguidance.LLMatcher(self._ll_tokenizer(), text, log_level=0)
            if proto.is_error():
                raise GrammarError(f"{kind}: {proto.get_error()}")
            with self._lock:
                self._compiled[text] = proto
                while len(self._compiled) > self._cache_size:
                    self._compiled.popitem(last=False)
        return Constraint(proto.deep_copy(), self.words, self._eos)


# A number the schema leaves unbounded is written in plain notation, within JSON's exactly
# interoperable integer range (RFC 8259, section 6) and to at most 9 decimals: otherwise a small
# model can loop inside one number ("0.000122222...") until max_tokens cuts the JSON short.
# Every such output still validates against the schema as given.
_NUMBER_LIMIT = 2 ** 53 - 1
_NUMBER_STEP = 1e-9
# Keywords whose values are data, not schemas: never rewritten.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})


def bound_numbers(schema):
    """`schema` with every number and integer the schema leaves unbounded given the bounds
    above (a copy; the bounds a schema states are kept)."""
    if isinstance(schema, list):
        return [bound_numbers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYWORDS else bound_numbers(v) for k, v in schema.items()}
    types = out.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    if types & {"number", "integer"}:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -_NUMBER_LIMIT
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = _NUMBER_LIMIT
        if "number" in types and "multipleOf" not in out:
            out["multipleOf"] = _NUMBER_STEP
    return out


def grammar_text(kind: str, spec) -> str:
    """llguidance's grammar text of a constraint (see `Grammars.constraint`)."""
    import llguidance

    if kind == "json_schema":
        schema = {"type": "object"} if spec is True else spec
        if not isinstance(schema, dict):
            raise GrammarError(f"json_schema: a schema is a JSON object, got {type(schema).__name__}")
        try:
            # Compact JSON, as OpenAI writes it: whitespace between items is free otherwise, and
            # a small model given the freedom may fill max_tokens with it.
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(bound_numbers(schema)), defaults={"whitespace_flexible": False})
        except ValueError as e:
            raise GrammarError(f"json_schema: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec)
    if kind == "grammar":
        try:
            return llguidance.grammar_from("grammar", spec)
        except ValueError as e:
            raise GrammarError(f"grammar: {e}") from None
    raise GrammarError(f"unknown constraint kind {kind!r}; one of {', '.join(KINDS)}")


def allowed(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """A bitmask -> bool [vocab_size]."""
    bits = (np.asarray(mask, np.int32).view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return bits.reshape(-1)[:vocab_size].astype(bool)
