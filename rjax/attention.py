"""The one attention entry point of the model: the Pallas kernels on GPU, the reference elsewhere.

Semantics (shared by every implementation): q [B, T, Hq, D] at absolute positions q_pos [B, T]
(-1 = padding row, output 0) attends over a cache k, v [B, Hkv, S, D] holding kv_len[b] valid
entries; key j is visible to a query at position p iff j <= p, j < kv_len[b] and, with a window,
p - j < window. Query head h reads KV head h // (Hq // Hkv).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_reference(q, k, v, q_pos, kv_len, *, scale, window=None):
    B, T, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qg = q.reshape(B, T, Hkv, G, D).astype(jnp.float32)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, k.astype(jnp.float32)) * scale
    j = jnp.arange(S)[None, None, :]
    p = q_pos[:, :, None]
    visible = (j <= p) & (j < kv_len[:, None, None]) & (p >= 0)
    if window is not None:
        visible &= (p - j) < window
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(visible[:, None, None], jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    w = e / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bkgts,bksd->btkgd", w, v.astype(jnp.float32))
    return out.reshape(B, T, Hq, D).astype(q.dtype)


def attention(q, k, v, q_pos, kv_len, *, scale, window=None):
    return attention_reference(q, k, v, q_pos, kv_len, scale=scale, window=window)
