"""What every HTTP request meets before a route: the server's settings (`ServerSettings`), the
Host names it answers to, the API key, the body-size limit, draining for shutdown
(`Edge`), and the count of responses by route and status (`CountRequests`); both plain ASGI
middlewares, which leave streaming and disconnects alone."""
from __future__ import annotations

import dataclasses
import hmac

from rjax.server.errors import APIError
from rjax.server.metrics import Metrics


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



_ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize",
           "/health", "/metrics")



class CountRequests:
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


class Edge:
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

