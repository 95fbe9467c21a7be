"""The online-softmax ("flash") pieces shared by the prefill and decode kernels.

A kernel program owns a tile of query rows (their absolute positions `pos`, -1 for padding) and walks
the cache in blocks of `block_k` positions. `block_ranges` says which blocks can hold a visible key
(everything else is skipped) and which of those need no mask at all (every key visible to every
real query row); `attend_block` folds one block into the running (acc, m, l) state; `finish`
normalizes and zeroes rows that see no key.

Scores live in the log2 domain (scaled by scale * log2(e)) so each exponential is one exp2. Masked
scores get a large finite negative value rather than -inf: a row whose every key so far is masked
then carries garbage that the first visible key wipes out (its weight exp2(MASK - m) is 0), and rows
that never see a key are zeroed by `finish`, so no inf - inf ever makes a NaN.
"""
from __future__ import annotations

import functools
import math
import typing

import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)
MASK_SCORE = -1e30
_NO_POSITION = 2**30  # larger than any position; stands in for padding rows in a min


class BlockRanges(typing.NamedTuple):
    """Block indices [lo, hi) may hold visible keys; [full_lo, full_hi) inside it need no mask."""

    lo: jnp.ndarray
    full_lo: jnp.ndarray
    full_hi: jnp.ndarray
    hi: jnp.ndarray


def idiv(x, n: int):
    return lax.div(x, jnp.int32(n))  # operands are non-negative: truncation is floor


def block_ranges(pos, kv_len, block_k: int, window: int | None) -> BlockRanges:
    """Key blocks the query rows `pos` [R] (int32, -1 = padding) can see in a cache of kv_len entries."""
    real = pos >= 0
    p_max = jnp.max(pos)  # -1 when every row is padding
    p_min = jnp.min(jnp.where(real, pos, _NO_POSITION))
    end = jnp.maximum(jnp.minimum(kv_len, p_max + 1), 0)  # one past the last visible key
    hi = idiv(end + (block_k - 1), block_k)
    if window is None:
        lo = jnp.int32(0)
        full_lo = lo
    else:
        lo = jnp.minimum(idiv(jnp.maximum(p_min - window + 1, 0), block_k), hi)
        # A block is inside every row's window once its first key is >= p_max - window + 1.
        full_lo = idiv(jnp.maximum(p_max - window + 1, 0) + (block_k - 1), block_k)
    # A block is visible to every real row (causal, kv_len) when it ends at or before min(p_min + 1, kv_len).
    full_hi = idiv(jnp.maximum(jnp.minimum(p_min, kv_len - 1) + 1, 0), block_k)
    full_lo = jnp.clip(full_lo, lo, hi)
    full_hi = jnp.clip(full_hi, full_lo, hi)
    return BlockRanges(lo, full_lo, full_hi, hi)


def init_state(rows: int, head_dim: int):
    return (jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def _precision(x):
    return lax.Precision.HIGHEST if x.dtype == jnp.float32 else None


def scores(q, k):
    """[R, bk] float32 scores of queries q [R, D] against keys k [bk, D]; or of q and k given as
    matching tuples of column pieces (the two rotation halves), summed over the pieces."""
    if not isinstance(q, tuple):
        q, k = (q,), (k,)
    dims = (((1,), (1,)), ((), ()))
    out = [lax.dot_general(a, b, dims, precision=_precision(a), preferred_element_type=jnp.float32)
           for a, b in zip(q, k)]
    return functools.reduce(jnp.add, out)


def attend_block(state, q, k, v, *, qk_scale: float, mask=None, k_scale=None, v_scale=None):
    """Fold keys k [bk, D] / values v [bk, D] into state for queries q [R, D]; mask [R, bk] bool or None.
    q and k may be tuples of column pieces (see `scores`). A quantized block comes cast to the
    compute dtype with its float32 scales (pallas_kernels/kv_quant.py): k_scale, v_scale [bk] per key, or
    scalars per head; they scale the raw scores and the probabilities that weight V.

    The running max m is kept in scaled units, so the scale meets each raw score once, inside the
    exponent's argument (one fused multiply-add per score instead of a multiply and a subtract).
    float32 inputs multiply in full float32 (the Triton lowering would otherwise use tf32).
    """
    acc, m, l = state
    s = scores(q, k)
    if k_scale is not None:
        s = s * (k_scale[None, :] if k_scale.ndim else k_scale)
    if mask is None:
        m_new = jnp.maximum(m, jnp.max(s, axis=1) * qk_scale)
        p = jnp.exp2(s * qk_scale - m_new[:, None])
    else:
        # Scale before masking: a fused multiply-add of MASK_SCORE * qk_scale - m would keep the
        # product's rounding error (~1e21 at 1e29) and overflow exp2 on fully masked rows.
        s = jnp.where(mask, s * qk_scale, MASK_SCORE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp2(s - m_new[:, None])
    alpha = jnp.exp2(m - m_new)
    l = l * alpha + jnp.sum(p, axis=1)
    if v_scale is not None:
        p = p * (v_scale[None, :] if v_scale.ndim else v_scale)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=_precision(v),
                         preferred_element_type=jnp.float32)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l


def attend_key(state, q, k, v, *, qk_scale: float, rows):
    """Fold one key k [D] / value v [D] (or k as pieces matching q's) into the state of the query
    rows where `rows` [R] is true, with the rounding `attend_block` gives them (the products of
    q and k summed in float32, the weight rounded to v's dtype); other rows keep their state."""
    acc, m, l = state
    if not isinstance(q, tuple):
        q, k = (q,), (k,)
    s = functools.reduce(jnp.add, [jnp.sum(a.astype(jnp.float32) * b.astype(jnp.float32)[None, :], axis=1)
                                   for a, b in zip(q, k)])
    m_new = jnp.maximum(m, s * qk_scale)
    p = jnp.exp2(s * qk_scale - m_new)
    alpha = jnp.exp2(m - m_new)
    p_v = p.astype(v.dtype).astype(jnp.float32)
    acc_new = acc * alpha[:, None] + p_v[:, None] * v.astype(jnp.float32)[None, :]
    return (jnp.where(rows[:, None], acc_new, acc), jnp.where(rows, m_new, m),
            jnp.where(rows, l * alpha + p, l))


def visibility(pos, start, block_k: int, kv_len, window: int | None):
    """[R, bk] bool: which of the keys start .. start + block_k - 1 each query row may see."""
    j = start + jnp.arange(block_k, dtype=jnp.int32)
    p = pos[:, None]
    vis = (j[None, :] <= p) & (j[None, :] < kv_len)
    if window is not None:
        vis &= (p - j[None, :]) < window
    return vis


def row_sees_a_key(pos, kv_len, window: int | None):
    """[R] bool: the row is a real query with at least one visible key (the nearest, min(pos, kv_len-1))."""
    ok = (pos >= 0) & (kv_len > 0)
    if window is not None:
        ok &= (pos - jnp.minimum(pos, kv_len - 1)) < window
    return ok


def finish(state, pos, kv_len, window: int | None):
    """Normalized [R, D] float32 output; rows that see no key are 0."""
    acc, _, l = state
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    return jnp.where(row_sees_a_key(pos, kv_len, window)[:, None], out, 0.0)


def walk_blocks(ranges: BlockRanges, state, step, *, within=None):
    """Run step(block, state, masked) over the visible blocks: masked edges, unmasked middle.

    within: optional (lo, hi) restricting the walk (a split of the decode kernel).
    """
    lo, full_lo, full_hi, hi = ranges
    if within is not None:
        a, b = within
        lo, hi = jnp.maximum(lo, a), jnp.minimum(hi, b)
        full_lo = jnp.clip(full_lo, lo, jnp.maximum(lo, hi))
        full_hi = jnp.clip(full_hi, full_lo, jnp.maximum(full_lo, hi))
    masked = lambda i, s: step(i, s, True)
    unmasked = lambda i, s: step(i, s, False)
    state = lax.fori_loop(lo, full_lo, masked, state)
    state = lax.fori_loop(full_lo, full_hi, unmasked, state)
    return lax.fori_loop(full_hi, hi, masked, state)
