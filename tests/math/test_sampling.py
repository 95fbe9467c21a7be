"""On-device sampling: greedy, temperature, top-k and top-p against distributions computed by hand."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rjax.math.sampling import SamplingParams, filtered_logits, sample

LOGITS = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15], np.float64)).astype(np.float32)


def _draw(sp_kwargs, n=4000, seed=0):
    batch = jnp.broadcast_to(jnp.asarray(LOGITS), (n, LOGITS.size))
    tokens = jax.jit(sample)(batch, jax.random.key(seed), SamplingParams.make(n, **sp_kwargs))
    return np.bincount(np.asarray(tokens), minlength=LOGITS.size) / n


def _expected(keep, temperature=1.0):
    p = np.exp(LOGITS.astype(np.float64) / temperature)
    p[~keep] = 0
    return p / p.sum()


def _assert_matches(freq, expected, n=4000):
    # Five standard errors of a binomial proportion, per token.
    tol = 5 * np.sqrt(expected * (1 - expected) / n) + 1e-9
    assert np.all(np.abs(freq - expected) <= tol), (freq, expected)


def test_greedy_is_argmax_and_ignores_the_key():
    logits = jax.random.normal(jax.random.key(1), (8, 1000))
    sp = SamplingParams.make(8)
    a = sample(logits, jax.random.key(2), sp)
    b = sample(logits, jax.random.key(3), sp)
    np.testing.assert_array_equal(a, jnp.argmax(logits, -1))
    np.testing.assert_array_equal(a, b)


def test_temperature_one_follows_the_softmax():
    _assert_matches(_draw(dict(temperature=1.0)), _expected(np.ones(5, bool)))


def test_temperature_sharpens():
    _assert_matches(_draw(dict(temperature=0.5)), _expected(np.ones(5, bool), 0.5))


def test_top_k_keeps_the_k_most_likely():
    _assert_matches(_draw(dict(temperature=1.0, top_k=2)), _expected(np.array([0, 1, 0, 1, 0], bool)))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # Sorted: 0.4, 0.3, 0.15, 0.1, 0.05. p=0.75 needs 0.4+0.3+0.15 (0.7 < 0.75).
    _assert_matches(_draw(dict(temperature=1.0, top_p=0.75)), _expected(np.array([0, 1, 0, 1, 1], bool)))
    # p below the top probability keeps only the top token.
    freq = _draw(dict(temperature=1.0, top_p=0.2))
    np.testing.assert_array_equal(freq, [0, 1, 0, 0, 0])


def test_seeded_sampling_is_reproducible_and_per_row_parameters_mix():
    logits = jax.random.normal(jax.random.key(4), (4, 300)) * 3
    sp = SamplingParams(jnp.asarray([0.0, 1.0, 1.0, 0.7]), jnp.asarray([0, 0, 1, 20], jnp.int32),
                        jnp.asarray([1.0, 0.9, 1.0, 0.5]))
    a = sample(logits, jax.random.key(7), sp)
    b = sample(logits, jax.random.key(7), sp)
    np.testing.assert_array_equal(a, b)
    assert int(a[0]) == int(jnp.argmax(logits[0]))  # greedy row
    assert int(a[2]) == int(jnp.argmax(logits[2]))  # top_k=1 row
    top20 = set(np.argsort(-np.asarray(logits[3]))[:20].tolist())
    assert int(a[3]) in top20


@pytest.mark.parametrize("kw, msg", [(dict(temperature=-1.0), "temperature"), (dict(top_k=-2), "top_k"),
                                     (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p")])
def test_invalid_parameters_are_named(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams.make(1, **kw)


def test_rows_without_filters_draw_the_same_without_them():
    """filters=False (no row uses top-k / top-p) leaves the filters out and draws what the
    program with them draws for those rows; beside filtered rows they draw the same too."""
    logits = jax.random.normal(jax.random.key(4), (6, 300))
    key = jax.random.key(5)
    plain = SamplingParams(jnp.asarray([0.7, 1.0, 1.5, 0.0, 1.0, 0.3]), jnp.zeros(6, jnp.int32), jnp.ones(6))
    a = sample(logits, key, plain, filters=False)
    np.testing.assert_array_equal(a, sample(logits, key, plain))
    mixed = SamplingParams(plain.temperature, jnp.asarray([0, 0, 0, 0, 3, 0]), jnp.asarray([1, 1, 1, 1, 1, 0.5]))
    b = sample(logits, key, mixed)
    np.testing.assert_array_equal(np.asarray(a)[:4], np.asarray(b)[:4])
    assert int(b[4]) in np.argsort(-np.asarray(logits[4]))[:3]
    text = jax.jit(sample, static_argnames="filters").trace(logits, key, plain, False).lower().as_text()
    assert "@filtered_logits" not in text


def _reference_keep(logits, temperature, top_k, top_p):
    """The filters by a stable sort, in float64: [V] bool for one row."""
    x = np.asarray(logits, np.float64)
    order = np.argsort(-x, kind="stable")
    z = x[order] / max(temperature, 1e-6)
    if top_k > 0:
        z[top_k:] = -np.inf
    p = np.exp(z - z.max())
    p /= p.sum()
    keep_sorted = np.isfinite(z) & ((np.cumsum(p) - p < top_p) | (top_p >= 1))
    keep = np.zeros(x.size, bool)
    keep[order] = keep_sorted
    return keep


@pytest.mark.parametrize("kind,V", [("normal", 3000), ("ties", 3000), ("equal", 3000), ("minus_inf", 3000),
                                    ("normal", 100_000), ("ties", 100_000)])
def test_filters_keep_what_a_sort_keeps(kind, V):
    """The search the filters run instead of a sort keeps the same tokens as the sorted rule,
    also where many logits tie (bf16 logits over a large vocabulary) and top-k or top-p cut
    inside a run of ties (those keep by index)."""
    rng = np.random.default_rng(0)
    B = 12
    x = rng.normal(size=(B, V)).astype(np.float32) * 2
    if kind == "ties":  # a few hundred distinct values
        x = np.round(x * 16) / 16
    elif kind == "equal":
        x = np.zeros((B, V), np.float32)
    elif kind == "minus_inf":
        x[:, rng.random(V) < 0.5] = -np.inf
    temperature = np.array([1.0, 0.7, 1.3, 0.5, 1.0, 2.0, 1.0, 0.8, 1.0, 1.0, 0.9, 1.0], np.float32)
    top_k = np.array([0, 5, 0, 40, 1, 0, 200, 17, 0, V - 1, V, 7], np.int32)
    top_p = np.array([0.9, 1.0, 0.5, 0.95, 1.0, 0.3, 0.8, 0.99, 1.0, 0.6, 0.05, 0.7], np.float32)
    sp = SamplingParams(jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p))
    got = np.isfinite(np.asarray(jax.jit(filtered_logits)(jnp.asarray(x), sp)))
    for b in range(B):
        # Where the mass before a token lands within float32 rounding of top_p (equal logits,
        # top_p a multiple of their probability), that token may go either way.
        lo, hi = (_reference_keep(x[b], temperature[b], top_k[b], min(top_p[b] + d, 1.0) if top_p[b] < 1 else 1.0)
                  for d in (-1e-5, 1e-5))
        msg = f"row {b}: T={temperature[b]} top_k={top_k[b]} top_p={top_p[b]}"
        assert np.all(got[b] <= hi) and np.all(lo <= got[b]), msg
        if kind != "equal":
            np.testing.assert_array_equal(got[b], _reference_keep(x[b], temperature[b], top_k[b], top_p[b]), msg)
    text = jax.jit(sample).trace(jnp.asarray(x), jax.random.key(0), sp).lower().as_text()
    assert "stablehlo.sort" not in text and "@filtered_logits" in text


def test_the_search_finds_the_same_threshold_rolled_and_unrolled():
    """The CPU runs the filters' search passes as a loop, a GPU unrolled: the same thresholds."""
    from rjax.math.sampling import _search

    target = jnp.asarray(np.random.default_rng(1).integers(0, 2 ** 32, size=7, dtype=np.uint64), jnp.uint32)
    target = target.at[0].set(0).at[1].set(2 ** 32 - 1)
    holds = lambda t: t[..., 0] <= target[:, None]  # noqa: E731
    for rolled in (True, False):
        got = jax.jit(lambda: _search(holds, 32, 7, rolled=rolled))()
        np.testing.assert_array_equal(np.asarray(got), np.asarray(target), f"rolled={rolled}")
