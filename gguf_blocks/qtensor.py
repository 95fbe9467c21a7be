"""The quantized-weight pytree leaf, and the one `matmul` every weight of a model goes through.

A `QTensor` is a 2-D weight of logical shape (out_features, in_features), stored as GGUF
blocks along `in_features`, repacked into *planes*: one array per block field (scales,
mins, high bits, quants), each row-major with leading dims (out_features, n_blocks). A tile
of output rows is therefore a plain slice of every plane, which is what the kernels read.
`rjax.quant.formats` defines the planes of each type; `rjax.quant.reference` dequantizes them.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType as QType


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor:
    """A block-quantized matrix: `planes` are device arrays, `qtype` and `shape` are static."""

    planes: Any  # a NamedTuple of arrays, one per field of the block struct (see formats.LAYOUTS)
    qtype: QType = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))

    @property
    def nbytes(self) -> int:
        return sum(int(p.size) * p.dtype.itemsize for p in jax.tree.leaves(self.planes))

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        from rjax.quant.reference import dequantize

        return dequantize(self).astype(dtype)

    def take_rows(self, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
        """Dequantized rows `ids` (any shape) -> ids.shape + (in_features,): an embedding lookup."""
        from rjax.quant.reference import dequantize

        flat = ids.reshape(-1)
        rows = jax.tree.map(lambda p: jnp.take(p, flat, axis=0), self.planes)
        sub = QTensor(rows, self.qtype, (int(flat.shape[0]), self.shape[1]))
        return dequantize(sub).astype(dtype).reshape(*ids.shape, self.shape[1])


Weight = QTensor | jax.Array


def _plain(x):
    """Activations a producer rounded to int8 (a QuantizedX) or left as a GLU's [gate | up] (a
    GatedX), as the plain array a dense weight multiplies."""
    from pallas_kernels.int8_activations import GatedX, QuantizedX, dequantize_x

    if isinstance(x, GatedX):
        return x.materialize()
    return dequantize_x(x).astype(x.dtype) if isinstance(x, QuantizedX) else x


def matmul(x: jax.Array, w: Weight) -> jax.Array:
    """x @ w.T for x of shape (..., in_features) and w of logical shape (out, in); x may be a
    QuantizedX (activations already rounded to int8 for the int8 decode kernel).

    Dense weights are plain arrays in (out, in) orientation. Quantized weights go to
    `pallas_kernels.quant_matmul.qmatmul`: the fused kernels on GPU for the types they cover,
    dequantize-then-dot in float32 (the reference) elsewhere.
    """
    if isinstance(w, QTensor):
        # Imported here: the kernels import QTensor from this module.
        from pallas_kernels.quant_matmul import qmatmul

        return qmatmul(x, w)
    x = _plain(x)
    return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def matmul_partials(x: jax.Array, w: Weight) -> jax.Array:
    """x @ w.T as S float32 partial sums (S, ..., out) whose sum over axis 0 is the product:
    a split-K decode kernel's output before its reduction, so that the consumer (the residual
    add) sums it in its own pass instead of a kernel of its own. S is 1 where nothing is split."""
    if isinstance(w, QTensor):
        from pallas_kernels.quant_matmul import qmatmul

        return qmatmul(x, w, partials=True)
    x = _plain(x)
    return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32)[None]


def take_rows(w: Weight, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
    if isinstance(w, QTensor):
        return w.take_rows(ids, dtype)
    return jnp.take(w, ids, axis=0).astype(dtype)
