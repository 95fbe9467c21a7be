"""The quantized-weight pytree leaf.

A `QTensor` is a 2-D weight of logical shape (out_features, in_features), stored as GGUF
blocks along `in_features`, repacked into *planes*: one array per block field (scales,
mins, high bits, quants), each row-major with leading dims (out_features, n_blocks). A tile
of output rows is therefore a plain slice of every plane, which is what the kernels read.
`gguf_blocks.formats` defines the planes of each type; `gguf_blocks.reference` dequantizes them.
This package is the layer both the kernels (pallas_kernels) and the engine (rjax) build on; it
imports neither.
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


Weight = QTensor | jax.Array
