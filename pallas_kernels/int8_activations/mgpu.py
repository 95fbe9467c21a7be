"""Rounding activations to int8 per 32 values as Mosaic GPU kernels: the pieces the producer
kernels share (`lanes`, `store_quantized`), and `quantize_rows`, the kernel for rows that
come from no other kernel of ours (optionally through the FFN's GLU).

A row of K values is G = K / 32 groups, each viewed as (2 halves, 4 words, 4 byte lanes), as
the Triton helpers in kernel.py view it: `lanes` loads byte lane i of every word of a chunk of
GP groups as a (GP, 2, 4) array, so packing four int8 into a word is shifts and ors within a
thread. In the layouts below each thread holds one word of a group (one value per lane array),
the eight words of a group on eight lanes of one warp: the group's maximum and the sums of q
are shuffles within the warp. A program takes 16 groups (a group a thread per four lanes, each
warp four groups), or 2 where G is not a multiple of 16 (576 values, smollm2's, are 18 groups):
then the 16 words fill half a warp, replicated over the other half and the four warps.

Rounding is IEEE: the division is arith's (div.rn.f32 without approximate math) and the rounding
round-half-even, as `quantize_x` rounds in XLA, so results are bit-exact against it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .reference import QuantizedX, activate

_I32, _F32 = jnp.int32, jnp.float32

_LAYOUTS = {
    16: plgpu.Layout.TILED(plgpu.Tiling(((16, 2, 4), (4, 2, 4), (1,))), warp_dims=(-7,), lane_dims=(-4, -3, -2),
                           vector_dim=-1),
    2: plgpu.Layout.TILED(plgpu.Tiling(((2, 2, 4), (1,))), warp_dims=(plgpu.Replicated(4),),
                          lane_dims=(-4, -3, -2, plgpu.Replicated(2)), vector_dim=-1),
}


def supports(k: int) -> bool:
    """Rows the kernels take: whole pairs of groups."""
    return k % 64 == 0


def chunk_groups(g: int) -> int:
    """Groups per program for a row of G groups."""
    return 16 if g % 16 == 0 else 2


def lanes(ref, idx: tuple, gp: int, g0):
    """The four byte lanes (GP, 2, 4) of groups g0 .. g0 + GP of the row ref[idx] of a (..., G,
    2, 4, 4) view, in float32. The lanes are strided views: plain loads (`optimized=False`)."""
    return [plgpu.load(ref.at[(*idx, pl.ds(g0, gp), slice(None), slice(None), i)], layout=_LAYOUTS[gp],
                       optimized=False).astype(_F32) for i in range(4)]


def store_quantized(values, refs, row, gp: int, g0):
    """Round four lanes (GP, 2, 4) of a row, groups g0 .. g0 + GP, to int8 per group and store
    them into the QuantizedX planes `refs` = (words (M, G, 2, 4), d (M, G), dsum32 (M, G),
    dsum16 (M, G, 2))."""
    words_ref, d_ref, dsum32_ref, dsum16_ref = refs
    a = [jnp.abs(v) for v in values]
    amax = jnp.max(jnp.max(jnp.maximum(jnp.maximum(a[0], a[1]), jnp.maximum(a[2], a[3])), axis=2), axis=1)
    inv = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
    d = amax / 127.0
    inv = jax.lax.broadcast_in_dim(inv, (gp, 2, 4), (0,))
    q = [jnp.round(v * inv).astype(_I32) for v in values]
    groups = pl.ds(g0, gp)
    words_ref[row, groups] = (q[0] & 0xFF) | ((q[1] & 0xFF) << 8) | ((q[2] & 0xFF) << 16) | (q[3] << 24)
    sum16 = jnp.sum(q[0] + q[1] + q[2] + q[3], axis=2)                    # (GP, 2)
    d_ref[row, groups] = d
    dsum32_ref[row, groups] = d * jnp.sum(sum16, axis=1).astype(_F32)
    dsum16_ref[row, groups] = jax.lax.broadcast_in_dim(d, (gp, 2), (0,)) * sum16.astype(_F32)


def quantized_out_shapes(m: int, k: int):
    """Out types of the QuantizedX planes, in the views `store_quantized` writes."""
    g = k // 32
    return (jax.ShapeDtypeStruct((m, g, 2, 4), _I32), jax.ShapeDtypeStruct((m, g), _F32),
            jax.ShapeDtypeStruct((m, g), _F32), jax.ShapeDtypeStruct((m, g, 2), _F32))


def as_quantized(planes, m: int, k: int, dtype) -> QuantizedX:
    words, d, dsum32, dsum16 = planes
    return QuantizedX(words.reshape(m, k // 4), d, dsum32, dsum16.reshape(m, k // 16), jnp.dtype(dtype))


def _kernel(x_ref, *out_refs, gp: int, activation: str | None):
    row, g0 = jax.lax.axis_index("row"), jax.lax.axis_index("chunk") * gp
    if activation is None:
        values = lanes(x_ref, (row,), gp, g0)
    else:
        gate, up = lanes(x_ref, (row, 0), gp, g0), lanes(x_ref, (row, 1), gp, g0)
        values = [activate(a, activation) * b for a, b in zip(gate, up)]
    store_quantized(values, out_refs, row, gp, g0)


@functools.partial(jax.jit, static_argnames=("activation", "interpret"))
def quantize_rows(x: jax.Array, activation: str | None = None, interpret: bool = False) -> QuantizedX:
    """x (M, K) -> QuantizedX, one program per chunk of a row; with `activation`, x is (M, 2K) =
    [gate | up] and the rows rounded are act(gate) * up (computed in float32)."""
    m, width = x.shape
    k = width if activation is None else width // 2
    if not supports(k) or (activation is not None and width % 2):
        raise ValueError(f"quantize_rows: x of shape {x.shape}: K={k} must be a multiple of 64"
                         + ("" if activation is None else " (x holds [gate | up])"))
    g = k // 32
    gp = chunk_groups(g)
    view = x.reshape(m, g, 2, 4, 4) if activation is None else x.reshape(m, 2, g, 2, 4, 4)
    planes = plgpu.kernel(
        functools.partial(_kernel, gp=gp, activation=activation),
        out_type=quantized_out_shapes(m, k), grid=(m, g // gp), grid_names=("row", "chunk"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(view)
    return as_quantized(planes, m, k, x.dtype if jnp.dtype(x.dtype).itemsize == 2 else jnp.bfloat16)
