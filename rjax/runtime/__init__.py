"""The runtime: host-side work over the engine's programs (typed requests, scheduling, pages, the
serving engine, generate / chat / score). Imports rjax.engine and below."""
