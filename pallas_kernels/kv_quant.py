"""Quantized K/V entries: the two formats the attention kernels read, and their exact dequantization.

A quantized cache array x (int8 or float8_e4m3fn, any layout whose axis 1 is the KV head and
whose last axis is the head dim) comes with a float32 scale:
- int8: symmetric, one scale per entry (token and head): scale has x's shape without the head
  dim, value = x * scale. Written as scale = max|row| / 127, x = round(row / scale), so each
  value's error is at most scale / 2 = max|row| / 254.
- fp8 (e4m3): one scale per KV head: scale [Hkv], value = x * scale[head]. Written as
  x = e4m3(row / scale), saturated at +-448 (e4m3 has no infinity); 3 mantissa bits give a
  relative error of at most 2^-4 for normal values (|row| / scale >= 2^-6), and an absolute error
  of at most 2^-10 * scale below that.

The kernels never form the dequantized cache: they cast each block to the query's dtype (int8
and e4m3 values are exact in bfloat16) and apply the scales to the scores (K) and to the
probabilities before the product with V.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
KINDS = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(FP8)}


def kind_of(dtype) -> str | None:
    """'int8', 'fp8', or None for a float (unquantized) cache dtype."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.int8:
        return "int8"
    if dtype == FP8:
        return "fp8"
    if jnp.issubdtype(dtype, jnp.floating):
        return None
    raise ValueError(f"attention: cache dtype {dtype} is neither a float nor a quantized KV format (int8, fp8)")


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (int8 [..., D], float32 scale [...]), one symmetric scale per row."""
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1) / INT8_MAX
    safe = jnp.where(scale > 0, scale, 1.0)[..., None]
    q = jnp.clip(jnp.round(xf / safe), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def quantize_fp8(x: jax.Array, scale: jax.Array, head_axis: int) -> jax.Array:
    """x with KV heads on `head_axis` -> e4m3 values of x / scale[head], saturated at +-448."""
    shape = [1] * x.ndim
    shape[head_axis] = -1
    xf = x.astype(jnp.float32) / scale.astype(jnp.float32).reshape(shape)
    return jnp.clip(xf, -FP8_MAX, FP8_MAX).astype(FP8)


def quantize_entries(x: jax.Array, kind: str, head_scale) -> tuple[jax.Array, jax.Array | None]:
    """New entries x [B, T, Hkv, D] as a `kind` cache stores them -> (values, their int8 scales
    [B, T, Hkv], or None for fp8, whose per-head scale `head_scale` [Hkv] is given)."""
    if kind == "int8":
        return quantize_int8(x)
    return quantize_fp8(x, head_scale, head_axis=2), None


def dequantize(x: jax.Array, scale: jax.Array | None) -> jax.Array:
    """The float32 values of a cache array x [N, Hkv, ..., D] (see the module docstring);
    a float x (scale None) is returned as float32."""
    xf = x.astype(jnp.float32)
    if scale is None:
        return xf
    if scale.ndim == x.ndim - 1:  # int8: per entry
        return xf * scale.astype(jnp.float32)[..., None]
    shape = [1] * x.ndim  # fp8: per KV head (axis 1)
    shape[1] = -1
    return xf * scale.astype(jnp.float32).reshape(shape)


def check_scales(x, scale, name: str) -> None:
    """Raise ValueError naming `name` unless scale matches x's format (see the module docstring)."""
    kind = kind_of(x.dtype)
    if kind is None:
        if scale is not None:
            raise ValueError(f"attention: {name} scale given for a {x.dtype} cache, which takes none")
        return
    if scale is None:
        raise ValueError(f"attention: a {kind} {name} cache needs its scale")
    want = x.shape[:-1] if kind == "int8" else (x.shape[1],)
    if tuple(scale.shape) != tuple(want):
        raise ValueError(f"attention: {kind} {name} scale must have shape {want} for a cache of {x.shape}, "
                         f"got {scale.shape}")
