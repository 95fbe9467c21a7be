"""The server's edge, without a model: the ASGI gate every request meets (drain, API key, body
limit) over a stand-in app, and the TCP guard (header timeout, connection cap) under a real
uvicorn on 127.0.0.1."""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request

from rjax.server.edge import guarded_protocol
from rjax.server.errors import APIError
from rjax.server.middleware import LOOPBACK_NAMES, Edge, ServerSettings, allowed_hosts

KEY = "sekret"


def _stand_in(settings: ServerSettings):
    """A FastAPI app with the server's public routes (and FastAPI's docs) behind the edge."""
    inner = FastAPI()

    @inner.get("/health")
    async def health():
        return {"status": "ok"}

    @inner.get("/metrics")
    async def metrics():
        return {"metrics": 1}

    @inner.post("/v1/completions")
    async def completions(request: Request):
        return {"bytes": len(await request.body())}

    draining = threading.Event()
    return Edge(inner, settings, draining), draining


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://edge")


def _error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code, r.text
    return r.json()["error"]["message"]


@pytest.mark.parametrize("metrics_public", [False, True])
def test_the_api_key_covers_every_route_but_health(metrics_public):
    app, _ = _stand_in(ServerSettings(api_key=KEY, metrics_public=metrics_public))
    auth = {"Authorization": f"Bearer {KEY}"}

    async def run():
        async with _client(app) as c:
            assert (await c.get("/health")).status_code == 200
            for path in ("/docs", "/redoc", "/openapi.json", "/v1/models", "/nowhere"):
                _error(await c.get(path), 401, "invalid_api_key")
                assert (await c.get(path, headers=auth)).status_code in (200, 404), path
            _error(await c.get("/docs", headers={"Authorization": "Bearer wrong"}), 401, "invalid_api_key")
            r = await c.get("/metrics")
            if metrics_public:
                assert r.status_code == 200
            else:
                _error(r, 401, "invalid_api_key")
            assert (await c.get("/metrics", headers=auth)).status_code == 200

    asyncio.run(run())


def test_the_names_a_server_answers_to_follow_its_address_and_the_option():
    assert allowed_hosts("127.0.0.1", None) == allowed_hosts("localhost", None) == allowed_hosts("[::1]", None) \
        == LOOPBACK_NAMES
    assert allowed_hosts("0.0.0.0", None) is None and allowed_hosts("10.1.2.3", None) is None
    assert allowed_hosts("127.0.0.1", "*") is None
    assert allowed_hosts("0.0.0.0", " API.example.com., *.corp.net ") == ("api.example.com", "*.corp.net")
    with pytest.raises(ValueError, match="--allowed-hosts ' , ' names no host"):
        allowed_hosts("127.0.0.1", " , ")


def test_a_host_the_server_does_not_answer_to_gets_400_on_every_route():
    """A page whose name was rebound to 127.0.0.1 sends its own name as Host: refused, /health
    included; loopback names with or without a port, and wildcard subdomains, pass."""
    app, _ = _stand_in(ServerSettings(allowed_hosts=LOOPBACK_NAMES + ("*.example.com",)))

    async def run():
        async with _client(app) as c:
            for host in ("localhost:8000", "LOCALHOST", "127.0.0.1", "127.0.0.1:8000", "[::1]:8000", "localhost.",
                         "api.example.com", "a.b.example.com:443"):
                assert (await c.get("/health", headers={"Host": host})).status_code == 200, host
            for host in ("evil.test", "evil.test:8000", "127.0.0.1.nip.io", "example.com", "notexample.com",
                         "localhost.evil.test", ""):
                for path in ("/health", "/v1/completions"):
                    r = await (c.get(path, headers={"Host": host}) if path == "/health" else
                               c.post(path, content=b"{}", headers={"Host": host}))
                    message = _error(r, 400, "invalid_host")
                    assert "--allowed-hosts" in message and "localhost" in message, message

    asyncio.run(run())


def test_a_body_past_the_limit_gets_413_before_it_is_parsed():
    app, _ = _stand_in(ServerSettings(max_body_bytes=1000))

    async def chunks(n):
        for _ in range(n):
            yield b"x" * 300

    async def run():
        async with _client(app) as c:
            assert (await c.post("/v1/completions", content=b"x" * 1000)).json() == {"bytes": 1000}
            m = _error(await c.post("/v1/completions", content=b"x" * 1001), 413, "request_too_large")
            assert m == "The request body has 1,001 bytes; the server takes at most 1,000 (--max-body-bytes)."
            # Without a Content-Length (chunked), the body is counted as it arrives.
            assert (await c.post("/v1/completions", content=chunks(3))).json() == {"bytes": 900}
            m = _error(await c.post("/v1/completions", content=chunks(4)), 413, "request_too_large")
            assert m.startswith("The request body has more than 1,000 bytes")

    asyncio.run(run())


def test_draining_answers_503_to_every_new_request():
    app, draining = _stand_in(ServerSettings())

    async def run():
        async with _client(app) as c:
            assert (await c.get("/health")).status_code == 200
            draining.set()
            for r in (await c.get("/health"), await c.post("/v1/completions", content=b"{}")):
                _error(r, 503, "shutting_down")
                assert r.headers["retry-after"] == "1"

    asyncio.run(run())


# --- TCP: header timeout and connection cap ------------------------------------------------------


async def _hello(scope, receive, send):
    assert scope["type"] == "http"
    await APIError(418, "hello").response()(scope, receive, send)


@pytest.fixture(scope="module")
def guarded():
    """uvicorn over a stand-in app with a 0.5 s header timeout and at most 6 connections."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_hello, lifespan="off", log_level="warning",
                                           http=guarded_protocol(0.5, 6), timeout_keep_alive=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield sock.getsockname()
    server.should_exit = True
    thread.join(10)
    sock.close()


def _closed_after(conn: socket.socket, limit: float = 5.0) -> float:
    """Seconds until the server closes `conn` (reads to EOF)."""
    start = time.monotonic()
    conn.settimeout(limit)
    while conn.recv(4096):
        pass
    return time.monotonic() - start


def test_a_connection_that_never_finishes_its_headers_is_closed(guarded):
    with socket.create_connection(guarded) as silent, socket.create_connection(guarded) as partial:
        partial.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        assert 0.3 < _closed_after(silent) < 2.0
        assert _closed_after(partial) < 2.0
    with socket.create_connection(guarded) as c:  # a whole request is answered
        c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert c.recv(4096).startswith(b"HTTP/1.1 418")
        c.sendall(b"GET / HTTP/1.1\r\n")  # the next request on the connection has the same limit
        assert _closed_after(c) < 2.0


def test_connections_past_the_cap_are_closed_with_one_log_line(guarded, caplog):
    caplog.set_level(logging.WARNING, logger="rjax.server")
    held = [socket.create_connection(guarded) for _ in range(6)]
    try:
        time.sleep(0.1)
        refused = [socket.create_connection(guarded) for _ in range(20)]
        for c in refused:
            assert _closed_after(c, 2.0) < 1.0
            c.close()
        lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(lines) == 1 and "6 are open, the most this server takes (--max-connections 6)" in lines[0]
    finally:
        for c in held:
            c.close()
    time.sleep(0.2)
    with socket.create_connection(guarded) as c:  # room again
        c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert c.recv(4096).startswith(b"HTTP/1.1 418")
