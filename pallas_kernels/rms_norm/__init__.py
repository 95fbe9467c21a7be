"""RMS norm and the residual add + RMS norm between blocks: a Mosaic GPU kernel beside a plain-JAX reference.

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

from .add_norm import MAX_ROWS, add_rms_norm
from .kernel import add_rms_norm_kernel
from .pending import NormedRows, PendingNorm
from .reference import add_rms_norm_reference, rms_norm

__all__ = ["add_rms_norm", "add_rms_norm_reference", "add_rms_norm_kernel", "rms_norm", "PendingNorm", "NormedRows",
           "MAX_ROWS"]
