"""Request bodies of the OpenAI API that the server accepts, as pydantic models.

Ranges are the OpenAI API's; `top_k` is the extension llama.cpp's and vLLM's servers accept
(0 or -1: off). A field the API defines but the engine cannot honour (penalties, logit_bias,
tools, a JSON response format, suffix) is refused by name rather than silently ignored, and so
is a field the API does not define.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rjax.slots import MAX_TOP_LOGPROBS

MAX_STOP_STRINGS = 4   # OpenAI's limit
MAX_N = 16             # choices per request: each takes a slot of its own


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2 ** 31 - 1)
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # As vLLM's and llama.cpp's servers take it: generate through end-of-sequence tokens.
    ignore_eos: bool = False
    # Defined by the API, accepted only at their neutral values.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Accepted and ignored: they change nothing about the generated text.
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, v):
        if v is not None and any(s == "" for s in ([v] if isinstance(v, str) else v)):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v):
        if v:
            raise ValueError("penalties are not supported: leave them out or 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported: leave it out or empty")
        return v

    @property
    def stop_strings(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingRequest):
    prompt: str | Annotated[list[str], Field(min_length=1)] | Annotated[list[int], Field(min_length=1)] \
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix (insertion) is not supported")
        return v

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        return self


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFormat(_Body):
    type: Literal["text"]


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v):
        if v:
            raise ValueError("tools (function calling) are not supported")
        return v

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self
