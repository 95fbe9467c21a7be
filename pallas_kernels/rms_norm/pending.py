"""The residual add + RMS norm between two blocks, left to the kernels of the products beside it.

At batch 1 the add + norm kernel between two small products costs as much as either product
(a launch and a dependent round trip for a few kilobytes), so a product on the float decode
kernel can take its x as a `PendingNorm` instead: the residual, the block output's split-K
partial sums and the norm weight. Each program sums the row itself, gets the row's sum of
squares from one extra load of the whole row, multiplies what it loads by the norm weight and
scales its sums by the row's 1/rms at the end; the programs of the first weight-row tile also
write the summed residual, which the next residual add needs. `materialize` is what every
other consumer does instead: the add + norm kernel (or its reference).

At a few rows on tensor-core tiles the product before the norm does the add and the norm
instead (`fused_qmatmul_add_norm`) and hands over `NormedRows`: the rows times the norm weight
with each row's 1/rms left to the product after it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from .add_norm import add_rms_norm


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingNorm:
    """rms_norm(residual + sum(parts)) * weight, in `dtype`, not computed yet."""

    residual: jax.Array        # (..., K) float32, the residual stream before the block's output is added
    parts: jax.Array | None    # (S, ..., K) float32 partial sums of the block's output, or None
    weight: jax.Array          # (K,)
    eps: float = dataclasses.field(metadata=dict(static=True))
    dtype: Any = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.residual.shape

    def reshape(self, *lead: int) -> "PendingNorm":
        k = self.residual.shape[-1]
        parts = None if self.parts is None else self.parts.reshape(self.parts.shape[0], *lead, k)
        return PendingNorm(self.residual.reshape(*lead, k), parts, self.weight, self.eps, self.dtype)

    def materialize(self, implementation: str | None = None) -> tuple[jax.Array, jax.Array]:
        """(residual + sum(parts), the normed rows in `dtype`), by the add + norm kernel."""
        return add_rms_norm(self.residual, self.parts, self.weight, self.eps, self.dtype,
                            implementation=implementation)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NormedRows:
    """rms_norm(h) * weight with each row's 1/rms not applied yet: x = h * weight in the
    activations' dtype, and ss the sums of h * h per 32 values, whose row sum gives the scale.
    The product before the norm writes it (it sees 32 values of a row, never the whole row:
    `fused_qmatmul_add_norm`); the product after it multiplies its sums by each row's scale.
    `materialize` is what every other consumer does instead."""

    x: jax.Array               # (..., K)
    ss: jax.Array              # (..., K / 32) float32
    eps: float = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.x.shape

    @property
    def dtype(self):
        return self.x.dtype

    def reshape(self, *lead: int) -> "NormedRows":
        k = self.x.shape[-1]
        return NormedRows(self.x.reshape(*lead, k), self.ss.reshape(*lead, k // 32), self.eps)

    def materialize(self) -> jax.Array:
        """The normed rows in x's dtype."""
        k = self.x.shape[-1]
        scale = jax.lax.rsqrt(self.ss.sum(axis=-1, keepdims=True) / k + self.eps)
        return (self.x.astype(jax.numpy.float32) * scale).astype(self.x.dtype)
