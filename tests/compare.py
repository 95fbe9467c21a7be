"""rjax against the oracle's answers for the same prompts: prefill logits, teacher-forced decode
logits and greedy continuations, with every prompt in one cache (one slot each).

Tolerance: max|Δ| <= 1e-3 * max|logit| per logits row; greedy continuations identical.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rjax.engine import steps
from rjax.math.cache import init_cache
from rjax.math.sampling import SamplingParams

RTOL = 1e-3


def relative_error(ours, ref) -> float:
    """max|ours - ref| / max|ref|."""
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def assert_close(ours, ref, what: str, rtol: float = RTOL) -> float:
    err = relative_error(ours, ref)
    assert err <= rtol, f"{what}: max|Δ| = {err:.3g}·max|logit| > {rtol:g}·max|logit|"
    return err


def _prefill(cfg, params, cache, ids, groups, fn, *extra):
    """Prefill the prompts group by group (each group padded to its own bucket) into slots = prompt
    indices. -> (per-prompt outputs in prompt order, cache)."""
    outs = [None] * len(ids)
    for group in groups:
        tokens, lengths = steps.pad_prompts([ids[i] for i in group])
        slots = jnp.asarray(group, jnp.int32)
        out, cache = fn(cfg, params, cache, jnp.asarray(tokens), jnp.asarray(lengths), slots, *extra)
        for j, i in enumerate(group):
            outs[i] = out[j]
    return outs, cache


def check_against_oracle(cfg, params, ids, ref, *, max_len: int, decode_steps: int, greedy: int = 0,
                         groups=None, rtol: float = RTOL) -> float:
    """Assert rjax matches the oracle's `ref` (from `oracle_logits(model, ids, decode_steps,
    greedy_tokens=greedy)`). `groups` lists prompt indices prefilled together (default: all at
    once), so a long prompt need not pad the short ones to its bucket. The greedy continuations
    start from a copy of the cache after the prefill. -> the largest relative error."""
    groups = groups or [list(range(len(ids)))]
    worst = 0.0
    cache = init_cache(cfg, len(ids), max_len)
    logits, cache = _prefill(cfg, params, cache, ids, groups, steps.prefill)
    prompted = (jax.tree.map(jnp.copy, cache), jnp.stack(logits)) if greedy else None
    for i, r in enumerate(ref):
        worst = max(worst, assert_close(logits[i], r["last_logits"], f"prompt {i} after prefill", rtol))
    for step in range(decode_steps):
        feed = jnp.asarray([int(r["step_tokens"][step]) for r in ref], jnp.int32)
        logits, cache = steps.decode_step(cfg, params, cache, feed)
        for i, r in enumerate(ref):
            worst = max(worst, assert_close(logits[i], r["step_logits"][step], f"prompt {i} decode step {step}", rtol))
    np.testing.assert_array_equal(np.asarray(cache.lengths), [len(p) + decode_steps for p in ids])

    if greedy:
        got = greedy_from(cfg, params, *prompted, greedy)
        for i, r in enumerate(ref):
            np.testing.assert_array_equal(got[i], r["greedy"][:greedy], err_msg=f"greedy continuation of prompt {i}")
    return worst


def greedy_from(cfg, params, cache, last_logits, n: int) -> np.ndarray:
    """n greedy tokens for each row of a just-prefilled `cache` whose last prompt logits are
    `last_logits` [B, vocab]: the argmax of those, then the engine's on-device greedy loop (what
    `rjax.generate` runs at temperature 0; tests/engine/test_steps.py checks it against the sampling
    loop at temperature 0). -> [B, n]."""
    B = last_logits.shape[0]
    first = jnp.argmax(last_logits, axis=-1).astype(jnp.int32)
    key = jax.random.key(0)
    stop = jnp.asarray([-1], jnp.int32)  # no stop token: every prompt runs n tokens
    state = steps.initial_state(first, jnp.full((B,), n, jnp.int32), stop, key, cache)
    out, _, _ = steps.greedy_decode_loop(cfg, params, cache, state, SamplingParams.make(B), stop, n - 1)
    return np.concatenate([np.asarray(first)[:, None], np.asarray(out)], axis=1)


def greedy_continuations(cfg, params, ids, n: int, *, max_len: int, groups=None) -> np.ndarray:
    """n greedy tokens per prompt (`greedy_from` after a prefill of every prompt). -> [P, n]."""
    cache = init_cache(cfg, len(ids), max_len)
    logits, cache = _prefill(cfg, params, cache, ids, groups or [list(range(len(ids)))], steps.prefill)
    return greedy_from(cfg, params, cache, jnp.stack(logits), n)
