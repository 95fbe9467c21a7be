"""rjax CLI with engine.decode_loop replaced by a fixed-trip-count loop (no per-step predicate)."""
import functools
import sys

import jax
import jax.numpy as jnp

from rjax import engine


@functools.partial(jax.jit, static_argnames=("cfg", "n_steps"), donate_argnames=("cache",))
def decode_loop(cfg, params, cache, state, sp, stop_ids, n_steps):
    B = state.last_token.shape[0]
    out0 = jnp.full((B, n_steps), -1, jnp.int32)

    def body(i, carry):
        out, state, cache = carry
        active = ~state.done & (cache.lengths < cache.max_len)
        logits, cache = engine._decode_logits(cfg, params, cache, state.last_token, active)
        key, sub = jax.random.split(state.key)
        tok = engine.sample(logits, sub, sp)
        out = out.at[:, i].set(jnp.where(active, tok, -1))
        remaining = state.remaining - active.astype(jnp.int32)
        done = state.done | (active & (engine._is_stop(tok, stop_ids) | (remaining <= 0) | (cache.lengths >= cache.max_len)))
        state = engine.DecodeState(jnp.where(active, tok, state.last_token), done, remaining, key)
        return out, state, cache

    out, state, cache = jax.lax.fori_loop(0, n_steps, body, (out0, state, cache))
    return out, state, cache


engine.decode_loop = decode_loop
from rjax.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
