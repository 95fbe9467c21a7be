"""Activations rounded to int8 per 32 values, for the int8 decode GEMV: a Mosaic GPU kernel
beside the plain-JAX reference.

    quantize(x, activation=None, *, implementation=None) -> QuantizedX

x (..., K); with `activation` ("silu", "gelu_tanh") x is (..., 2K) = [gate | up] and what is
rounded is act(gate) * up (the FFN's GLU, fused into the same pass). `implementation`: None
picks the kernel on a GPU backend for at most MAX_ROWS rows of a multiple of 64 values and the
reference elsewhere; "reference", "pallas", "interpret" force one. The RMS-norm kernel
(pallas_kernels.rms_norm) emits the same QuantizedX from its own pass, with
`mgpu.store_quantized`.
"""
from __future__ import annotations

import jax

from pallas_kernels.implementation import pick_implementation, rows_of

from .mgpu import quantize_rows, supports
from .reference import (ACTIVATIONS, GatedX, QuantizedX, dequantize_x, glu, norm_scale, quantize_normed,
                        quantize_reference, quantize_x)

__all__ = ["quantize", "quantize_rows", "quantize_reference", "quantize_x", "quantize_normed", "norm_scale",
           "dequantize_x", "glu",
           "QuantizedX", "GatedX", "ACTIVATIONS", "MAX_ROWS"]

MAX_ROWS = 64


def quantize(x: jax.Array, activation: str | None = None, *, implementation: str | None = None) -> QuantizedX:
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"quantize: activation={activation!r}; expected None or one of {ACTIVATIONS}")
    *lead, width = x.shape
    rows = rows_of(x.shape)
    if implementation is None and not supports(width if activation is None else width // 2):
        implementation = "reference"
    implementation = pick_implementation("quantize", implementation, rows, MAX_ROWS)
    if implementation == "reference":
        return quantize_reference(x, activation)
    xq = quantize_rows(x.reshape(rows, width), activation, interpret=implementation == "interpret")
    return xq.reshape(*lead)
