"""Layer calls (the plan's `layer_calls`, on the XLA path): each layer runs as two calls of
computations that equal layers share. The logits and the cache must be those of the layers
written out one by one, bit for bit, and a program must hold one copy of a layer however deep
the model is."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rjax.math import model
from rjax.math.cache import init_cache
from rjax.math.paged_cache import init_paged_cache, set_block_tables


def _caches(cfg, kv_dtype):
    contiguous = init_cache(cfg, 2, 32, kv_dtype=kv_dtype)
    paged = init_paged_cache(cfg, 2, 8, 8, 32, kv_dtype=kv_dtype)
    # slot 0 on pages 5, 1; slot 1 on pages 2, 7: the pool is shared, out of order
    paged = set_block_tables(paged, jnp.arange(2), jnp.asarray([[5, 1, -1, -1], [2, 7, -1, -1]], jnp.int32))
    return {"contiguous": contiguous, "paged": paged}


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_layer_calls_equal_the_layers_one_by_one(tiny, kv_dtype):
    cfg, params = tiny
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    pos = jnp.asarray([[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, -1, -1, -1]], jnp.int32)
    step = jax.jit(lambda p, c, t, q, plan: model.forward(cfg, p, c, t, q, plan=plan), static_argnums=4)
    for name, cache in _caches(cfg, kv_dtype).items():
        out = {}
        for calls in (False, True):
            c, logits = cache, []
            for t, q in ((tokens, pos), (tokens[:, :1], jnp.asarray([[9], [6]], jnp.int32))):
                plan = dataclasses.replace(model.plan_of(cfg, params, c, t, None, jnp.float32), layer_calls=calls)
                lg, c = step(params, c, t, q, plan)
                logits.append(np.asarray(lg))
            out[calls] = logits, [np.asarray(x) for x in jax.tree.leaves(c)]
        for a, b in zip(out[False][0] + out[False][1], out[True][0] + out[True][1]):
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_a_program_holds_one_copy_of_a_layer(tiny):
    """The functions a program defines do not grow with depth (the last layer's second call is
    a pruned copy: its residual output goes unused), and each layer calls them."""
    cfg, params = tiny

    def text(n):
        deep = dataclasses.replace(cfg, n_layers=n, layer_windows=(None,) * n,
                                   layer_rope_theta=cfg.layer_rope_theta[:1] * n, layer_rope_linear=(1.0,) * n)
        deep_params = dataclasses.replace(params, layers=params.layers[:1] * n)
        cache = init_cache(deep, 1, 16)
        t = jnp.zeros((1, 1), jnp.int32)
        assert model.plan_of(deep, deep_params, cache, t, None, jnp.float32).layer_calls  # the CPU's plan
        return jax.jit(lambda p, c, t, q: model.forward(deep, p, c, t, q)).lower(deep_params, cache, t, t).as_text()

    three, six = text(3), text(6)
    assert three.count("func.func private") == six.count("func.func private")
    assert six.count("call @_attention_in") == six.count("call @_attention_out") == 6
