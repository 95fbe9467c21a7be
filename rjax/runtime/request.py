"""One serving request as one typed, frozen value (`Request`), validated once where it enters:
`Limits.request` builds it from a Python call (`ServingEngine.submit`'s keywords) or from the
server's parsed body, and it passes as that type to the scheduler. Also the checks of request
arguments that generation and scoring share (`is_int`, `check_token_ids`, `check_max_new_tokens`).

`int()` would take a bool, a float or the bytes of a text for token ids and budgets, and an id
outside the vocabulary would be clamped by the embedding gather into another token, so these are
refused before anything is dispatched, naming the argument.

A serving request is refused, with nothing changed, when it could never run as asked: a prompt
that is empty, not a sequence of integer token ids inside the vocabulary, or that leaves no free
position in `max_len` (PromptTooLongError); a `max_new_tokens` that is not an integer >= 1, or
that with the prompt needs more than `max_len` positions (ContextLengthError, as the OpenAI API
refuses such a request); more than `max_stop_ids` stop ids, or ids outside the vocabulary;
sampling settings or logit adjustments out of range (`rjax.math.sampling.check_sampling`,
`check_adjust`: NaN and infinities included; logit_bias ids outside the vocabulary); a seed or
sample index that is not an integer; an unknown argument. Refusals are ValueError (or a
subclass), TypeError for a prompt or stop set that is not a sequence at all, or an unknown
argument.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Iterable, Mapping, Sequence

import numpy as np

from rjax.engine.steps import ContextLengthError, PromptTooLongError
from rjax.math.sampling import adjusts, check_adjust, check_sampling, penalizes

# submit's logit-adjustment arguments -> `rjax.math.sampling.LogitAdjust.host` keys.
ADJUST_ARGUMENTS = {"presence_penalty": "presence", "frequency_penalty": "frequency",
                    "repetition_penalty": "repetition", "min_p": "min_p", "logit_bias": "logit_bias"}


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


def check_max_new_tokens(max_new_tokens) -> None:
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")


def adjust_keys(adjust: Mapping) -> dict:
    """submit's adjustment arguments -> `LogitAdjust.host` keys (a misspelt one is a TypeError)."""
    unknown = sorted(set(adjust) - set(ADJUST_ARGUMENTS))
    if unknown:
        raise TypeError(f"unexpected request argument(s): {', '.join(unknown)}")
    return {ADJUST_ARGUMENTS[k]: v for k, v in adjust.items() if v is not None}


def check_stop_ids(stop_ids: Sequence[int], vocab_size: int, max_stop_ids: int) -> tuple[int, ...]:
    """-> the stop ids as ints, at most `max_stop_ids` of them, each inside the vocabulary."""
    ids = check_token_ids(stop_ids, vocab_size, "stop_ids")
    if len(ids) > max_stop_ids:
        raise ValueError(f"{len(ids)} stop ids; ServingConfig.max_stop_ids is {max_stop_ids}")
    return tuple(ids)


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked serving request (build it with `Limits.request`)."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    seed: int | None = None       # the request's random stream, modulo 2**64; None: drawn by the engine
    sample_index: int = 0         # folded into that stream, so several samples of one seed differ
    logprobs: bool = False
    # Logit adjustments (`rjax.math.sampling.LogitAdjust.host` keys); empty: none.
    adjust: Mapping = dataclasses.field(default_factory=dict)
    # The automaton of a constrained request (`rjax.runtime.grammar.Constraint`: mask(), advance(token)).
    constraint: object = None

    @property
    def penalized(self) -> bool:
        """Whether its adjustments read the token history (the prompt's included)."""
        return penalizes(**self.adjust)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a serving engine accepts: fixed at its start, so any thread may read them."""

    vocab_size: int
    max_len: int                   # positions per sequence (prompt + generated)
    max_stop_ids: int
    default_stop_ids: tuple[int, ...]   # every request's stop set unless it gives its own
    embedding_size: int            # the width of the model's embeddings (/v1/embeddings)

    def request(self, prompt: Sequence[int], *, max_new_tokens: int = 256, temperature: float = 0.0,
                top_k: int = 0, top_p: float = 1.0, stop_ids: Sequence[int] | None = None, seed: int | None = None,
                sample_index: int = 0, logprobs: bool = False, constraint=None, **adjust) -> Request:
        """The Request of these settings (see `ServingEngine.submit`), or the error of the first
        that the engine could never run (see the module docstring)."""
        adjust = adjust_keys(adjust)
        prompt = check_token_ids(prompt, self.vocab_size, "prompt")
        if not prompt:
            raise ValueError("empty prompt: at least one token is needed")
        if len(prompt) >= self.max_len:
            raise PromptTooLongError(f"prompt of {len(prompt)} tokens: ServingConfig.max_len is {self.max_len} "
                                     f"positions and generation needs at least one free position")
        check_max_new_tokens(max_new_tokens)
        check_sampling(temperature, top_k, top_p)
        check_adjust(self.vocab_size, **adjust)
        stops = check_stop_ids(self.default_stop_ids if stop_ids is None else stop_ids, self.vocab_size,
                               self.max_stop_ids)
        if seed is not None and not is_int(seed):
            raise ValueError(f"seed must be an integer or None, got {seed!r}")
        if not is_int(sample_index) or not 0 <= sample_index < 2 ** 32:
            raise ValueError(f"sample_index must be an integer in [0, 2**32), got {sample_index!r}")
        if not isinstance(logprobs, (bool, np.bool_)):
            raise TypeError(f"logprobs must be a bool, got {logprobs!r}")
        # Last, so that a request with a bad setting is told about that setting first.
        if len(prompt) + max_new_tokens > self.max_len:
            raise ContextLengthError(
                f"prompt of {len(prompt)} tokens and max_new_tokens {max_new_tokens}: "
                f"{len(prompt) + max_new_tokens} positions, beyond ServingConfig.max_len of {self.max_len} "
                f"(max_new_tokens can be at most {self.max_len - len(prompt)})")
        return Request(tuple(prompt), int(max_new_tokens), float(temperature), int(top_k), float(top_p), stops,
                       None if seed is None else int(seed) % 2 ** 64, int(sample_index), bool(logprobs),
                       adjust if adjusts(**adjust) else {}, constraint)
