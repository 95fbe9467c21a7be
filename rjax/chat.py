"""A multi-turn conversation through the model's chat template, over a kept KV cache.

Each turn renders the whole conversation with the template, but only the tokens after the
longest prefix the cache already holds are prefilled: the earlier turns' keys and values are
reused, and a cached tail that no longer matches (a reply re-tokenized differently) is dropped
by resetting the slot's length, which is all a rollback takes in a functional cache.

A turn that is refused (text that is not UTF-8, a conversation past the context, settings out
of range) raises before anything changes: the session keeps its messages and its cache.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

import jax.numpy as jnp

from rjax.cache import KVCache, init_cache
from rjax.generation import _visible, activation_dtype, cache_length, check_prompt_lengths, check_text, stream_ids
from rjax.loaders import Model


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
    cache: KVCache | None = None
    cached_ids: list[int] = dataclasses.field(default_factory=list)  # what the cache holds, in order
    reused_tokens: int = 0  # prompt tokens taken from the cache in the last turn

    def __post_init__(self):
        if self.system and not self.messages:
            self.messages = [{"role": "system", "content": self.system}]

    def reset(self) -> "ChatSession":
        return dataclasses.replace(self, messages=[], cache=None, cached_ids=[], reused_tokens=0)

    def _cache_for(self, ids: list[int]) -> tuple[KVCache, int]:
        """A cache that can hold `ids` plus a reply, and how many of `ids` it already holds."""
        cfg = self.model.config
        needed = len(ids) + self.max_new_tokens
        if self.cache is None or needed > self.cache.max_len:
            cache = init_cache(cfg, 1, cache_length(needed, cfg.context_length), activation_dtype())
            return cache, 0
        keep = min(common_prefix(self.cached_ids, ids), len(ids) - 1)  # at least one token to prefill
        return dataclasses.replace(self.cache, lengths=jnp.asarray([keep], jnp.int32)), keep

    def send(self, text: str) -> Iterator[str]:
        """Add a user turn and stream the assistant's reply; the reply joins the history. A
        refused turn (ValueError) leaves the session as it was."""
        tok = self.model.tokenizer
        messages = [*self.messages, {"role": "user", "content": check_text(text, "message")}]
        ids = tok.encode_chat(messages)
        check_prompt_lengths(self.model, [ids])
        cache, keep = self._cache_for(ids)
        stats: dict = {}
        # Checked here, before the session lets go of its cache.
        steps = stream_ids(self.model, [ids[keep:]], cache=cache, stats=stats, max_new_tokens=self.max_new_tokens,
                           temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                           seed=self.seed + len(messages))
        self.messages = messages
        self.cache, self.cached_ids, self.reused_tokens = None, [], keep  # donated below
        dec = tok.stream_decoder()
        reply, generated = [], []
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
        self.cache, self.cached_ids = stats["cache"], ids + generated[:-1]
        self.messages.append({"role": "assistant", "content": "".join(reply)})
