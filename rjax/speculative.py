"""Speculative decoding for one sequence: draft K tokens cheaply, verify them with one forward
pass of K + 1 positions over the cache, keep the longest prefix the target agrees with plus one
token of the target's own, and roll the cache back by resetting its length.

The rollback is only a length: positions past a slot's length are never read, and the next
write overwrites them. Acceptance runs on the device in the same program as the verification:
greedy keeps a draft token while it is the target's argmax; sampling accepts a drafted token x
with probability p(x) (a drafter proposes one token with certainty, so min(1, p/q) = p(x)) and
on a rejection draws from p with x removed, which leaves every emitted token distributed
exactly as plain sampling from p (top-k, top-p and temperature included).

Drafters propose from the tokens so far: `NgramDrafter` looks the sequence's last n-gram up
earlier in the sequence (prompt lookup: no second model).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from rjax import engine
from rjax.cache import KVCache
from rjax.config import ModelConfig
from rjax.model import Params, forward
from rjax.sampling import SamplingParams, filtered_logits


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the sequence's last n tokens
    (n from max_ngram down to min_ngram) and propose the tokens that followed it."""
    max_ngram: int = 3
    min_ngram: int = 1

    def draft(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + k]
        return []


def accept(logits, drafts, n_drafts, key, sp: SamplingParams):
    """The verification's decision. logits [K + 1, V]: the target's at the last accepted token
    and at each draft; drafts [K] (the first n_drafts real). -> (m, next): the first m drafts are
    kept, then `next`, the target's own token (a correction, or a bonus after all K)."""
    K = drafts.shape[0]
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    rows = jax.tree.map(lambda a: jnp.broadcast_to(a[:1], (K + 1,)), sp)  # one setting for every position
    logp = jax.nn.log_softmax(filtered_logits(logits, rows), axis=-1)
    k_accept, k_next = jax.random.split(key)
    sampled = sp.temperature[0] > 0
    draft_logp = jnp.take_along_axis(logp[:K], drafts[:, None], axis=-1)[:, 0]
    ok = jnp.where(sampled, jnp.log(jax.random.uniform(k_accept, (K,))) < draft_logp,
                   drafts == greedy_tokens[:K])
    ok &= jnp.arange(K) < n_drafts
    m = jnp.argmin(jnp.concatenate([ok, jnp.zeros((1,), bool)])).astype(jnp.int32)  # leading accepts
    # On a rejection at m the draft there is removed from the target's distribution.
    rejected = jnp.where(m < n_drafts, drafts[jnp.minimum(m, K - 1)], -1)
    row = jnp.where(jnp.arange(logp.shape[1]) == rejected, -jnp.inf, logp[m])
    drawn = jax.random.categorical(k_next, row).astype(jnp.int32)
    return m, jnp.where(sampled, drawn, greedy_tokens[m])


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def verify(cfg: ModelConfig, params: Params, cache: KVCache, last, drafts, n_drafts, key, sp: SamplingParams):
    """One verification step of slot 0: `last` (the newest token, not yet in the cache) and
    drafts [K] (n_drafts real) at the positions after the cache's length, in one forward pass.
    -> (m, next, cache): m drafts accepted, the target's next token, and the cache holding
    `last` and the m accepted drafts (the rest rolled back)."""
    K = drafts.shape[0]
    held = cache.lengths[0]
    tokens = jnp.concatenate([last[None], drafts])[None]
    t = jnp.arange(K + 1, dtype=jnp.int32)
    pos = jnp.where(t <= n_drafts, held + t, -1)[None]
    logits, cache = forward(cfg, params, cache, tokens, pos, None, cache.dtype)
    m, nxt = accept(logits[0], drafts, n_drafts, key, sp)
    return m, nxt, dataclasses.replace(cache, lengths=cache.lengths.at[0].set(held + 1 + m))


@dataclasses.dataclass
class SpeculativeStats:
    steps: int = 0      # verification passes
    drafted: int = 0    # draft tokens proposed
    accepted: int = 0   # of those, kept


def speculative_ids(cfg: ModelConfig, params: Params, cache: KVCache, prompt: list[int], *, max_new_tokens: int,
                    stop_ids=(), sp: SamplingParams, seed: int = 0, drafter=NgramDrafter(), draft_tokens: int = 4,
                    stats: SpeculativeStats | None = None):
    """Generate for one prompt in slot 0 of an empty one-slot `cache`, K = draft_tokens drafts
    per verification. Yields lists of new tokens (the first token alone, then each
    verification's accepted drafts and the target's token), stopping after a stop id, after
    max_new_tokens, or when the cache is full. Greedy output equals plain greedy decoding's."""
    K = draft_tokens
    stats = stats if stats is not None else SpeculativeStats()
    stops = set(int(s) for s in stop_ids)
    key = jax.random.key(seed)
    key, sub = jax.random.split(key)
    tokens, lengths = engine.pad_prompts([prompt])
    first, cache = engine.prefill_and_sample(cfg, params, cache, jnp.asarray(tokens), jnp.asarray(lengths), None,
                                             sub, sp)
    seq = list(prompt) + [int(first[0])]
    out = [seq[-1]]
    yield [seq[-1]]
    held = len(prompt)
    while len(out) < max_new_tokens and out[-1] not in stops and held + 1 <= cache.max_len:
        # Room: the last token and the drafts must fit the cache; no more than the budget needs.
        room = min(K, cache.max_len - held - 1, max_new_tokens - len(out) - 1)
        drafts = drafter.draft(seq, room) if room > 0 else []
        padded = np.zeros(K, np.int32)
        padded[: len(drafts)] = drafts
        key, sub = jax.random.split(key)
        m, nxt, cache = verify(cfg, params, cache, jnp.int32(seq[-1]), jnp.asarray(padded),
                               jnp.int32(len(drafts)), sub, sp)
        m = int(m)
        new = list(drafts[:m]) + [int(nxt)]
        stats.steps, stats.drafted, stats.accepted = stats.steps + 1, stats.drafted + len(drafts), stats.accepted + m
        held += 1 + m
        for i, t in enumerate(new):  # nothing after a stop id
            if t in stops:
                new = new[: i + 1]
                break
        new = new[: max_new_tokens - len(out)]
        seq += new
        out += new
        yield new
