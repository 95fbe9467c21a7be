"""The `rjax serve` subcommand: load a model, compile its programs, serve it under uvicorn."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

# Without --max-len, the longest sequence is the model's context where the memory plan fits it,
# halved until it does, down to this.
MIN_MAX_LEN = 256
PAGE_SIZE = 16
log = logging.getLogger(__name__)


def make_setup(model: str, *, model_id: str, slots: int, max_len: int | None, steps_per_dispatch: int,
               chat_template: tuple[str, str] | None, precompile: bool, prefix_cache: bool = True, kv_dtype: str = "bf16", tp: int = 1,
               speculative: str | None = None, draft_tokens: int = 4):
    """-> the EngineLoop's setup: loads the model and makes engines, on the loop's thread."""
    from rjax.server.loop import Setup

    def setup() -> Setup:
        import jax.numpy as jnp

        import rjax
        from rjax.runtime.generation import activation_dtype, load_drafter
        from rjax.runtime.serving import ServingConfig, ServingEngine

        from rjax.math.tensor_parallel import make_tp

        m = rjax.load(model, mesh=make_tp(tp).mesh if tp > 1 else None)
        tok = m.tokenizer
        if chat_template is not None:
            tok = tok.with_chat_template(*chat_template)
        ctx = m.config.context_length
        if max_len is not None and max_len > ctx:
            raise ValueError(f"--max-len {max_len} exceeds the context length of {m.name} ({ctx} tokens)")
        stop_ids = sorted(tok.eos_ids)
        # A draft model (anything but prompt lookup) is loaded beside the target, as rjax.generate loads it.
        draft = load_drafter(m, speculative)[1] if speculative not in (None, "ngram") else None

        def config_for(length: int) -> ServingConfig:
            return ServingConfig(n_slots=slots, max_len=length,
                                 page_size=PAGE_SIZE if length % PAGE_SIZE == 0 else None,
                                 steps_per_dispatch=steps_per_dispatch, max_stop_ids=max(8, len(stop_ids)),
                                 kv_dtype=jnp.dtype(activation_dtype()).name if kv_dtype == "bf16" else kv_dtype,
                                 prefix_cache=prefix_cache, speculative=speculative if draft is None else "model",
                                 draft_tokens=draft_tokens)

        config = config_for(max_len if max_len is not None else
                            fitting_max_len(m, config_for, None if draft is None else draft.config))
        pair = None if draft is None else (draft.config, draft.params)
        return Setup(tok, lambda: ServingEngine(m.config, m.params, config, stop_ids=stop_ids, draft=pair), model_id,
                     precompile)

    return setup


def fitting_max_len(model, config_for, draft_cfg=None) -> int:
    """The model's context where the memory plan fits a cache of it for every slot, else the
    longest half of it that fits (logged); MemoryFitError where not even MIN_MAX_LEN does."""
    from rjax.engine.memory import MemoryFitError
    from rjax.runtime.serving import check_memory

    ctx = length = model.config.context_length
    while True:
        try:
            check_memory(model.config, model.params, config_for(length), draft_cfg)
            break
        except MemoryFitError as e:
            if length <= MIN_MAX_LEN:
                raise
            length, refusal = max(MIN_MAX_LEN, length // 2), e
    if length < ctx:
        log.info("--max-len %d: a cache of the model's context (%d positions) for every slot does not fit (%s)",
                 length, ctx, refusal)
    return length


def cmd_serve(a) -> int:
    try:
        import uvicorn

        from rjax.server.app import create_app
        from rjax.server.edge import default_max_connections, guarded_protocol
        from rjax.server.loop import EngineLoop
        from rjax.server.metrics import Metrics
        from rjax.server.middleware import DEFAULT_MAX_BODY_BYTES, ServerSettings, allowed_hosts

        DrainingServer = _draining_server_class()
    except ImportError as e:
        raise ValueError(f"rjax serve needs the server's packages ({e.name} is missing): "
                         f"pip install 'rjax[serve]'") from None
    for name in ("slots", "max_queued", "steps_per_dispatch", "port", "max_body_bytes", "max_connections"):
        value = getattr(a, name)
        if value is not None and value < (0 if name == "port" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be >= {0 if name == 'port' else 1}, got {value}")
    for name in ("header_timeout", "drain_timeout"):
        if not getattr(a, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(a, name)}")
    hosts = allowed_hosts(a.host, a.allowed_hosts)
    template = None
    if a.chat_template:  # a template that does not compile stops the server before it starts
        from rjax.loading.tokenizer.chat_template import check_chat_template

        try:
            template = (Path(a.chat_template).read_text(encoding="utf-8"), a.chat_template)
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {a.chat_template}: cannot read it: {e}") from None
        check_chat_template(*template)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    metrics = Metrics()
    loop = EngineLoop(make_setup(a.model, model_id=a.served_model_name or Path(a.model).name, slots=a.slots,
                                 max_len=a.max_len, steps_per_dispatch=a.steps_per_dispatch, chat_template=template,
                                 precompile=not a.no_precompile, prefix_cache=not a.no_prefix_cache,
                                 kv_dtype=a.kv_dtype, tp=a.tp, speculative=a.speculative,
                                 draft_tokens=a.draft_tokens),
                      max_queued=a.max_queued, metrics=metrics)
    app = create_app(loop, metrics, ServerSettings(api_key=a.api_key, metrics_public=a.metrics_public,
                                                   max_body_bytes=a.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
                                                   allowed_hosts=hosts))
    max_connections = a.max_connections or default_max_connections()
    config = uvicorn.Config(app, host=a.host, port=a.port, log_level="info",
                            http=guarded_protocol(a.header_timeout, max_connections),
                            timeout_graceful_shutdown=a.drain_timeout)
    DrainingServer(config).run()
    return 0


def _draining_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server; on SIGTERM or SIGINT the app answers new requests with 503 at once
        while uvicorn lets those in flight finish (up to --drain-timeout)."""

        def handle_exit(self, sig, frame) -> None:
            self.config.app.state.draining.set()
            super().handle_exit(sig, frame)

    return DrainingServer


def register_cli(subparsers) -> None:
    from rjax.loading.catalog import DEFAULT_MODEL

    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (pip install 'rjax[serve]')",
        description="Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models), "
                    "with /health and Prometheus /metrics. /health answers 503 until the model is loaded "
                    "and its programs are compiled.")
    p.add_argument("-m", "--model", default=DEFAULT_MODEL,
                   help=f"catalog name, .gguf file or Hugging Face directory (default: {DEFAULT_MODEL})")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--slots", type=int, default=16, help="sequences decoded at once (default: 16)")
    p.add_argument("--tp", type=int, default=1, help="split the model over this many GPUs (tensor parallel; default 1)")
    p.add_argument("--kv-dtype", choices=("bf16", "int8", "fp8"), default="bf16",
                   help="KV cache: bf16 (unquantized, in the activation dtype), int8 (per token and head scales) "
                        "or fp8 (e4m3, per head scales) (default bf16)")
    p.add_argument("--max-len", type=int, default=None,
                   help="positions per sequence, prompt and reply (default: the model's context where the "
                        "memory plan fits it for every slot, else the longest half of it that fits)")
    p.add_argument("--max-queued", type=int, default=256,
                   help="sequences waiting for a slot before new requests get 429 (default: 256)")
    p.add_argument("--steps-per-dispatch", type=int, default=8, help="decode steps per device dispatch (default: 8)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (/metrics and /docs too)")
    p.add_argument("--metrics-public", action="store_true", help="with --api-key: leave /metrics open to scrapers")
    p.add_argument("--allowed-hosts", default=None, metavar="NAME[,NAME...]",
                   help="Host header names the server answers to, '*.example.com' for subdomains, '*' for any "
                        "(default: localhost, 127.0.0.1 and ::1 when --host is a loopback address, else any)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="a larger request body gets 413 before it is parsed (default: 4 MiB)")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open connections the server takes at most; more are closed as they come (default: the "
                        "process's open-file limit less 128)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's headers (default: 10)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let running requests finish while new ones get 503 (default: 30)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the model's (or for a model without one)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients name (default: the -m argument's last path component)")
    p.add_argument("--no-precompile", action="store_true",
                   help="start serving before compiling (the first requests then wait for compilation)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt whole (default: KV pages of earlier prompts with the same "
                        "prefix are shared)")
    p.add_argument("--speculative", default=None, metavar="ngram|self:q4_0|self:q8_0|MODEL",
                   help="speculative decoding, all slots' drafts verified in one pass: 'ngram' (prompt lookup), "
                        "'self:q4_0' / 'self:q8_0' (the model requantized as its own draft model), or a draft "
                        "model with the same tokenizer (catalog name, .gguf file, Hugging Face directory), which "
                        "keeps a KV cache of its own beside the model's (/metrics counts drafted and accepted "
                        "tokens)")
    p.add_argument("--draft-tokens", type=int, default=4, help="with --speculative: tokens drafted per round "
                                                               "(default 4)")
    p.set_defaults(func=cmd_serve)
