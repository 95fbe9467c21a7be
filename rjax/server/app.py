"""The OpenAI-compatible HTTP app: /v1/models, /v1/completions, /v1/chat/completions,
/v1/embeddings, /tokenize and /detokenize (as vLLM's and llama-server's), /health and /metrics
over an EngineLoop.

A request's choices go to the engine loop as separate sequences; their events come back into
the request's own asyncio queue, where the handler detokenizes them, cuts them at stop strings
and sends them on (server-sent events with `stream: true`, one JSON body without). A client that
goes away cancels its sequences at once, which frees their slots and pages. Errors have the
OpenAI body {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hmac
import json
import logging
import threading
import time
import traceback
import uuid
from typing import Any, AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from rjax.grammar import GrammarError, Grammars
from rjax.scoring import embed_ids
from rjax.server.loop import EngineFailure, EngineLoop, QueueFullError
from rjax.server.metrics import Metrics
from rjax.server.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                                 SamplingRequest, TokenizeRequest)
from rjax.server.text import ChoiceText, Piece
from rjax.server.tools import ToolStream, call_grammar, parse_tool_calls, render_messages, tool_format
from rjax.serving import TokenLogprob
from rjax.tokenizer import ChatTemplateError

log = logging.getLogger("rjax.server")


DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    # required as "Authorization: Bearer KEY" on every route but /health (and /metrics when
    # metrics_public) when set
    api_key: str | None = None
    metrics_public: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger request body gets 413 before it is parsed
    retry_after_s: int = 1       # the Retry-After of a 429 (queue full) or 503 (still loading, draining)
    # the Host header names a request may carry ("*.example.com" takes subdomains), None: any. A
    # server on a loopback address answers to loopback names only (`allowed_hosts`), so that a web
    # page that rebinds its own name to 127.0.0.1 cannot reach it from the user's browser.
    allowed_hosts: tuple[str, ...] | None = None


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def allowed_hosts(bind_host: str, option: str | None) -> tuple[str, ...] | None:
    """The Host names a server bound to `bind_host` answers to: `option` (comma-separated, "*"
    for any) when given, else the loopback names on a loopback address and any name otherwise."""
    if option is not None:
        names = tuple(n.strip().lower().rstrip(".") for n in option.split(",") if n.strip())
        if not names:
            raise ValueError(f"--allowed-hosts {option!r} names no host: give names, or '*' for any")
        return None if "*" in names else names
    return LOOPBACK_NAMES if bind_host.lower().strip("[]") in LOOPBACK_NAMES else None


def _host_name(header: bytes) -> str:
    """The name in a Host header, without its port: "[::1]:8000" -> "::1"."""
    host = header.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _host_allowed(name: str, allowed: tuple[str, ...]) -> bool:
    name = name.rstrip(".")
    return any(name == a or (a.startswith("*.") and name.endswith(a[1:])) for a in allowed)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# Engine finish reasons as the API names them: running out of context is a length limit too.
_FINISH = {"stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}
_ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize",
           "/health", "/metrics")


class _CountRequests:
    """Counts responses by route and status (a plain ASGI middleware: it leaves streaming and
    disconnects alone)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope["path"]
            route = path if path in _ROUTES else "/v1/models" if path.startswith("/v1/models/") else "other"
            self.metrics.http_requests.labels(route, str(status[0])).inc()


class _Edge:
    """What every request meets before a route (a plain ASGI middleware): 503 once the server
    drains for shutdown, 400 for a Host the server does not answer to, 401 without the API key, 413 for a body past the limit, which is read
    here (and handed on whole) so that no route parses an oversized body."""

    def __init__(self, app, settings: ServerSettings, draining):
        self.app, self.settings, self.draining = app, settings, draining

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, s = scope["path"], self.settings
        if self.draining.is_set():
            return await APIError(503, "the server is shutting down", type="server_error", code="shutting_down",
                                  headers={"Retry-After": str(s.retry_after_s), "Connection": "close"}
                                  ).response()(scope, receive, send)
        if s.allowed_hosts is not None:
            name = _host_name(dict(scope["headers"]).get(b"host", b""))
            if not _host_allowed(name, s.allowed_hosts):
                return await APIError(400, f"Host {name!r} is not a name this server answers to ("
                                      f"{', '.join(s.allowed_hosts)}); start it with --allowed-hosts to add names.",
                                      code="invalid_host").response()(scope, receive, send)
        if s.api_key is not None and path != "/health" and not (s.metrics_public and path == "/metrics"):
            refusal = _authorization_error(dict(scope["headers"]).get(b"authorization", b""), s.api_key)
            if refusal is not None:
                return await refusal.response()(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"").decode("latin-1").strip()
        if declared.isdigit() and int(declared) > s.max_body_bytes:
            return await self._too_large(int(declared))(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # gone before the body arrived
                return
            size += len(message.get("body", b""))
            if size > s.max_body_bytes:
                return await self._too_large(None)(scope, receive, send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # what follows the body: a disconnect

        await self.app(scope, replay, send)

    def _too_large(self, size: int | None):
        """413 for a body of `size` bytes (None: more than the limit, found while reading it)."""
        limit = self.settings.max_body_bytes
        return APIError(413, f"The request body has {f'more than {limit:,}' if size is None else f'{size:,}'} bytes; "
                        f"the server takes at most {limit:,} (--max-body-bytes).",
                        code="request_too_large", headers={"Connection": "close"}).response()


def _authorization_error(header: bytes, api_key: str) -> APIError | None:
    scheme, _, key = header.decode("latin-1").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return APIError(401, "Missing API key: send it as 'Authorization: Bearer KEY'.", code="invalid_api_key")
    if not hmac.compare_digest(key.strip().encode("latin-1"), api_key.encode()):
        return APIError(401, "Incorrect API key provided.", code="invalid_api_key")
    return None


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
    app.add_middleware(_Edge, settings=settings, draining=draining)
    app.add_middleware(_CountRequests, metrics=metrics)  # outermost: counts the edge's refusals too
    created = int(time.time())

    # -- errors ---------------------------------------------------------------------------------

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        return _validation_error(e.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return APIError(e.status_code, str(e.detail), code=None if e.status_code != 404 else "not_found",
                        headers=getattr(e, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").response()

    # -- dependencies ---------------------------------------------------------------------------

    def ready():
        if loop.error is not None:
            raise APIError(503, f"the model could not be served: {loop.error}", type="server_error",
                           code="model_not_ready")
        if not loop.ready.is_set() or loop.engine is None:
            raise APIError(503, "the model is still loading and compiling; retry shortly", type="server_error",
                           code="model_not_ready", headers={"Retry-After": str(settings.retry_after_s)})
        return loop.setup

    grammars: dict[int, Grammars] = {}   # by setup: compiled grammars over its tokenizer

    async def constraint_of(body: SamplingRequest, setup, extra=None):
        """A maker of fresh automata for the request's constraint (or `extra`: (param, kind,
        spec)), compiled now (cached by text); None without one. A 400 names the parameter of
        a schema, regex or grammar that does not compile."""
        try:
            given = extra or body.constraint
        except ValueError as e:
            raise APIError(400, str(e), param="response_format") from None
        if given is None:
            return None
        param, kind, spec = given
        engine = _engine(loop)
        g = grammars.get(id(setup))
        if g is None:
            g = grammars[id(setup)] = Grammars(setup.tokenizer, engine.cfg.vocab_size, engine.default_stop_ids)
        try:
            await run_in_threadpool(g.constraint, kind, spec)
        except GrammarError as e:
            raise APIError(400, str(e), param=param, code="invalid_value") from None
        return lambda: g.constraint(kind, spec)

    # -- routes ---------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if loop.error is not None:
            return JSONResponse({"status": "failed", "error": loop.error}, status_code=503)
        if not loop.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503,
                                headers={"Retry-After": str(settings.retry_after_s)})
        health = {"status": "ok", "compiling": loop.compiling, "failed_steps": loop.failed_steps}
        if loop.last_failure is not None:
            health["last_failure"] = loop.last_failure
        return health

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    def model_card(setup) -> dict:
        engine = loop.engine
        return {"id": setup.model_id, "object": "model", "created": created, "owned_by": "rjax",
                "max_model_len": engine.config.max_len if engine is not None else None}

    @app.get("/v1/models")
    async def models():
        setup = ready()
        return {"object": "list", "data": [model_card(setup)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        setup = ready()
        if model_id != setup.model_id:
            raise APIError(404, f"The model '{model_id}' does not exist; this server serves '{setup.model_id}'.",
                           param="model", code="model_not_found")
        return model_card(setup)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        setup = ready()
        _check_model(body, setup)
        tok = setup.tokenizer
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs (log-probabilities of the prompt) is not supported",
                           param="echo", code="unsupported_parameter")
        max_len = _engine(loop).config.max_len
        prompts = await run_in_threadpool(_completion_prompts, body.prompt, tok, max_len)  # off the event loop
        n_top = body.logprobs
        constraint = await constraint_of(body, setup)
        gen = _start(loop, tok, body, prompts, default_max=lambda p, max_len: 16, logprobs=n_top is not None,
                     prompt_param="prompt", constraint=constraint)
        rid, model_id = f"cmpl-{uuid.uuid4().hex}", setup.model_id
        echoes = [tok.decode(p) if body.echo else "" for p in prompts]

        def choice_logprobs(entries: list[TokenLogprob], offset: int):
            if n_top is None:
                return None
            texts = [_token_text(tok, e.token) for e in entries]
            offsets, at = [], offset
            for t in texts:
                offsets.append(at)
                at += len(t)
            return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
                    "top_logprobs": [_top_dict(tok, e.top[:n_top]) for e in entries],
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

            return _sse(request, gen, chunks())

        texts, entries, finishes = await gen.collect(request)
        choices = []
        for i in range(gen.n):
            echo = echoes[i // body.n]
            choices.append({"index": i, "text": echo + texts[i], "logprobs": choice_logprobs(entries[i], len(echo)),
                            "finish_reason": finishes[i]})
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_id,
                "choices": choices, "usage": gen.usage(), "system_fingerprint": None}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        setup = ready()
        _check_model(body, setup)
        tok = setup.tokenizer
        prompt = await run_in_threadpool(_chat_prompt, tok, body, setup.model_id, _engine(loop).config.max_len)
        n_top = (body.top_logprobs or 0) if body.logprobs else None
        if body.max_completion_tokens is not None:
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        mode, fmt = body.tool_mode, tool_format(tok.chat_template)
        forced = None
        if mode is not None and mode[2]:   # a call is required: the grammar writes one
            forced = ("tool_choice", "lark", call_grammar(mode[0], mode[1], fmt))
        constraint = await constraint_of(body, setup, forced)
        gen = _start(loop, tok, body, [prompt], default_max=lambda p, max_len: max_len - len(p),
                     logprobs=n_top is not None, prompt_param="messages", constraint=constraint)
        rid, model_id = f"chatcmpl-{uuid.uuid4().hex}", setup.model_id

        def choice_logprobs(entries: list[TokenLogprob]):
            if n_top is None:
                return None
            return {"content": [dict(_chat_logprob(tok, e.token, e.logprob),
                                     top_logprobs=[_chat_logprob(tok, i, v) for i, v in e.top[:n_top]])
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

            return _sse(request, gen, chunks())

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

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        setup = ready()
        _check_model(body, setup)
        engine = _engine(loop)
        d = engine.cfg.d_model
        if body.dimensions is not None and body.dimensions != d:
            raise APIError(400, f"dimensions {body.dimensions} is not supported: this model's embeddings have {d} "
                                f"dimensions (leave dimensions out)", param="dimensions", code="unsupported_parameter")
        prompts = await run_in_threadpool(_completion_prompts, body.input, setup.tokenizer,
                                          _engine(loop).config.max_len)
        try:
            vectors = await run_in_threadpool(embed_ids, engine.cfg, engine.params, prompts,
                                              max_tokens=engine.config.max_len)
        except ValueError as e:
            raise APIError(400, str(e), param="input") from None
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if body.encoding_format == "base64"
                 else v.tolist()} for i, v in enumerate(vectors)]
        n = sum(len(p) for p in prompts)
        return {"object": "list", "data": data, "model": setup.model_id,
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        setup = ready()
        tok = setup.tokenizer
        if body.messages is not None:
            chat = ChatCompletionRequest(model=setup.model_id, messages=body.messages)
            ids = await run_in_threadpool(_chat_prompt, tok, chat, setup.model_id, _engine(loop).config.max_len,
                                          body.add_generation_prompt)
        else:
            text = body.prompt if body.prompt is not None else body.content
            ids = await run_in_threadpool(tok.encode, text, None if body.add_special_tokens else False)
        return {"tokens": ids, "count": len(ids), "max_model_len": _engine(loop).config.max_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        setup = ready()
        bad = [t for t in body.tokens if not 0 <= t < setup.tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is not in the vocabulary [0, {setup.tokenizer.vocab_size})",
                           param="tokens", code="invalid_value")
        text = setup.tokenizer.decode(body.tokens, skip_special=False)
        return {"prompt": text, "content": text}

    return app


def _engine(loop: EngineLoop):
    engine = loop.engine
    if engine is None:  # being rebuilt after a failure
        raise APIError(503, "the engine is restarting; retry shortly", type="server_error", code="model_not_ready",
                       headers={"Retry-After": "1"})
    return engine


# ---------------------------------------------------------------------------------------------
# one request in flight

class _Generation:
    """The choices of one HTTP request: engine sequences submitted together, their events
    gathered from this request's own queue."""

    def __init__(self, loop: EngineLoop, tokenizer, requests: list[dict], stops: Sequence[str],
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

    async def collect(self, request: Request) -> tuple[list[str], list[list[TokenLogprob]], list[str]]:
        """Run to the end (cancelled if the client disconnects meanwhile)."""
        texts, entries, finishes = [""] * self.n, [[] for _ in range(self.n)], ["stop"] * self.n
        with _watch_disconnect(request, self):
            async for i, piece, finish in self.events():
                texts[i] += piece.text
                entries[i] += piece.logprobs
                if finish is not None:
                    finishes[i] = finish
        return texts, entries, finishes


@contextlib.contextmanager
def _watch_disconnect(request: Request, gen: _Generation):
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


def _sse(request: Request, gen: _Generation, chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        with _watch_disconnect(request, gen):
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

def _check_model(body: SamplingRequest, setup) -> None:
    if body.model != setup.model_id:
        raise APIError(400, f"The model '{body.model}' does not exist; this server serves '{setup.model_id}'.",
                       param="model", code="model_not_found")


def _check_text_length(tok, text: str, max_len: int, param: str) -> None:
    """Refuse a text that cannot fit the context by its length alone, before it is encoded."""
    at_least = tok.min_tokens(text)
    if at_least >= max_len:
        raise APIError(400, f"This model's maximum context length is {max_len} tokens; the {param} has "
                       f"{len(text):,} characters, at least {at_least:,} tokens.", param=param,
                       code="context_length_exceeded")


def _start(loop: EngineLoop, tok, body: SamplingRequest, prompts: list[list[int]], *, default_max, logprobs: bool,
           prompt_param: str, constraint=None) -> _Generation:
    """Check and queue the request's sequences; `constraint`: None, or a maker of a fresh
    `rjax.grammar.Constraint` for each."""
    engine = _engine(loop)
    max_len = engine.config.max_len
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
            engine.check_request(p, max_new_tokens=max_tokens, **sampling)
        except ValueError as e:
            named = [f for f in ("logit_bias", *sampling) if str(e).startswith(f)]
            raise APIError(400, str(e), param=named[0] if named else prompt_param) from None
        for _ in range(body.n):
            requests.append(dict(prompt=p, max_new_tokens=max_tokens, seed=body.seed, sample_index=len(requests),
                                 logprobs=logprobs, constraint=constraint() if constraint else None, **sampling,
                                 **({"stop_ids": ()} if body.ignore_eos else {})))
    try:
        return _Generation(loop, tok, requests, body.stop_strings, engine.default_stop_ids,
                           sum(len(p) for p in prompts))
    except QueueFullError as e:
        raise APIError(429, str(e), type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": "1"}) from None


def _completion_prompts(prompt, tok, max_len: int) -> list[list[int]]:
    if isinstance(prompt, str) or isinstance(prompt[0], str):
        texts = [prompt] if isinstance(prompt, str) else prompt
        for text in texts:
            _check_text_length(tok, text, max_len, "prompt")
        return [tok.encode(text) for text in texts]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


def _chat_prompt(tok, body: ChatCompletionRequest, model_id: str, max_len: int,
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
    _check_text_length(tok, text, max_len, "messages")
    return tok.encode(text, add_bos=False)  # as encode_chat: the template writes what it needs


def _union_branch(part) -> bool:
    """A part of an error's location that names the branch of a union ('str', 'list[int]'), not a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part or "-" in part)


def _validation_error(errors: Sequence[dict]) -> APIError:
    # Of a union's errors, one that is not a plain type mismatch names the limit the value broke
    # (100 stop strings: the 4-string limit of the list branch, not "not a string").
    errors = sorted(errors, key=lambda e: str(e.get("type", "")).endswith("_type"))
    e = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(x) for x in e.get("loc", ()) if x != "body" and not _union_branch(x)]
    if e.get("type") == "json_invalid":
        return APIError(400, f"We could not parse the JSON body of your request: {e.get('msg')}.",
                        code="invalid_json")
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    if e.get("type") == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {loc[-1]}", param=loc[-1],
                        code="unknown_parameter")
    return APIError(400, f"{'.'.join(loc) or 'body'}: {msg}", param=loc[0] if loc else None,
                    code="invalid_value")


def _top_dict(tok, top) -> dict[str, float]:
    """The completions API keys top log-probabilities by token text: of ids that read alike,
    the most likely one stands."""
    out: dict[str, float] = {}
    for token, logprob in top:
        out.setdefault(_token_text(tok, token), logprob)
    return out


def _token_text(tok, token: int) -> str:
    return tok.decode([token], skip_special=False)


def _chat_logprob(tok, token: int, logprob: float) -> dict:
    text = _token_text(tok, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
