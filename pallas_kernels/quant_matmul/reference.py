"""The pure-JAX reference for the fused kernels: dequantize the whole weight, then dot.

Dequantization is `gguf_blocks.reference.dequantize` (bit-exact with `gguf.quants`); the
product accumulates in float32, so this is the ground truth the Pallas kernels are tested
against, and the path `qmatmul` takes on backends without the kernels.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from gguf_blocks.qtensor import QTensor
from gguf_blocks.reference import dequantize


def qmatmul_reference(x: jax.Array, w: QTensor) -> jax.Array:
    """x (M, K) @ dequantize(w).T with w of logical shape (N, K) -> (M, N) in x.dtype."""
    wd = dequantize(w)
    out = jax.lax.dot_general(x.astype(jnp.float32), wd, (((x.ndim - 1,), (1,)), ((), ())),
                              precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def dequantize_then_dot(x: jax.Array, w: QTensor) -> jax.Array:
    """Dequantize to x.dtype (one XLA fusion), then XLA's dot in that dtype with f32 accumulation.

    The prefill fallback where it measures faster than the fused GEMM: the dequantized
    weight costs 2 bytes per value of extra traffic, small next to an M-in-the-thousands dot.
    """
    wd = dequantize(w).astype(x.dtype)
    out = jax.lax.dot_general(x, wd, (((x.ndim - 1,), (1,)), ((), ())),
                              preferred_element_type=jnp.float32)
    return out.astype(x.dtype)
