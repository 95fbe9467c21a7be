"""The server's TCP edge: uvicorn's h11 protocol with a header-read timeout and a cap on open
connections.

uvicorn closes a connection that idles after a response (`timeout_keep_alive`), but waits for a
request's headers without limit, and accepts connections until the process runs out of file
descriptors, when every accept fails and asyncio logs a traceback for each. Here a connection
that has not sent a whole request head within `header_timeout_s` (of connecting, or of the
start of its next request) is closed, and a connection past `max_connections` is closed as soon
as it is accepted, with one log line per burst of refusals rather than one per connection.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import resource
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("rjax.server")

# Descriptors kept for everything but client connections: model files, the listening socket,
# compiler caches, logs.
RESERVED_FILES = 128


def default_max_connections() -> int:
    """Open connections the server takes at most: below the process's soft file limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, (soft if soft != resource.RLIM_INFINITY else 1 << 16) - RESERVED_FILES)


@dataclasses.dataclass
class ConnectionCap:
    """Shared by every connection of one server: the cap, and the refusals not yet logged."""

    max_connections: int
    log_every_s: float = 10.0
    refused: int = 0                 # since the last log line
    refused_total: int = 0
    _last_log: float = float("-inf")

    def refuse(self, open_now: int) -> None:
        self.refused += 1
        self.refused_total += 1
        now = time.monotonic()
        if now - self._last_log >= self.log_every_s:
            log.warning("refused %d connection(s): %d are open, the most this server takes (--max-connections %d)",
                        self.refused, open_now, self.max_connections)
            self._last_log, self.refused = now, 0


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus the header timeout and the connection cap."""

    def __init__(self, *args, header_timeout_s: float, cap: ConnectionCap, **kwargs):
        super().__init__(*args, **kwargs)
        self._header_timeout_s, self._cap = header_timeout_s, cap
        self._header_timer = None
        self._refused = False

    def connection_made(self, transport) -> None:
        if len(self.connections) >= self._cap.max_connections:
            self._refused = True
            self._cap.refuse(len(self.connections))
            transport.abort()
            return
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_header_timer()
        if not self._refused:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._awaiting_head():
            if self._header_timer is None and self.timeout_keep_alive_task is None:
                self._arm_header_timer()  # the next request has begun
        else:
            self._disarm_header_timer()

    def _awaiting_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self._header_timeout_s, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._awaiting_head() and not self.transport.is_closing():
            log.debug("closed a connection that sent no request head in %g s", self._header_timeout_s)
            self.transport.close()


def guarded_protocol(header_timeout_s: float, max_connections: int):
    """-> uvicorn's `http` setting: the protocol class with these limits bound."""
    return functools.partial(GuardedH11Protocol, header_timeout_s=header_timeout_s,
                             cap=ConnectionCap(max_connections))
