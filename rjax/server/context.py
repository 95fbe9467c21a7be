"""What every route of the app reads: the engine loop and the engine's limits, the server's
settings and metrics, and the compiled grammars of constrained requests."""
from __future__ import annotations

import dataclasses
import time

from starlette.concurrency import run_in_threadpool

from rjax.runtime.grammar import GrammarError, Grammars
from rjax.runtime.request import Limits
from rjax.server.errors import APIError
from rjax.server.loop import EngineLoop
from rjax.server.metrics import Metrics
from rjax.server.middleware import ServerSettings
from rjax.server.schemas import SamplingRequest


@dataclasses.dataclass
class Context:
    loop: EngineLoop
    metrics: Metrics
    settings: ServerSettings
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    # by setup: compiled grammars over its tokenizer
    grammars: dict[int, Grammars] = dataclasses.field(default_factory=dict)

    def ready(self):
        """The loop's Setup, or a 503 while the model loads, or when it could not be served."""
        loop = self.loop
        if loop.error is not None:
            raise APIError(503, f"the model could not be served: {loop.error}", type="server_error",
                           code="model_not_ready")
        if not loop.ready.is_set() or loop.limits is None:
            raise APIError(503, "the model is still loading and compiling; retry shortly", type="server_error",
                           code="model_not_ready", headers={"Retry-After": str(self.settings.retry_after_s)})
        return loop.setup

    def limits(self) -> Limits:
        """The engine's limits, or a 503 while the engine is rebuilt after a failure."""
        limits = self.loop.limits
        if limits is None:
            raise APIError(503, "the engine is restarting; retry shortly", type="server_error",
                           code="model_not_ready", headers={"Retry-After": "1"})
        return limits

    async def constraint_of(self, body: SamplingRequest, setup, extra=None):
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
        limits = self.limits()
        g = self.grammars.get(id(setup))
        if g is None:
            g = self.grammars[id(setup)] = Grammars(setup.tokenizer, limits.vocab_size, limits.default_stop_ids)
        try:
            await run_in_threadpool(g.constraint, kind, spec)
        except GrammarError as e:
            raise APIError(400, str(e), param=param, code="invalid_value") from None
        return lambda: g.constraint(kind, spec)
