"""Host-side checks of request arguments shared by generation, scoring and serving.

`int()` would take a bool, a float or the bytes of a text for token ids and budgets, and an id
outside the vocabulary would be clamped by the embedding gather into another token, so these
are refused before anything is dispatched, naming the argument.
"""
from __future__ import annotations

import numbers
from typing import Iterable


def is_int(x) -> bool:
    """A Python or NumPy integer, and not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_token_ids(ids, vocab_size: int, what: str) -> list[int]:
    """`ids` as a list of ints in [0, vocab_size). TypeError for text or what is not a sequence,
    ValueError naming the first bad id and its position."""
    if isinstance(ids, (str, bytes, bytearray, memoryview)) or not isinstance(ids, Iterable):
        raise TypeError(f"{what} must be a sequence of token ids, got {type(ids).__name__} "
                        f"(text goes through the tokenizer, or rjax.generate / rjax.stream)")
    out = []
    for j, t in enumerate(ids):
        if not is_int(t):
            raise ValueError(f"{what} has token id {t!r} at position {j}, a {type(t).__name__}: token ids are "
                             f"integers")
        if not 0 <= t < vocab_size:
            raise ValueError(f"{what} has token id {t!r} at position {j}, outside the vocabulary [0, {vocab_size})")
        out.append(int(t))
    return out
