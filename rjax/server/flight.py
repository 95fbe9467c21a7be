"""One HTTP request in flight: its choices go to the engine loop as typed requests
(`rjax.runtime.request.Request`, checked once here against the engine's `Limits`), and their events
come back into the request's own asyncio queue, where they are detokenized, cut at stop strings
and sent on (server-sent events with `stream: true`, one JSON body without). A client that goes
away cancels its sequences at once, which frees their slots and pages."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import traceback
from typing import Any, AsyncIterator, Sequence

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from rjax.loading.tokenizer import ChatTemplateError
from rjax.runtime.request import Limits, Request
from rjax.runtime.serving_events import TokenLogprob
from rjax.server.errors import APIError
from rjax.server.loop import EngineFailure, EngineLoop, QueueFullError
from rjax.server.schemas import ChatCompletionRequest, SamplingRequest
from rjax.server.text import ChoiceText, Piece
from rjax.server.tools import render_messages

log = logging.getLogger("rjax.server")

# Engine finish reasons as the API names them: running out of context is a length limit too.
_FINISH = {"stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}


# ---------------------------------------------------------------------------------------------
# one request in flight

class Generation:
    """The choices of one HTTP request: engine sequences submitted together, their events
    gathered from this request's own queue."""

    def __init__(self, loop: EngineLoop, tokenizer, requests: list[Request], stops: Sequence[str],
                 hidden_ids: Sequence[int], n_prompt_tokens: int):
        self.loop = loop
        self.n = len(requests)
        self.n_prompt_tokens = n_prompt_tokens
        self._queue: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        self.ids = loop.submit(requests, lambda item: aloop.call_soon_threadsafe(self._queue.put_nowait, item))
        self._index = {rid: i for i, rid in enumerate(self.ids)}
        self._open = set(self.ids)
        self.texts = [ChoiceText(tokenizer, stops, hidden_ids) for _ in self.ids]

    def usage(self) -> dict:
        done = sum(t.n_tokens for t in self.texts)
        return {"prompt_tokens": self.n_prompt_tokens, "completion_tokens": done,
                "total_tokens": self.n_prompt_tokens + done}

    def abort(self) -> None:
        """Cancel what still runs (the client went away); wakes `events` to end."""
        if self._open:
            self.loop.cancel(list(self._open))
            self._open.clear()
        self._queue.put_nowait(None)

    async def events(self) -> AsyncIterator[tuple[int, Piece, str | None]]:
        """(choice index, text to send, finish reason or None) until every choice has finished."""
        try:
            while self._open:
                item = await self._queue.get()
                if item is None:
                    return
                if item.request_id not in self._open:
                    continue  # a choice already ended by a stop string
                if isinstance(item, EngineFailure):
                    raise APIError(500, item.message, type="server_error")
                i, text = self._index[item.request_id], self.texts[self._index[item.request_id]]
                try:
                    piece = text.add(item.tokens, item.logprobs)
                    tail = text.finish() if item.finished and not text.stopped else None
                except Exception as e:  # this request alone fails
                    log.error("detokenizing request %s failed: %s", item.request_id, traceback.format_exc())
                    raise APIError(500, f"detokenizing this request's tokens failed: {type(e).__name__}: {e}",
                                   type="server_error") from None
                if text.stopped:
                    self._open.discard(item.request_id)
                    if not item.finished:
                        self.loop.cancel([item.request_id])  # frees its slot now
                    yield i, piece, "stop"
                elif item.finished:
                    self._open.discard(item.request_id)
                    yield i, Piece(piece.text + tail.text, piece.logprobs + tail.logprobs), \
                        "stop" if text.stopped else _FINISH[item.completion.finish_reason]
                else:
                    yield i, piece, None
        finally:
            if self._open:  # an error, or the consumer stopped early
                self.loop.cancel(list(self._open))
                self._open.clear()

    async def collect(self, request: HTTPRequest) -> tuple[list[str], list[list[TokenLogprob]], list[str]]:
        """Run to the end (cancelled if the client disconnects meanwhile)."""
        texts, entries, finishes = [""] * self.n, [[] for _ in range(self.n)], ["stop"] * self.n
        with watch_disconnect(request, self):
            async for i, piece, finish in self.events():
                texts[i] += piece.text
                entries[i] += piece.logprobs
                if finish is not None:
                    finishes[i] = finish
        return texts, entries, finishes


@contextlib.contextmanager
def watch_disconnect(request: HTTPRequest, gen: Generation):
    """Abort `gen` as soon as the client disconnects, whatever the handler is waiting on."""
    async def wait():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gen.abort()

    task = asyncio.ensure_future(wait())
    try:
        yield
    finally:
        task.cancel()


def sse(request: HTTPRequest, gen: Generation, chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        with watch_disconnect(request, gen):
            try:
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            except APIError as e:  # the status line has gone: the error is the last event
                yield f"data: {json.dumps(e.body(), ensure_ascii=False)}\n\n"
            except Exception as e:  # as the app's handler of unexpected errors would answer
                log.error("stream failed: %s", traceback.format_exc())
                error = APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
                yield f"data: {json.dumps(error.body(), ensure_ascii=False)}\n\n"
            finally:
                gen.abort()
            yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---------------------------------------------------------------------------------------------
# request -> engine sequences

def check_model(body: SamplingRequest, setup) -> None:
    if body.model != setup.model_id:
        raise APIError(400, f"The model '{body.model}' does not exist; this server serves '{setup.model_id}'.",
                       param="model", code="model_not_found")


def check_text_length(tok, text: str, max_len: int, param: str) -> None:
    """Refuse a text that cannot fit the context by its length alone, before it is encoded."""
    at_least = tok.min_tokens(text)
    if at_least >= max_len:
        raise APIError(400, f"This model's maximum context length is {max_len} tokens; the {param} has "
                       f"{len(text):,} characters, at least {at_least:,} tokens.", param=param,
                       code="context_length_exceeded")


def start(loop: EngineLoop, limits: Limits, tok, body: SamplingRequest, prompts: list[list[int]], *, default_max,
          logprobs: bool, prompt_param: str, constraint=None) -> Generation:
    """Check the request's sequences against the engine's `limits` and queue them; `constraint`:
    None, or a maker of a fresh `rjax.runtime.grammar.Constraint` for each."""
    max_len = limits.max_len
    sampling = dict(temperature=1.0 if body.temperature is None else body.temperature,
                    top_k=max(body.top_k or 0, 0), top_p=1.0 if body.top_p is None else body.top_p, **body.adjust)
    if len(prompts) * body.n > loop.max_queued:
        raise APIError(400, f"{len(prompts)} prompt(s) x n={body.n} sequences exceed the {loop.max_queued} the "
                       f"server queues at most (--max-queued)", param="n", code="invalid_value")
    requests = []
    for p in prompts:
        if len(p) >= max_len:
            raise APIError(400, f"This model's maximum context length is {max_len} tokens; the prompt has {len(p)} "
                           f"tokens and leaves no room to generate.", param=prompt_param,
                           code="context_length_exceeded")
        max_tokens = default_max(p, max_len) if body.max_tokens is None else body.max_tokens
        if len(p) + max_tokens > max_len:
            raise APIError(400, f"This model's maximum context length is {max_len} tokens; the prompt has {len(p)} "
                           f"tokens and max_tokens asks for {max_tokens} more.", param="max_tokens",
                           code="context_length_exceeded")
        try:
            request = limits.request(p, max_new_tokens=max_tokens, seed=body.seed, logprobs=logprobs, **sampling,
                                     **({"stop_ids": ()} if body.ignore_eos else {}))
        except ValueError as e:
            named = [f for f in ("logit_bias", *sampling) if str(e).startswith(f)]
            raise APIError(400, str(e), param=named[0] if named else prompt_param) from None
        for _ in range(body.n):
            requests.append(dataclasses.replace(request, sample_index=len(requests),
                                                constraint=constraint() if constraint else None))
    try:
        return Generation(loop, tok, requests, body.stop_strings, limits.default_stop_ids,
                          sum(len(p) for p in prompts))
    except QueueFullError as e:
        raise APIError(429, str(e), type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": "1"}) from None


def completion_prompts(prompt, tok, max_len: int) -> list[list[int]]:
    if isinstance(prompt, str) or isinstance(prompt[0], str):
        texts = [prompt] if isinstance(prompt, str) else prompt
        for text in texts:
            check_text_length(tok, text, max_len, "prompt")
        return [tok.encode(text) for text in texts]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


def chat_prompt(tok, body: ChatCompletionRequest, model_id: str, max_len: int,
                 add_generation_prompt: bool = True) -> list[int]:
    if tok.chat_template is None:
        raise APIError(400, f"The model '{model_id}' has no chat template, so it cannot take chat messages: use "
                       f"/v1/completions, or start the server with --chat-template FILE.", param="messages",
                       code="chat_template_missing")
    messages = []
    for m in body.messages:
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        messages.append(msg)
    mode = body.tool_mode
    messages, extra = render_messages(messages, mode[0] if mode else None, tok.chat_template)
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt, **extra)
    except ChatTemplateError as e:  # the template refused the conversation, or ran past its limits
        raise APIError(400, str(e), param="messages", code="chat_template_error") from None
    check_text_length(tok, text, max_len, "messages")
    return tok.encode(text, add_bos=False)  # as encode_chat: the template writes what it needs



def top_dict(tok, top) -> dict[str, float]:
    """The completions API keys top log-probabilities by token text: of ids that read alike,
    the most likely one stands."""
    out: dict[str, float] = {}
    for token, logprob in top:
        out.setdefault(token_text(tok, token), logprob)
    return out


def token_text(tok, token: int) -> str:
    return tok.decode([token], skip_special=False)


def chat_logprob(tok, token: int, logprob: float) -> dict:
    text = token_text(tok, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
