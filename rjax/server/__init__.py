"""`rjax serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

    pip install 'rjax[serve]'
    rjax serve -m smollm2-135m-instruct --port 8000

Modules: `app` (the FastAPI app and its routes), `loop` (the engine's own thread), `text`
(detokenization and stop strings), `schemas` (request bodies), `metrics` (Prometheus), `cli`
(the subcommand). Nothing here is imported by `rjax` itself, so the server's packages are
needed only to serve.
"""
