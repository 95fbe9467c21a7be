"""Request bodies of the OpenAI API that the server accepts, as pydantic models.

Ranges are the OpenAI API's; `top_k`, `min_p` and `repetition_penalty` are the extensions
llama.cpp's and vLLM's servers accept (top_k 0 or -1: off). A field the API defines but the
engine cannot honour (suffix, best_of other than n) is refused by name rather than silently
ignored, and so is a field the API does not define.

Types are strict (no boolean for an integer, no string for a boolean or a number), and every
text must be valid Unicode (no unpaired surrogate, which "\ud800" in JSON makes) without NUL
characters; names and stop strings have length limits.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from rjax.math.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS

MAX_STOP_STRINGS = 4   # OpenAI's limit
MAX_N = 16             # choices per request: each takes a slot of its own
MAX_NAME_CHARS = 256   # model, user and message names
MAX_STOP_CHARS = 256   # each stop string is matched against the text held back at every token
SEED_RANGE = (-2 ** 63, 2 ** 63)  # as rjax.generate takes it


def _valid_text(text):
    """Runs before pydantic's own checks (whose length check would misname a surrogate)."""
    if not isinstance(text, str):
        return text  # pydantic names the wrong type
    if "\x00" in text:
        raise ValueError(f"has a NUL character at index {text.index(chr(0))}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"has an unpaired surrogate U+{ord(text[e.start]):04X} at index {e.start}, which is not "
                         f"valid Unicode") from None
    return text


Text = Annotated[str, BeforeValidator(_valid_text)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS), BeforeValidator(_valid_text)]
Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS), BeforeValidator(_valid_text)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(_Body):
    model: Name
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2 ** 31 - 1)
    seed: int | None = Field(None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    # As vLLM's and llama.cpp's servers take it: generate through end-of-sequence tokens.
    ignore_eos: bool = False
    # Logit adjustments (`rjax.math.sampling.adjust_logits`); repetition_penalty and min_p as vLLM's.
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # Constrained decoding as vLLM's server takes it (guided_*), and llama-server (grammar: GBNF
    # or Lark; json_schema). At most one of them, and not with response_format.
    guided_json: dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    # Accepted and ignored: they change nothing about the generated text.
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: Name | None = None

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, v):
        if v is not None and any(s == "" for s in ([v] if isinstance(v, str) else v)):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, v):
        for k, b in (v or {}).items():
            if not k.strip().lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {k!r}")
            if not -100 <= b <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {b!r} for token {k}")
        return v

    @property
    def constraint(self) -> tuple[str, str, Any] | None:
        """(param, kind, spec) of the request's constraint (`rjax.runtime.grammar`), or None."""
        given = [(name, kind, getattr(self, name)) for name, kind in (
            ("guided_json", "json_schema"), ("json_schema", "json_schema"), ("guided_regex", "regex"),
            ("guided_grammar", "grammar"), ("grammar", "grammar")) if getattr(self, name) is not None]
        fmt = getattr(self, "response_format", None)
        if fmt is not None and fmt.type != "text":
            given.append(("response_format", "json_schema", fmt.schema_spec))
        if len(given) > 1:
            raise ValueError(f"one constraint at most; got {', '.join(g[0] for g in given)}")
        return given[0] if given else None

    @property
    def adjust(self) -> dict:
        """The engine's logit adjustments (`ServingEngine.submit`), those given."""
        out = dict(presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                   repetition_penalty=self.repetition_penalty, min_p=self.min_p,
                   logit_bias={int(k): b for k, b in self.logit_bias.items()} if self.logit_bias else None)
        return {k: v for k, v in out.items() if v is not None}

    @property
    def stop_strings(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingRequest):
    prompt: Text | Annotated[list[Text], Field(min_length=1)] | Annotated[list[int], Field(min_length=1)] \
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
    text: Text


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Name | None = None
    tool_calls: list[ToolCall] | None = None   # an assistant's earlier calls
    tool_call_id: str | None = None            # the call a tool message answers

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class JsonSchemaFormat(_Body):
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class FunctionDef(_Body):
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self

    @property
    def schema_spec(self):
        """The JSON schema to decode by (True: any JSON object)."""
        if self.type == "json_object" or self.json_schema.schema_ is None:
            return True
        return self.json_schema.schema_


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _choice_names_a_tool(self):
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names the function {self.tool_choice.function.name!r}, which is "
                                 f"not among the tools ({', '.join(names) or 'none given'})")
        elif self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    @property
    def tool_mode(self) -> tuple[list[dict], str | None, bool] | None:
        """(the tools as dicts, the function a call must name or None, whether a call is forced),
        or None when no tool may be called."""
        if not self.tools or self.tool_choice == "none":
            return None
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            return tools, self.tool_choice.function.name, True
        return tools, None, self.tool_choice == "required"

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


class EmbeddingRequest(_Body):
    model: str
    input: str | Annotated[list[str], Field(min_length=1)] | Annotated[list[int], Field(min_length=1)] \
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


class TokenizeRequest(_Body):
    """vLLM's /tokenize: `prompt` (or llama-server's `content`), or chat `messages` rendered by
    the chat template."""

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if sum(x is not None for x in (self.prompt, self.content, self.messages)) != 1:
            raise ValueError("give exactly one of prompt, content or messages")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
