"""/tokenize and /detokenize, as vLLM's and llama-server's."""
from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from rjax.server.context import Context
from rjax.server.errors import APIError
from rjax.server.flight import chat_prompt
from rjax.server.schemas import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest


def routes(ctx: Context) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        setup = ctx.ready()
        tok = setup.tokenizer
        if body.messages is not None:
            chat = ChatCompletionRequest(model=setup.model_id, messages=body.messages)
            ids = await run_in_threadpool(chat_prompt, tok, chat, setup.model_id, ctx.limits().max_len,
                                          body.add_generation_prompt)
        else:
            text = body.prompt if body.prompt is not None else body.content
            ids = await run_in_threadpool(tok.encode, text, None if body.add_special_tokens else False)
        return {"tokens": ids, "count": len(ids), "max_model_len": ctx.limits().max_len}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        setup = ctx.ready()
        bad = [t for t in body.tokens if not 0 <= t < setup.tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is not in the vocabulary [0, {setup.tokenizer.vocab_size})",
                           param="tokens", code="invalid_value")
        text = setup.tokenizer.decode(body.tokens, skip_special=False)
        return {"prompt": text, "content": text}

    return router
