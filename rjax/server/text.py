"""One choice's text: generated token ids in, text pieces out, cut at the first stop string.

Stop strings are matched on the detokenized text, so a stop spread over several tokens (or
ending inside one) is found. Text that might be the start of a stop string is held back until
the next tokens decide, so nothing of a stop string is ever sent. Pieces stay whole tokens, so
each carries the log-probabilities of exactly the tokens whose text it holds.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from rjax.runtime.serving import TokenLogprob


@dataclasses.dataclass(frozen=True)
class Piece:
    text: str
    logprobs: list[TokenLogprob]   # of the tokens whose text this piece holds (empty without logprobs)


@dataclasses.dataclass
class _Token:
    text: str
    logprob: TokenLogprob | None


class ChoiceText:
    """Incremental detokenization of one generated sequence, with stop strings.

    `add(tokens, logprobs)` -> the Piece that may be sent now; `finish()` -> the rest.
    `hidden_ids` (the end-of-sequence ids) count as generated but add no text and no log-probability.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = (), hidden_ids: Sequence[int] = ()):
        self._decoder = tokenizer.stream_decoder()
        self._stops = [s for s in stops if s]
        self._hidden = frozenset(hidden_ids)
        self._pending: list[_Token] = []   # decoded but not yet sent
        self.stopped = False               # a stop string was found: nothing more comes
        self.n_tokens = 0                  # generated tokens consumed (usage), up to the stop string

    def add(self, tokens: Sequence[int], logprobs: Sequence[TokenLogprob] | None = None) -> Piece:
        if self.stopped:
            return Piece("", [])
        for i, t in enumerate(tokens):
            self.n_tokens += 1
            if t in self._hidden:
                continue
            self._pending.append(_Token(self._decoder.add(t), logprobs[i] if logprobs else None))
            if self._find_stop() is not None:
                return self._cut()
        return self._release(len(self._pending_text()) - self._partial_stop())

    def finish(self) -> Piece:
        """Everything still held (and the decoder's tail), cut at a stop string if one completes."""
        if self.stopped:
            return Piece("", [])
        tail = self._decoder.flush()
        if tail:
            self._pending.append(_Token(tail, None))
        if self._find_stop() is not None:
            return self._cut()
        return self._release(len(self._pending_text()))

    # -- internals ------------------------------------------------------------------------------

    def _pending_text(self) -> str:
        return "".join(t.text for t in self._pending)

    def _find_stop(self) -> int | None:
        """Index in the pending text where the earliest stop string starts. Sent text never holds
        a stop's beginning (see `_partial_stop`), so a match lies wholly in the pending text."""
        text = self._pending_text()
        found = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        return min(found) if found else None

    def _partial_stop(self) -> int:
        """Length of the longest end of the pending text that begins some stop string."""
        text = self._pending_text()
        return max((j for s in self._stops for j in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:j])),
                   default=0)

    def _cut(self) -> Piece:
        at = self._find_stop()
        text, entries, start = self._pending_text()[:at], [], 0
        for t in self._pending:
            if start >= at:
                break
            if t.logprob is not None:
                entries.append(t.logprob)
            start += len(t.text)
        self._pending.clear()
        self.stopped = True
        return Piece(text, entries)

    def _release(self, limit: int) -> Piece:
        """Send the longest run of whole pending tokens whose text ends by `limit` characters."""
        n, end = 0, 0
        for t in self._pending:
            if end + len(t.text) > limit:
                break
            end += len(t.text)
            n += 1
        sent, self._pending = self._pending[:n], self._pending[n:]
        return Piece("".join(t.text for t in sent), [t.logprob for t in sent if t.logprob is not None])
