"""Rotary embedding and the append of new keys/values to the KV cache: a Pallas kernel for the
few tokens per sequence of a decode step or a verification, beside a plain-JAX reference.

    rope_append(parts, bias, pos, k_cache, v_cache, inv_freq, rows, *, n_heads, pairing, dtype,
                implementation=None, k_scale=None, v_scale=None, qk_norm=None, eps=0.0, at=None)
        -> (q [B, T, Hq, D] rotated, k_cache, v_cache, k_scale, v_scale)

parts [S, B, T, (Hq + 2 Hkv) D] is the fused QKV product as S float32 partial sums (a split-K
GEMV's output before its reduction, which this pass does; qtensor.matmul_partials), bias its
bias or None, `dtype` the compute dtype the sum is rounded to, pos [B, T] the absolute positions (-1:
padding, nothing written), caches [n_slots, Hkv, S, D], rows [B] the cache rows of the B
sequences. at: None, or [B, T] where in the rows each token is written instead of its position
(-1: nothing), with rows [B, T] one per token: a paged cache passes its page pool as the rows,
each token's page as its row and its offset in the page as `at`. qk_norm: None, or the weights (q [D], k [D]) of an RMS norm (epsilon `eps`) of every
query and key head before the rotation (Gemma's). An int8 or fp8 cache
(pallas_kernels/kv_quant.py) comes with its scales and is written quantized: int8 scales
[n_slots, Hkv, S], one per entry, are written beside the values and returned; fp8 scales [Hkv]
are read. A float cache's scales are None. `implementation`:
None picks the kernel on a GPU backend for up to MAX_ROWS tokens in all (decode, and the few
positions per sequence a speculative verification writes) and the reference elsewhere;
"reference", "pallas", "interpret" force one. The kernel takes the B x T tokens as B * T rows
of one token each, every token of a sequence writing its own position of the sequence's row.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.implementation import pick_implementation

from .kernel import rope_append_kernel, split_view
from .reference import apply_rope, rope_append_reference, split_qkv, write_entries, write_positions

__all__ = ["rope_append", "rope_append_kernel", "rope_append_reference", "apply_rope", "split_qkv",
           "write_positions", "write_entries", "split_view", "MAX_ROWS"]

MAX_ROWS = 256  # tokens per call (sequences x positions) up to which the kernel is used


def rope_append(parts: jax.Array, bias: jax.Array | None, pos: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                inv_freq: jax.Array, rows: jax.Array, *, n_heads: int, pairing: str, dtype,
                implementation: str | None = None, k_scale=None, v_scale=None, qk_norm=None, eps: float = 0.0,
                at=None):
    S, B, T, N = parts.shape
    implementation = pick_implementation("rope_append", implementation, B * T, MAX_ROWS)
    norm = dict(qk_norm=qk_norm, eps=eps)
    if implementation == "reference":
        return rope_append_reference(parts, bias, pos, k_cache, v_cache, inv_freq, rows, n_heads=n_heads,
                                     pairing=pairing, dtype=dtype, k_scale=k_scale, v_scale=v_scale, at=at, **norm)
    rows = rows.reshape(B * T) if rows.ndim == 2 else jnp.repeat(rows, T)
    q, *caches = rope_append_kernel(parts.reshape(S, B * T, N), bias, pos.reshape(B * T), k_cache, v_cache,
                                    inv_freq, rows, n_heads=n_heads, pairing=pairing,
                                    dtype=jnp.dtype(dtype), interpret=implementation == "interpret",
                                    k_scale=k_scale, v_scale=v_scale, at=None if at is None else at.reshape(B * T),
                                    **norm)
    return q.reshape(B, T, *q.shape[1:]), *caches
