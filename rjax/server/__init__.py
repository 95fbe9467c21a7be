"""`rjax serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

    pip install 'rjax[serve]'
    rjax serve -m smollm2-135m-instruct --port 8000

Modules: `app` (the FastAPI app), its routes by family (`routes_completions`,
`routes_embeddings`, `routes_tokenize`, `routes_models`) over one `context`, `flight` (one
request in flight: typed engine requests out, events back), `middleware` (host, key, body size,
draining, counts), `errors` (the OpenAI error body), `edge` (the TCP edge), `loop` (the engine's
own thread), `text` (detokenization and stop strings), `tools` (tool calls), `schemas` (request
bodies), `metrics` (Prometheus), `cli` (the subcommand). It imports rjax.runtime and below;
only rjax.cli imports it, so the server's packages are needed only to serve.
"""
