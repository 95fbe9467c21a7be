"""A multi-turn conversation through the model's chat template.

Each turn renders the whole conversation and generates the reply; the history is a plain list
of messages, so a session can be copied, reset or replayed.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

from rjax.generation import _visible, stream_ids
from rjax.loaders import Model


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

    def __post_init__(self):
        if self.system and not self.messages:
            self.messages = [{"role": "system", "content": self.system}]

    def reset(self) -> "ChatSession":
        return dataclasses.replace(self, messages=[])

    def send(self, text: str) -> Iterator[str]:
        """Add a user turn and stream the assistant's reply; the reply joins the history."""
        tok = self.model.tokenizer
        self.messages.append({"role": "user", "content": text})
        ids = tok.encode_chat(self.messages)
        dec = tok.stream_decoder()
        reply = []
        for step in stream_ids(self.model, [ids], max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                               top_k=self.top_k, top_p=self.top_p, seed=self.seed + len(self.messages)):
            for t in _visible(tok, step[0]):
                chunk = dec.add(t)
                reply.append(chunk)
                if chunk:
                    yield chunk
        tail = dec.flush()
        if tail:
            reply.append(tail)
            yield tail
        self.messages.append({"role": "assistant", "content": "".join(reply)})
