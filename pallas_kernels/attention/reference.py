"""Pure-JAX attention over a KV cache: the ground truth the Pallas kernels are tested against.

Semantics shared by every implementation in this package:

- q [B, T, Hq, D] holds T queries per sequence at absolute positions q_pos [B, T] (int32; -1 marks a
  padding query, whose output row is 0).
- The contiguous cache k, v [B, Hkv, S, D] holds kv_len[b] valid entries (positions 0..kv_len-1).
  The paged cache k_pages, v_pages [P, Hkv, page_size, D] holds logical position j of sequence b in
  page block_tables[b, j // page_size] at offset j % page_size.
- Key j is visible to a query at position p iff j <= p, j < kv_len[b] and, with a window, p - j < window.
  A query that sees no key gets output 0 (never NaN).
- Grouped-query attention: Hq = Hkv * G and query head h reads KV head h // G.
- Scores and softmax in float32; the output has q's dtype.
- A quantized cache (int8 or fp8 K/V, see pallas_kernels/kv_quant.py) comes with k_scale and v_scale; its
  values are dequantized exactly (x * scale) before the same math.
- Long prompts are attended in chunks of queries (`query_chunk`), so no [T, T] score matrix is
  formed: at most [chunk, S] per head.

Cache entries that no query can see must still be finite: like any matrix product, the weighted sum
over V multiplies them by an exact zero, and 0 * inf is NaN.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import check_scales, dequantize

_HIGHEST = jax.lax.Precision.HIGHEST


def visible_mask(q_pos, kv_len, num_keys: int, window: int | None):
    """[B, T, num_keys] bool: which cache positions each query may attend to."""
    j = jnp.arange(num_keys, dtype=jnp.int32)[None, None, :]
    p = q_pos[:, :, None]
    visible = (j <= p) & (j < kv_len[:, None, None]) & (p >= 0)
    if window is not None:
        visible &= (p - j) < window
    return visible


def check_shapes(q, k, v, q_pos, kv_len, *, k_name="k", v_name="v", k_scale=None, v_scale=None):
    """Raise ValueError naming the argument whose shape breaks the contract; return (B, T, Hq, Hkv, D)."""
    if q.ndim != 4:
        raise ValueError(f"attention: q must be [B, T, Hq, D], got shape {q.shape}")
    B, T, Hq, D = q.shape
    if k.ndim != 4 or k.shape[-1] != D:
        raise ValueError(f"attention: {k_name} must be [.., Hkv, .., {D}] like q {q.shape}, got {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"attention: {v_name} shape {v.shape} differs from {k_name} shape {k.shape}")
    if v.dtype != k.dtype:
        raise ValueError(f"attention: {v_name} dtype {v.dtype} differs from {k_name} dtype {k.dtype}")
    check_scales(k, k_scale, k_name)
    check_scales(v, v_scale, v_name)
    Hkv = k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"attention: query heads {Hq} are not a multiple of KV heads {Hkv}")
    if q_pos.shape != (B, T):
        raise ValueError(f"attention: q_pos must be [B, T] = {(B, T)}, got {q_pos.shape}")
    if kv_len.shape != (B,):
        raise ValueError(f"attention: kv_len must be [B] = {(B,)}, got {kv_len.shape}")
    return B, T, Hq, Hkv, D


# Score elements per query chunk and head up to which the reference attends all queries at once.
_CHUNK_SCORES = 1 << 22


def query_chunk(T: int, S: int) -> int:
    """Queries per chunk: all T when T * S is small, else a power of two with chunk * S <= 2^22."""
    if T * S <= _CHUNK_SCORES:
        return T
    return max(1, 1 << max(0, (_CHUNK_SCORES // S).bit_length() - 1))


def _attend(q, k, v, q_pos, kv_len, scale, window):
    """q [B, t, Hq, D] float32 over float32 k, v [B, Hkv, S, D]."""
    B, T, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, T, Hkv, Hq // Hkv, D)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, k, precision=_HIGHEST) * scale
    visible = visible_mask(q_pos, kv_len, S, window)[:, None, None]
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    w = e / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bkgts,bksd->btkgd", w, v, precision=_HIGHEST)
    return out.reshape(B, T, Hq, D)


@functools.partial(jax.jit, static_argnames=("scale", "window"))
def attention_reference(q, k, v, q_pos, kv_len, *, scale: float, window: int | None = None, k_scale=None,
                        v_scale=None):
    """Attention of q [B, T, Hq, D] over the contiguous cache k, v [B, Hkv, S, D] (float, or
    int8 / fp8 with k_scale, v_scale: see pallas_kernels/kv_quant.py); returns [B, T, Hq, D]."""
    B, T, Hq, Hkv, D = check_shapes(q, k, v, q_pos, kv_len, k_scale=k_scale, v_scale=v_scale)
    S = k.shape[2]
    kf, vf = dequantize(k, k_scale), dequantize(v, v_scale)
    qf, q_pos, kv_len = q.astype(jnp.float32), q_pos.astype(jnp.int32), kv_len.astype(jnp.int32)
    chunk = query_chunk(T, S)
    if chunk >= T:
        return _attend(qf, kf, vf, q_pos, kv_len, scale, window).astype(q.dtype)
    n = -(-T // chunk)
    qf = jnp.pad(qf, ((0, 0), (0, n * chunk - T), (0, 0), (0, 0)))
    pos = jnp.pad(q_pos, ((0, 0), (0, n * chunk - T)), constant_values=-1)
    qc = qf.reshape(B, n, chunk, Hq, D).transpose(1, 0, 2, 3, 4)
    pc = pos.reshape(B, n, chunk).transpose(1, 0, 2)
    out = jax.lax.map(lambda a: _attend(a[0], kf, vf, a[1], kv_len, scale, window), (qc, pc))
    out = out.transpose(1, 0, 2, 3, 4).reshape(B, n * chunk, Hq, D)[:, :T]
    return out.astype(q.dtype)


def gather_pages(pages, block_tables):
    """Page pool [P, Hkv, page_size, D] + block tables [B, max_pages] -> contiguous [B, Hkv, max_pages*page_size, D].

    Table entries outside the pool (unused slots) are clamped: the positions they hold lie beyond kv_len.
    """
    P, Hkv, page_size, D = pages.shape
    B, max_pages = block_tables.shape
    g = pages[jnp.clip(block_tables, 0, P - 1)]  # [B, max_pages, Hkv, page_size, D]
    return g.transpose(0, 2, 1, 3, 4).reshape(B, Hkv, max_pages * page_size, D)


def gather_scales(scale, block_tables):
    """A paged cache's scale: per entry [P, Hkv, page_size] -> [B, Hkv, max_pages*page_size] as
    gather_pages does; per head [Hkv] is returned as it is."""
    if scale is None or scale.ndim == 1:
        return scale
    return gather_pages(scale[..., None], block_tables)[..., 0]


@functools.partial(jax.jit, static_argnames=("scale", "window"))
def paged_attention_reference(q, k_pages, v_pages, block_tables, q_pos, kv_len, *, scale: float,
                              window: int | None = None, k_scale=None, v_scale=None):
    """Attention of q [B, T, Hq, D] over the paged cache (float, or int8 / fp8 with k_scale,
    v_scale per entry [P, Hkv, page_size] or per head [Hkv]); returns [B, T, Hq, D]."""
    check_shapes(q, k_pages, v_pages, q_pos, kv_len, k_name="k_pages", v_name="v_pages", k_scale=k_scale,
                 v_scale=v_scale)
    if block_tables.ndim != 2 or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"attention: block_tables must be [B={q.shape[0]}, max_pages], got {block_tables.shape}")
    k = gather_pages(k_pages, block_tables)
    v = gather_pages(v_pages, block_tables)
    return attention_reference(q, k, v, q_pos, kv_len, scale=scale, window=window,
                               k_scale=gather_scales(k_scale, block_tables),
                               v_scale=gather_scales(v_scale, block_tables))
