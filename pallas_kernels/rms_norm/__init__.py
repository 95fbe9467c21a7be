"""RMS norm and the residual add + RMS norm between blocks: a Pallas kernel beside a plain-JAX reference.

    add_rms_norm(x, parts, w, eps, out_dtype, *, quantize=False, implementation=None)
        -> (x + sum(parts), normed)
    PendingNorm(residual, parts, w, eps, dtype)   the same add + norm left to the next
        product's kernel (pending.py); .materialize() -> add_rms_norm's result
    NormedRows(x, ss, eps)   normed rows from the product before, their scale left to the
        next product's kernel (pending.py); .materialize() -> the normed rows

x (..., K) is the float32 residual stream, parts (S, ..., K) the block output as S partial
sums (or None), w (K,) the norm weight. With `quantize` the normed activations come as a
QuantizedX (int8 per 32 values) for the int8 decode GEMV. `implementation`: None picks the kernel on a GPU
backend for at most MAX_ROWS rows (decode; XLA's fusions are as good where the rows are
many) and the reference elsewhere; "reference", "pallas", "interpret" force one.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.implementation import pick_implementation, rows_of
from pallas_kernels.int8_activations import quantize_x

from .kernel import add_rms_norm_kernel
from .pending import NormedRows, PendingNorm
from .reference import add_rms_norm_reference, rms_norm

__all__ = ["add_rms_norm", "add_rms_norm_reference", "add_rms_norm_kernel", "rms_norm", "PendingNorm", "NormedRows",
           "MAX_ROWS"]

MAX_ROWS = 64


def add_rms_norm(x: jax.Array, parts: jax.Array | None, w: jax.Array, eps: float, out_dtype, *,
                 quantize: bool = False, implementation: str | None = None):
    lead, k = x.shape[:-1], x.shape[-1]
    rows = rows_of(x.shape)
    implementation = pick_implementation("add_rms_norm", implementation, rows, MAX_ROWS)
    if implementation == "reference":
        x_out, y = add_rms_norm_reference(x, parts, w, eps, jnp.float32 if quantize else out_dtype)
        return x_out, (dataclasses.replace(quantize_x(y), dtype=jnp.dtype(out_dtype)) if quantize else y)
    flat_parts = None if parts is None else parts.reshape(parts.shape[0], rows, k)
    x_out, y = add_rms_norm_kernel(x.reshape(rows, k), flat_parts, w, eps, out_dtype, quantize=quantize,
                                   interpret=implementation == "interpret")
    return x_out.reshape(x.shape), y.reshape(*lead) if quantize else y.reshape(x.shape)
