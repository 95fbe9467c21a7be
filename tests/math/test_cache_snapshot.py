"""snapshot / restore of one slot's KV, as pure jitted functions, on both cache kinds."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rjax.engine import steps
from rjax.math.cache import PrefixSnapshot, init_cache, restore, snapshot
from rjax.math.paged_cache import init_paged_cache, set_block_tables
from rjax.math.sampling import SamplingParams

PREFIX = [7, 3, 99, 41, 5, 18, 250, 6, 77, 12, 9]
N = 8


def _cache(cfg, kind, n_slots=3, max_len=32):
    if kind == "contiguous":
        return init_cache(cfg, n_slots, max_len)
    cache = init_paged_cache(cfg, n_slots, n_pages=n_slots * max_len // 8, page_size=8, max_len=max_len)
    # Each slot its own pages, in a scrambled order (a snapshot must follow the table).
    pages = np.random.default_rng(0).permutation(cache.n_pages).reshape(n_slots, -1).astype(np.int32)
    return set_block_tables(cache, jnp.arange(n_slots), jnp.asarray(pages))


def _prefill(cfg, params, cache, slot, ids):
    tokens, lengths = steps.pad_prompts([ids])
    logits, cache = steps.prefill(cfg, params, cache, jnp.asarray(tokens), jnp.asarray(lengths),
                                   jnp.asarray([slot], jnp.int32))
    return logits[0], cache


def _greedy(cfg, params, cache, slot, first, n):
    """n greedy tokens in `slot` from the token `first` on (the other slots idle), and the cache."""
    out = []
    tok = int(first)
    for _ in range(n):
        tokens = jnp.zeros(cache.n_slots, jnp.int32).at[slot].set(tok)
        active = jnp.zeros(cache.n_slots, bool).at[slot].set(True)
        logits, cache = steps.decode_step(cfg, params, cache, tokens, active)
        tok = int(jnp.argmax(logits[slot]))
        out.append(tok)
    return out, cache


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_round_trip_is_exact(tiny, kind):
    cfg, params = tiny
    _, cache = _prefill(cfg, params, _cache(cfg, kind), 0, PREFIX)
    snap = snapshot(cache, 0)
    assert isinstance(snap, PrefixSnapshot) and int(snap.length) == len(PREFIX)
    moved = restore(cache, 2, snap)
    again = snapshot(moved, 2)
    n = len(PREFIX)
    np.testing.assert_array_equal(np.asarray(again.k)[:, :, :n], np.asarray(snap.k)[:, :, :n])
    np.testing.assert_array_equal(np.asarray(again.v)[:, :, :n], np.asarray(snap.v)[:, :, :n])
    assert int(again.length) == n and np.asarray(moved.lengths).tolist() == [n, 0, n]
    # Slot 0 and slot 1 are untouched.
    for a, b in zip(snapshot(moved, 0).k, snap.k):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.asarray(snapshot(moved, 1).k).any()


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_forks_equal_fresh_prefills(tiny, kind):
    """A prefix prefilled once, restored into two slots, each continued with its own suffix:
    the same greedy tokens as prefilling prefix + suffix from scratch."""
    cfg, params = tiny
    _, cache = _prefill(cfg, params, _cache(cfg, kind), 0, PREFIX)
    snap = snapshot(cache, 0)
    forks = _cache(cfg, kind)
    for slot in (1, 2):
        forks = restore(forks, slot, snap)
    suffixes = {1: [30, 31], 2: [200]}
    got = {}
    for slot, suffix in suffixes.items():
        logits, forks = _prefill(cfg, params, forks, slot, suffix)
        got[slot], forks = _greedy(cfg, params, forks, slot, jnp.argmax(logits), N)
    for slot, suffix in suffixes.items():
        logits, fresh = _prefill(cfg, params, _cache(cfg, kind), slot, PREFIX + suffix)
        assert got[slot] == _greedy(cfg, params, fresh, slot, jnp.argmax(logits), N)[0], slot


def test_vmap_forks_over_sampling_keys(tiny):
    """One snapshot, many continuations sampled with different keys in one batched call."""
    cfg, params = tiny
    logits, cache = _prefill(cfg, params, init_cache(cfg, 1, 32), 0, PREFIX)
    snap = snapshot(cache, 0)
    forks = init_cache(cfg, 4, 32)
    forks = jax.lax.fori_loop(0, 4, lambda s, c: restore(c, s, snap), forks)
    assert np.asarray(forks.lengths).tolist() == [len(PREFIX)] * 4
    sp = SamplingParams.make(4, temperature=1.0)
    keys = jax.random.split(jax.random.key(1), 4)
    first = jax.vmap(lambda k: jax.random.categorical(k, logits))(keys).astype(jnp.int32)
    state = steps.initial_state(first, jnp.full((4,), N, jnp.int32), jnp.asarray([-1], jnp.int32),
                                 jax.random.key(2), forks)
    out, _, _ = steps.decode_loop(cfg, params, forks, state, sp, jnp.asarray([-1], jnp.int32), N)
    out = np.asarray(out)
    # The budget of N counts the first token: N - 1 more.
    assert out.shape == (4, N) and (out[:, :N - 1] >= 0).all() and (out[:, N - 1] == -1).all()
    assert len({tuple(r) for r in out}) > 1  # the keys differ, so do the continuations
