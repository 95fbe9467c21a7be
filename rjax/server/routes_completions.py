"""/v1/completions and /v1/chat/completions: a request's choices run as engine sequences
(`rjax.server.flight`), streamed as server-sent events or answered as one body."""
from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from rjax.runtime.serving_events import TokenLogprob
from rjax.server.context import Context
from rjax.server.errors import APIError
from rjax.server.flight import (chat_logprob, chat_prompt, check_model, completion_prompts, sse, start, token_text,
                                top_dict)
from rjax.server.schemas import ChatCompletionRequest, CompletionRequest
from rjax.server.tools import ToolStream, call_grammar, parse_tool_calls, tool_format


def routes(ctx: Context) -> APIRouter:
    router, loop = APIRouter(), ctx.loop

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        setup = ctx.ready()
        check_model(body, setup)
        tok = setup.tokenizer
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs (log-probabilities of the prompt) is not supported",
                           param="echo", code="unsupported_parameter")
        max_len = ctx.limits().max_len
        prompts = await run_in_threadpool(completion_prompts, body.prompt, tok, max_len)  # off the event loop
        n_top = body.logprobs
        constraint = await ctx.constraint_of(body, setup)
        gen = start(loop, ctx.limits(), tok, body, prompts, default_max=lambda p, max_len: 16,
                    logprobs=n_top is not None, prompt_param="prompt", constraint=constraint)
        rid, model_id = f"cmpl-{uuid.uuid4().hex}", setup.model_id
        echoes = [tok.decode(p) if body.echo else "" for p in prompts]

        def choice_logprobs(entries: list[TokenLogprob], offset: int):
            if n_top is None:
                return None
            texts = [token_text(tok, e.token) for e in entries]
            offsets, at = [], offset
            for t in texts:
                offsets.append(at)
                at += len(t)
            return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
                    "top_logprobs": [top_dict(tok, e.top[:n_top]) for e in entries],
                    "text_offset": offsets}

        if body.stream:
            async def chunks():
                sent = [0] * gen.n
                async for i, piece, finish in gen.events():
                    text = piece.text
                    if body.echo and sent[i] == 0 and echoes[i // body.n]:
                        text = echoes[i // body.n] + text
                    if not text and finish is None and not piece.logprobs:
                        continue
                    lp = choice_logprobs(piece.logprobs, sent[i] + len(text) - len(piece.text))
                    sent[i] += len(text)
                    yield {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_id,
                           "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}]}
                if body.stream_options and body.stream_options.include_usage:
                    yield {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_id,
                           "choices": [], "usage": gen.usage()}

            return sse(request, gen, chunks())

        texts, entries, finishes = await gen.collect(request)
        choices = []
        for i in range(gen.n):
            echo = echoes[i // body.n]
            choices.append({"index": i, "text": echo + texts[i], "logprobs": choice_logprobs(entries[i], len(echo)),
                            "finish_reason": finishes[i]})
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_id,
                "choices": choices, "usage": gen.usage(), "system_fingerprint": None}

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        setup = ctx.ready()
        check_model(body, setup)
        tok = setup.tokenizer
        prompt = await run_in_threadpool(chat_prompt, tok, body, setup.model_id, ctx.limits().max_len)
        n_top = (body.top_logprobs or 0) if body.logprobs else None
        if body.max_completion_tokens is not None:
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        mode, fmt = body.tool_mode, tool_format(tok.chat_template)
        forced = None
        if mode is not None and mode[2]:   # a call is required: the grammar writes one
            forced = ("tool_choice", "lark", call_grammar(mode[0], mode[1], fmt))
        constraint = await ctx.constraint_of(body, setup, forced)
        gen = start(loop, ctx.limits(), tok, body, [prompt], default_max=lambda p, max_len: max_len - len(p),
                    logprobs=n_top is not None, prompt_param="messages", constraint=constraint)
        rid, model_id = f"chatcmpl-{uuid.uuid4().hex}", setup.model_id

        def choice_logprobs(entries: list[TokenLogprob]):
            if n_top is None:
                return None
            return {"content": [dict(chat_logprob(tok, e.token, e.logprob),
                                     top_logprobs=[chat_logprob(tok, i, v) for i, v in e.top[:n_top]])
                                for e in entries]}

        if body.stream:
            async def chunks():
                def chunk(i, delta, lp=None, finish=None):
                    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                            "model": model_id, "system_fingerprint": None,
                            "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

                streams = [ToolStream(fmt) if mode is not None else None for _ in range(gen.n)]
                for i in range(gen.n):
                    yield chunk(i, {"role": "assistant", "content": ""})
                async for i, piece, finish in gen.events():
                    text = piece.text if streams[i] is None else streams[i].add(piece.text)
                    if text or piece.logprobs:
                        yield chunk(i, {"content": text}, choice_logprobs(piece.logprobs))
                    if finish is not None:
                        content, calls = streams[i].finish() if streams[i] is not None else (None, [])
                        if content:
                            yield chunk(i, {"content": content})
                        for k, call in enumerate(calls):   # as OpenAI streams them: the name, then arguments
                            head = dict(call, function={"name": call["function"]["name"], "arguments": ""})
                            yield chunk(i, {"tool_calls": [dict(head, index=k)]})
                            yield chunk(i, {"tool_calls": [{"index": k, "function": {
                                "arguments": call["function"]["arguments"]}}]})
                        yield chunk(i, {}, None, "tool_calls" if calls else finish)
                if body.stream_options and body.stream_options.include_usage:
                    yield {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                           "model": model_id, "choices": [], "usage": gen.usage()}

            return sse(request, gen, chunks())

        texts, entries, finishes = await gen.collect(request)
        choices = []
        for i in range(gen.n):
            content, calls = parse_tool_calls(texts[i], fmt) if mode is not None else (texts[i], [])
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choices.append({"index": i, "message": message, "logprobs": choice_logprobs(entries[i]),
                            "finish_reason": "tool_calls" if calls else finishes[i]})
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_id,
                "choices": choices, "usage": gen.usage(), "system_fingerprint": None}

    return router
