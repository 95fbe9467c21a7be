"""/health, /metrics and /v1/models."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from rjax.server.context import Context
from rjax.server.errors import APIError


def routes(ctx: Context) -> APIRouter:
    router, loop = APIRouter(), ctx.loop

    @router.get("/health")
    async def health():
        if loop.error is not None:
            return JSONResponse({"status": "failed", "error": loop.error}, status_code=503)
        if not loop.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503,
                                headers={"Retry-After": str(ctx.settings.retry_after_s)})
        health = {"status": "ok", "compiling": loop.compiling, "failed_steps": loop.failed_steps}
        if loop.last_failure is not None:
            health["last_failure"] = loop.last_failure
        return health

    @router.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(ctx.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    def model_card(setup) -> dict:
        limits = loop.limits
        return {"id": setup.model_id, "object": "model", "created": ctx.created, "owned_by": "rjax",
                "max_model_len": limits.max_len if limits is not None else None}

    @router.get("/v1/models")
    async def models():
        setup = ctx.ready()
        return {"object": "list", "data": [model_card(setup)]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        setup = ctx.ready()
        if model_id != setup.model_id:
            raise APIError(404, f"The model '{model_id}' does not exist; this server serves '{setup.model_id}'.",
                           param="model", code="model_not_found")
        return model_card(setup)

    return router
