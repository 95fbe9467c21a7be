"""The add + RMS norm's entry point: the Mosaic GPU kernel on a GPU for at most MAX_ROWS rows, the
reference elsewhere (see the package's docstring).

XLA also takes rows that are not a multiple of the kernel's 64 values, and the plain norm
without partial sums at 8 rows or more: there XLA fuses it into one kernel that
measured as fast as ours (docs/kernels.md, "Norms and activations")."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.implementation import pick_implementation, rows_of
from pallas_kernels.int8_activations import quantize_x

from .kernel import COLS, add_rms_norm_kernel
from .reference import add_rms_norm_reference

MAX_ROWS = 64
XLA_ROWS_WITHOUT_PARTS = 8


def add_rms_norm(x: jax.Array, parts: jax.Array | None, w: jax.Array, eps: float, out_dtype, *,
                 quantize: bool = False, implementation: str | None = None):
    lead, k = x.shape[:-1], x.shape[-1]
    rows = rows_of(x.shape)
    if implementation is None and (k % COLS or (not quantize and parts is None and rows >= XLA_ROWS_WITHOUT_PARTS)):
        implementation = "reference"
    implementation = pick_implementation("add_rms_norm", implementation, rows, MAX_ROWS)
    if implementation == "reference":
        x_out, y = add_rms_norm_reference(x, parts, w, eps, jnp.float32 if quantize else out_dtype)
        return x_out, (dataclasses.replace(quantize_x(y), dtype=jnp.dtype(out_dtype)) if quantize else y)
    flat_parts = None if parts is None else parts.reshape(parts.shape[0], rows, k)
    x_out, y = add_rms_norm_kernel(x.reshape(rows, k), flat_parts, w, eps, out_dtype, quantize=quantize,
                                   interpret=implementation == "interpret")
    return x_out.reshape(x.shape), y.reshape(*lead) if quantize else y.reshape(x.shape)
