"""A `tokenizers.Tokenizer` built from the vocabulary a GGUF file stores (`tokenizer.ggml.*`).

Byte-level BPE (`gpt2`) uses the file's merges; SentencePiece-style BPE (`llama`) recovers its
merges from the vocabulary. `_GGUFMetadata` reads the fields, turning a damaged one into a
ModelFileError that names the file and the key.
"""

from __future__ import annotations

import logging
from functools import lru_cache

import numpy as np
import tokenizers
from gguf import GGUFValueType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from rjax.loading.loaders.errors import ModelFileError

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
