"""/v1/embeddings: each input's embedding (`rjax.runtime.scoring.embed_ids`), as floats or base64."""
from __future__ import annotations

import base64

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from rjax.server.context import Context
from rjax.server.errors import APIError
from rjax.server.flight import check_model, completion_prompts
from rjax.server.schemas import EmbeddingRequest


def routes(ctx: Context) -> APIRouter:
    router, loop = APIRouter(), ctx.loop

    @router.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        setup = ctx.ready()
        check_model(body, setup)
        limits = ctx.limits()
        d = limits.embedding_size
        if body.dimensions is not None and body.dimensions != d:
            raise APIError(400, f"dimensions {body.dimensions} is not supported: this model's embeddings have {d} "
                                f"dimensions (leave dimensions out)", param="dimensions", code="unsupported_parameter")
        prompts = await run_in_threadpool(completion_prompts, body.input, setup.tokenizer, limits.max_len)
        try:
            vectors = await run_in_threadpool(loop.embed, prompts)
        except ValueError as e:
            raise APIError(400, str(e), param="input") from None
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if body.encoding_format == "base64"
                 else v.tolist()} for i, v in enumerate(vectors)]
        n = sum(len(p) for p in prompts)
        return {"object": "list", "data": data, "model": setup.model_id,
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    return router
