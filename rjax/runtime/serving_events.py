"""What a `ServingEngine` streams back: per step, one `StreamEvent` per running request (its new
tokens), and with the last one the request's `Completion`; `TokenLogprob` entries for requests
submitted with logprobs.
"""
from __future__ import annotations

import dataclasses
from typing import Hashable

from rjax.math.sampling import TopLogprobs


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the most likely tokens at its position, under
    the model's raw distribution (before temperature, top-k and top-p)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]   # (token id, log-probability), MAX_TOP_LOGPROBS, most likely first


@dataclasses.dataclass(frozen=True)
class Completion:
    request_id: Hashable
    prompt: list[int]
    tokens: list[int]
    finish_reason: str        # "stop" (a stop id), "length" (max_new_tokens), "cancelled" or "error"
    ttft_s: float             # from submit to the first token on the host (0 if it never had one)
    decode_tokens_per_s: float
    logprobs: list[TokenLogprob] | None = None  # one per token, for a request submitted with logprobs
    # With speculative decoding (ServingConfig.speculative): the request's draft tokens proposed
    # and, of those, accepted.
    drafted: int = 0
    accepted: int = 0
    error: str | None = None  # finish reason "error": what failed (the request's own fault, or its step's)


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    request_id: Hashable
    tokens: list[int]         # the request's new tokens (may be empty)
    finished: bool
    completion: Completion | None = None  # set when finished
    logprobs: list[TokenLogprob] | None = None  # one per new token, for a request submitted with logprobs


def token_logprob(lp: TopLogprobs, row: int, step: int | None, token: int) -> TokenLogprob:
    """The host copy of one token's TopLogprobs (prefill's [P, ...] when step is None, else a
    decode dispatch's [n_slots, n_steps, ...])."""
    at = (row,) if step is None else (row, step)
    ids, top = lp.top_ids[at], lp.top[at]
    return TokenLogprob(token, float(lp.chosen[at]), tuple((int(i), float(v)) for i, v in zip(ids, top)))
