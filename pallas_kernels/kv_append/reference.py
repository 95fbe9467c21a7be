"""Rotary position embedding and the append of new keys/values to a cache, in plain JAX."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import kind_of, quantize_entries
from pallas_kernels.rms_norm.reference import rms_norm


def apply_rope(x: jax.Array, pos: jax.Array, inv_freq: jax.Array, pairing: str) -> jax.Array:
    """x: [B, T, H, D]; pos: [B, T] absolute positions; inv_freq: [D/2].

    pairing "pairs" rotates (x[2i], x[2i+1]) (GGUF's layout), "halves" (x[i], x[i + D/2]).
    Computed in float32, returned in x's dtype."""
    angles = pos.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    if pairing == "pairs":
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(xf.shape)
    else:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def write_positions(cache: jax.Array, new: jax.Array, pos: jax.Array, rows: jax.Array) -> jax.Array:
    """cache [n_slots, Hkv, S, D] with new [B, T, Hkv, D] written at positions pos [B, T] of cache
    rows `rows` [B] (or one per token, [B, T]). Position -1 (padding) and positions past S are
    dropped, so no write lands in another row or past the end."""
    B, T = pos.shape
    rows = jnp.broadcast_to(rows if rows.ndim == 2 else rows[:, None], (B, T))
    where = jnp.where(pos >= 0, pos, cache.shape[2])
    return cache.at[rows, :, where].set(new.astype(cache.dtype), mode="drop")


def write_entries(cache: jax.Array, scale, new: jax.Array, pos: jax.Array, rows: jax.Array):
    """`write_positions` into a cache of any KV format (pallas_kernels/kv_quant.py): new quantized
    as the cache stores it. scale: an int8 cache's per-entry scales [n_slots, Hkv, S] (written
    beside the values), an fp8 cache's per-head scales (read), None for a float cache.
    -> (cache, scale)."""
    kind = kind_of(cache.dtype)
    if kind is None:
        return write_positions(cache, new, pos, rows), scale
    values, entry_scales = quantize_entries(new, kind, scale)
    if entry_scales is not None:
        scale = write_positions(scale, entry_scales, pos, rows)
    return write_positions(cache, values, pos, rows), scale


def split_qkv(qkv: jax.Array, n_heads: int, n_kv_heads: int):
    """qkv [B, T, (Hq + 2 Hkv) D] -> q [B, T, Hq, D], k, v [B, T, Hkv, D]."""
    B, T, n = qkv.shape
    heads = qkv.reshape(B, T, n_heads + 2 * n_kv_heads, n // (n_heads + 2 * n_kv_heads))
    return heads[:, :, :n_heads], heads[:, :, n_heads:n_heads + n_kv_heads], heads[:, :, n_heads + n_kv_heads:]


def rope_append_reference(parts, bias, pos, k_cache, v_cache, inv_freq, rows, *, n_heads: int, pairing: str,
                          dtype, k_scale=None, v_scale=None, qk_norm=None, eps: float = 0.0, at=None):
    """The QKV product given as S partial sums parts [S, B, T, (Hq + 2 Hkv) D] (plus bias, or None),
    summed and rounded to `dtype`; its queries and keys rotated for positions pos [B, T], keys and
    values written into the caches [n_slots, Hkv, S, D] at those positions of rows `rows` [B]
    (`write_entries`: quantized for an int8 or fp8 cache, whose scales k_scale, v_scale come with it).
    at: None, or where in the rows they are written instead [B, T] (-1: not written), with
    rows [B, T] (a paged cache: each token's page in the pool and its offset in the page).
    qk_norm: None, or the weights (q [D], k [D]) of an RMS norm (epsilon `eps`) of every query and
    key head before the rotation (Gemma).
    -> (q [B, T, Hq, D] rotated, in `dtype`; k_cache; v_cache; k_scale; v_scale)."""
    qkv = jnp.sum(parts.astype(jnp.float32), axis=0)
    if bias is not None:
        qkv = qkv + bias.astype(jnp.float32)
    q, k, v = split_qkv(qkv.astype(dtype), n_heads, k_cache.shape[1])
    if qk_norm is not None:
        q, k = rms_norm(q, qk_norm[0], eps), rms_norm(k, qk_norm[1], eps)
    q = apply_rope(q, pos, inv_freq, pairing)
    k = apply_rope(k, pos, inv_freq, pairing)
    where = pos if at is None else at
    k_cache, k_scale = write_entries(k_cache, k_scale, k, where, rows)
    v_cache, v_scale = write_entries(v_cache, v_scale, v, where, rows)
    return q, k_cache, v_cache, k_scale, v_scale
