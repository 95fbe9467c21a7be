"""The fused decode kernel's prologue in Triton: the QKV product's rows summed from their split-K
partial sums, normed per head where the model does (Gemma), rotated, and a key or value row
quantized as an int8 or fp8 cache stores it (pallas_kernels/kv_quant.py). kv_append's Mosaic
GPU kernel does the same for the tokens the fused kernel does not take; these are its Triton
counterparts, kept until decode attention leaves Triton.

The head dim is split into its two rotation halves through a reshaped view of every array
(kv_append.split_view), so each half is one strided load and no register shuffle is needed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_quant import FP8, FP8_MAX, INT8_MAX

_F32 = jnp.float32


def _half(ref, idx: tuple, j: int, pairing: str):
    """The view of rotation half j (0 or 1) of the rows ref[idx] (ref in the split view)."""
    j = jnp.int32(j)  # the interpreter cannot discharge plain int indices
    return ref.at[(*idx, j, slice(None)) if pairing == "halves" else (*idx, slice(None), j)]


class ProductRows:
    """Rows (heads) of sequence b's QKV product inside a kernel program, from its split-K partial
    sums in the split view (`split_view`): summed with the bias, rounded to `dtype` (as the
    product would have been), in float32; RMS-normed per head where a norm weight is given
    (Gemma's q and k norms, `norm_refs`: the q and k weights [D] in the split view, or None),
    rounded again; and rotated for position `pos`."""

    def __init__(self, parts_ref, bias_ref, inv_ref, b, pos, *, n_parts: int, pairing: str, dtype,
                 norm_refs=None, eps: float = 0.0):
        self.parts_ref, self.bias_ref, self.b = parts_ref, bias_ref, b
        self.n_parts, self.pairing, self.dtype = n_parts, pairing, dtype
        self.q_norm, self.k_norm = norm_refs if norm_refs is not None else (None, None)
        self.eps = eps
        angles = pos.astype(_F32) * inv_ref[...].astype(_F32)
        self.cos, self.sin = jnp.cos(angles), jnp.sin(angles)

    def _normed(self, x1, x2, w_ref):
        """Halves x1, x2 [..., D/2] of rows, each row divided by its RMS over D and weighted by
        w_ref, in float32, rounded to the dtype (as the reference's rms_norm returns it)."""
        if w_ref is None:
            return x1, x2
        ms = (jnp.sum(x1 * x1, axis=-1, keepdims=True) + jnp.sum(x2 * x2, axis=-1, keepdims=True)) / (2 * x1.shape[-1])
        r = jax.lax.rsqrt(ms + self.eps)
        w = [plgpu.load(_half(w_ref, (), j, self.pairing)).astype(_F32) for j in range(2)]
        return tuple((x * r * wj).astype(self.dtype).astype(_F32) for x, wj in zip((x1, x2), w))

    def half(self, head, j):
        """Half j of row `head`: its partial sums and bias, rounded to the dtype."""
        x = plgpu.load(_half(self.parts_ref, (jnp.int32(0), self.b, head), j, self.pairing)).astype(_F32)
        for s in range(1, self.n_parts):
            x = x + plgpu.load(_half(self.parts_ref, (jnp.int32(s), self.b, head), j, self.pairing)).astype(_F32)
        if self.bias_ref is not None:
            x = x + plgpu.load(_half(self.bias_ref, (head,), j, self.pairing)).astype(_F32)
        return x.astype(self.dtype).astype(_F32)

    def rotated(self, head, key: bool):
        """(first, second) rotation half of row `head` (a key's, else a query's), normed as
        its kind is, rotated."""
        x1, x2 = self._normed(self.half(head, 0), self.half(head, 1), self.k_norm if key else self.q_norm)
        return x1 * self.cos - x2 * self.sin, x2 * self.cos + x1 * self.sin

    def rotated_rows(self, first_head, n: int, valid):
        """(first, second) rotation half, normed and rotated, of the n query rows (heads) from
        `first_head`, each [n, D/2]; rows where `valid` [n] is false read nothing and hold zeros."""
        heads, mask = pl.ds(first_head, n), valid[:, None]

        def half(j):
            at = lambda ref, *idx: _half(ref, idx, j, self.pairing)  # noqa: E731
            x = sum(plgpu.load(at(self.parts_ref, jnp.int32(s), self.b, heads), mask=mask, other=0).astype(_F32)
                    for s in range(self.n_parts))
            if self.bias_ref is not None:
                x = x + plgpu.load(at(self.bias_ref, heads), mask=mask, other=0).astype(_F32)
            return x.astype(self.dtype).astype(_F32)

        x1, x2 = self._normed(half(0), half(1), self.q_norm)
        cos, sin = self.cos[None, :], self.sin[None, :]
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    def row(self, halves):
        """The two halves as one [D] row in the natural order of the head dim."""
        pairs = jnp.stack(halves, axis=-1)  # [D/2, 2]: the one join Triton lowers
        return (pairs.T if self.pairing == "halves" else pairs).reshape(2 * halves[0].shape[-1])


def _rne(x):
    """x rounded to the nearest integer, ties to even, as jnp.round does (|x| < 2^31). Pallas'
    Triton backend lowers no round; floor, an int cast and a compare it does."""
    f = jnp.floor(x)
    d = x - f
    odd = (f.astype(jnp.int32) & 1) == 1
    return f + jnp.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)


def quantize_row(halves, kind: str, head_scale, dtype):
    """One row's two rotation halves (float32) as a `kind` cache stores them, quantized from the
    value a float cache would hold (rounded to `dtype`; pallas_kernels/kv_quant.py): (the halves
    in the cache's value domain, to be cast to its dtype; an int8 row's scale max|row| / 127, else
    None; the values the cache then holds, dequantized, in float32)."""
    halves = [x.astype(dtype).astype(_F32) for x in halves]
    if kind == "int8":
        amax = jnp.maximum(jnp.max(jnp.abs(halves[0])), jnp.max(jnp.abs(halves[1])))
        scale = amax / INT8_MAX
        safe = jnp.where(scale > 0, scale, 1.0)
        codes = [jnp.clip(_rne(x / safe), -INT8_MAX, INT8_MAX) for x in halves]
        return codes, scale, [c * scale for c in codes]
    values = [jnp.clip(x / head_scale, -FP8_MAX, FP8_MAX) for x in halves]
    return values, None, [x.astype(FP8).astype(_F32) * head_scale for x in values]
