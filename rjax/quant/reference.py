"""Pure-JAX dequantizers: the ground truth that the Pallas kernels are tested against.

Each follows ggml's arithmetic in float32 so that results are bit-exact with
`gguf.quants.dequantize`.
"""
from __future__ import annotations

import jax.numpy as jnp
from gguf import GGMLQuantizationType as QType


def _nibbles(qs):
    """(.., 16) packed bytes -> (.., 32) values: low nibbles first, then high nibbles."""
    return jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _dq_q8_0(p):
    return p.d.astype(jnp.float32)[..., None] * p.qs.astype(jnp.float32)


def _dq_q4_0(p):
    return p.d.astype(jnp.float32)[..., None] * (_nibbles(p.qs).astype(jnp.float32) - 8.0)


def _dq_q4_1(p):
    return p.d.astype(jnp.float32)[..., None] * _nibbles(p.qs).astype(jnp.float32) + p.m.astype(jnp.float32)[..., None]


DEQUANTIZERS = {QType.Q8_0: _dq_q8_0, QType.Q4_0: _dq_q4_0, QType.Q4_1: _dq_q4_1}


def dequantize(w) -> jnp.ndarray:
    """QTensor -> float32 array of its logical shape."""
    blocks = DEQUANTIZERS[w.qtype](w.planes)  # (rows, nb, block_size)
    return blocks.reshape(w.shape)
