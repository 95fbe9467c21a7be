"""Streaming detokenization: generated ids in, text out as soon as each character is whole."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class Detokenizer(Protocol):
    """What the stream decoder reads of a `Tokenizer` (which builds one: `Tokenizer.stream_decoder`)."""

    special_ids: frozenset[int]
    byte_fallback_ids: frozenset[int]

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str: ...


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

    def __init__(self, tokenizer: Detokenizer, skip_special: bool = True):
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
