"""RMS norm, and the residual add + RMS norm between transformer blocks, in plain JAX."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, w: jax.Array, eps: float, out_dtype=None) -> jax.Array:
    """x / rms(x) * w over the last axis, computed in float32, returned in `out_dtype` (x's)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32)).astype(out_dtype or x.dtype)


def add_rms_norm_reference(x: jax.Array, parts: jax.Array | None, w: jax.Array, eps: float,
                           out_dtype) -> tuple[jax.Array, jax.Array]:
    """(x + sum(parts), rms_norm(that)): x (..., K) float32, parts (S, ..., K) or None."""
    if parts is not None:
        x = x + jnp.sum(parts.astype(jnp.float32), axis=0)
    return x, rms_norm(x, w, eps, out_dtype)
