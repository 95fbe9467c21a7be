"""The OpenAI-compatible HTTP app: /v1/models, /v1/completions, /v1/chat/completions,
/v1/embeddings, /tokenize and /detokenize (as vLLM's and llama-server's), /health and /metrics
over an EngineLoop.

The routes live by family (`routes_completions`, `routes_embeddings`, `routes_tokenize`,
`routes_models`), over one `Context` (the loop, the engine's limits, settings, metrics); a
request's choices go to the engine loop as typed requests (`flight`). What every request meets
first is `middleware`'s. Errors have the OpenAI body {"error": {"message", "type", "param",
"code"}} (`errors`).
"""
from __future__ import annotations

import contextlib
import threading

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from rjax.server import routes_completions, routes_embeddings, routes_models, routes_tokenize
from rjax.server.context import Context
from rjax.server.errors import APIError, validation_error
from rjax.server.loop import EngineLoop
from rjax.server.metrics import Metrics
from rjax.server.middleware import CountRequests, Edge, ServerSettings


def create_app(loop: EngineLoop, metrics: Metrics | None = None,
               settings: ServerSettings = ServerSettings()) -> FastAPI:
    """The app over `loop`, which it starts and stops with its lifespan (uvicorn's startup and
    shutdown). Setting `app.state.draining` (a threading.Event; `rjax serve` sets it on SIGTERM)
    makes every new request a 503 while those in flight finish."""
    metrics = metrics or loop.metrics or Metrics()
    draining = threading.Event()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        yield
        await run_in_threadpool(loop.stop)

    app = FastAPI(title="rjax", lifespan=lifespan)
    app.state.draining = draining
    app.add_middleware(Edge, settings=settings, draining=draining)
    app.add_middleware(CountRequests, metrics=metrics)  # outermost: counts the edge's refusals too

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        return validation_error(e.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return APIError(e.status_code, str(e.detail), code=None if e.status_code != 404 else "not_found",
                        headers=getattr(e, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").response()

    ctx = Context(loop, metrics, settings)
    for family in (routes_models, routes_completions, routes_embeddings, routes_tokenize):
        app.include_router(family.routes(ctx))
    return app
