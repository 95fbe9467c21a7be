"""A multi-turn conversation through the model's chat template, over a kept KV cache.

Each turn renders the whole conversation with the template, but only the tokens after the
longest prefix the cache already holds are prefilled: the earlier turns' keys and values are
reused, and a cached tail that no longer matches (a reply re-tokenized differently) is dropped
by resetting the slot's length, which is all a rollback takes in a functional cache.

With `speculative` each reply is decoded by drafts verified in one pass (rjax.engine.speculative); a
draft model keeps a cache of its own beside the target's, reused the same way.

A turn that is refused (text that is not UTF-8, a conversation past the context, settings out
of range) raises before anything changes: the session keeps its messages and its cache.

A reply that stops early (Ctrl-C, or the caller closing the stream) is kept as far as it was
streamed: the user's message and the partial reply join the history, and the cache keeps
what it holds, its extra positions (tokens generated but not yet shown) dropped at the next
turn by the same length reset. A reply stopped before its first token is rolled back with its
user message.

A model file without a chat template (a base model) is chatted with as raw completion: the
conversation is its turns' text joined as one document, which the model continues.

Turn latency does not grow with the conversation: each turn's new tokens are prefilled in
pieces of PREFILL_CHUNK (one prefill program for every length), and the cache grows by buckets
(`rjax.math.cache.grow`, keeping what it holds) rather than being made afresh and prefilled again
when the conversation outgrows it. A conversation compiles two programs per cache length,
starting at MIN_CACHE.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

import jax.numpy as jnp

from rjax.engine.speculative import ModelDrafter, SpeculativeStats, draft_cache_for, speculative_ids
from rjax.engine.steps import alive, program_params
from rjax.loading.loaders import Model
from rjax.math.cache import KVCache, check_kv_dtype, grow, init_cache
from rjax.math.sampling import SamplingParams
from rjax.runtime.generation import (AUTO_DRAFT_TOKENS, STEPS_PER_DISPATCH, _visible, activation_dtype, cache_length,
                                     check_draft_tokens, check_prompt_lengths, check_request, check_text,
                                     default_draft_tokens, load_drafter, stream_ids)


# The smallest cache a conversation starts with: a few turns fit before it grows (each length a
# program of its own to compile).
MIN_CACHE = 1024
# Each turn's new tokens are prefilled in pieces of this many (rjax.runtime.generation.stream_ids): one
# prefill program for turns of every length, where a bucket per length compiled one per bucket.
PREFILL_CHUNK = 64


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclasses.dataclass
class ChatSession:
    model: Model
    system: str | None = None
    messages: list[dict] = dataclasses.field(default_factory=list)
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    kv_dtype: str | None = None   # how the cache stores K/V (rjax.math.cache.KV_DTYPES; None: bf16)
    speculative: object = None    # as rjax.generate's: "ngram", "self:q4_0", a draft model, or None
    draft_tokens: int | str | None = None   # drafts per verification, "auto", or None: the drafter's default
    cache: KVCache | None = None
    cached_ids: list[int] = dataclasses.field(default_factory=list)  # what the cache holds, in order
    reused_tokens: int = 0  # prompt tokens taken from the cache in the last turn
    drafter: tuple | None = None  # (drafter, draft model or None), loaded once from `speculative`
    draft_cache: KVCache | None = None
    draft_held: int = 0     # of cached_ids, how many the draft model's cache holds
    speculative_counts: dict | None = None  # the last reply's verification steps, drafted and accepted tokens
    progress: bool = False  # show a "compiling" bar on stderr while a new program is built

    def __post_init__(self):
        if self.system and not self.messages:
            self.messages = [{"role": "system", "content": self.system}]
        check_kv_dtype(self.kv_dtype)
        if self.speculative is not None and self.drafter is None:
            check_draft_tokens(self.draft_tokens)
            self.drafter = load_drafter(self.model, self.speculative)

    def reset(self) -> "ChatSession":
        return dataclasses.replace(self, messages=[], cache=None, cached_ids=[], reused_tokens=0, draft_cache=None,
                                   draft_held=0, speculative_counts=None)

    @property
    def raw(self) -> bool:
        """True for a model file without a chat template: turns are raw completion."""
        return self.model.tokenizer.chat_template is None

    def encode(self, messages: list[dict]) -> list[int]:
        """The conversation's ids: rendered by the chat template, or (raw) its text as one document."""
        tok = self.model.tokenizer
        if self.raw:
            return tok.encode("".join(m["content"] for m in messages))
        return tok.encode_chat(messages)

    def _cache_for(self, ids: list[int]) -> tuple[KVCache, KVCache | None, int]:
        """Caches (the target's, the draft model's or None) that can hold `ids` plus a reply, and
        how many of `ids` both already hold."""
        cfg = self.model.config
        needed = len(ids) + self.max_new_tokens
        draft = self.drafter[1] if self.drafter else None
        S = cache_length(max(needed, MIN_CACHE), cfg.context_length)
        if self.cache is None:
            cache = init_cache(cfg, 1, S, activation_dtype(), self.kv_dtype)
            return cache, None if draft is None else draft_cache_for(self.drafter[0], S, activation_dtype()), 0
        keep = min(common_prefix(self.cached_ids, ids), len(ids) - 1)  # at least one token to prefill
        if draft is not None:
            keep = min(keep, self.draft_held)

        def held(c):  # each cache its own lengths array: both are donated
            c = grow(c, S) if S > c.max_len else c
            return dataclasses.replace(c, lengths=jnp.asarray([keep], jnp.int32))

        return held(self.cache), None if draft is None else held(self.draft_cache), keep

    def send(self, text: str) -> Iterator[str]:
        """Add a user turn and stream the assistant's reply; the reply joins the history. A
        refused turn (ValueError) leaves the session as it was; a reply stopped early is kept as
        far as it was streamed (see the module docstring)."""
        tok = self.model.tokenizer
        messages = [*self.messages, {"role": "user", "content": check_text(text, "message")}]
        ids = self.encode(messages)
        check_prompt_lengths(self.model, [ids])
        before = (self.cache, self.cached_ids, self.draft_cache, self.draft_held)
        cache, draft_cache, keep = self._cache_for(ids)
        stats: dict = {}
        seed = self.seed + len(messages)
        # Checked here, before the session lets go of its caches.
        if self.drafter is None:
            steps = stream_ids(self.model, [ids[keep:]], cache=cache, stats=stats, max_new_tokens=self.max_new_tokens,
                               temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=seed,
                               progress=self.progress, prefill_chunk=PREFILL_CHUNK)
        else:
            check_request(self.model, [ids[keep:]], max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                          top_k=self.top_k, top_p=self.top_p, seed=seed, steps_per_dispatch=STEPS_PER_DISPATCH,
                          cache=cache)
            steps = self._speculative(ids, keep, cache, draft_cache, seed, stats)
        self.cache, self.cached_ids, self.reused_tokens = None, [], keep  # donated below
        self.draft_cache, self.draft_held, self.speculative_counts = None, 0, None
        dec = tok.stream_decoder()
        reply, generated = [], []
        try:
            for step in steps:
                generated.extend(step[0])
                for t in _visible(tok, step[0]):
                    chunk = dec.add(t)
                    reply.append(chunk)
                    if chunk:
                        yield chunk
            tail = dec.flush()
            if tail:
                reply.append(tail)
                yield tail
        finally:
            steps.close()  # stopped early: nothing left running on the device (engine.settle)
            if alive(stats.get("cache")):
                # Stopped during the prefill, the cache holds only part of the turn.
                held = int(stats["cache"].lengths[0])
                self.cache, self.cached_ids = stats["cache"], (ids + generated[:-1])[:held]
                if alive(stats.get("draft_cache")):
                    self.draft_cache, self.draft_held = stats["draft_cache"], int(stats["draft_cache"].lengths[0])
            elif alive(before[0]) and (before[2] is None or alive(before[2])):  # stopped before the prefill
                self.cache, self.cached_ids, self.draft_cache, self.draft_held = before
            if generated:
                self.messages = [*messages, {"role": "assistant", "content": "".join(reply)}]

    def _speculative(self, ids, keep, cache, draft_cache, seed, stats: dict):
        """The reply's tokens by speculative decoding; leaves the caches and counts in `stats`."""
        drafter, draft = self.drafter
        spec = SpeculativeStats()
        params = program_params(self.model.params, activation_dtype())
        draft_params = None if draft is None else program_params(draft.params, activation_dtype())
        for new in speculative_ids(self.model.config, params, cache, ids, max_new_tokens=self.max_new_tokens,
                                   stop_ids=self.model.tokenizer.eos_ids,
                                   sp=SamplingParams.make(1, self.temperature, self.top_k, self.top_p), seed=seed,
                                   drafter=drafter, draft_params=draft_params,
                                   draft_cache=draft_cache, held=keep, stats=spec,
                                   rounds_per_dispatch=STEPS_PER_DISPATCH,
                                   draft_tokens=AUTO_DRAFT_TOKENS if self.draft_tokens == "auto"
                                   else default_draft_tokens(self.model.config, drafter)
                                   if self.draft_tokens is None else self.draft_tokens):
            yield [new]
        self.speculative_counts = dict(steps=spec.steps, drafted=spec.drafted, accepted=spec.accepted)
        stats.update(cache=spec.cache, draft_cache=spec.draft_cache if isinstance(drafter, ModelDrafter) else None)
