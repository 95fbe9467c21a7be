"""Rounding activations to int8 in Pallas-Triton: the pieces the Triton-lowered producers (the
int8 GEMV's fused add + norm, the decode attention's int8 output) share.

A row of K values is handled as G = K / 32 groups, each viewed as (2 halves, 4 words, 4
lanes), one lane of every word loaded as a (GP, 2, 4) array, so that packing four int8 into a
word is four shifts and ors, with no data moved between threads. `store_quantized` rounds such
a row and writes the QuantizedX planes; `store_quantized_rows` rounds plain (R, K) rows.

Rounding is IEEE, as `quantize_x` rounds in XLA: division and round-half-even by one PTX
instruction each (Triton's own division is approximate and Pallas-Triton has no rounding
primitive; an add-based rounding would be contracted into an FMA with the product before
it). In Pallas' interpreter both are the jnp operations, so the CPU tests are bit-exact.

The Mosaic GPU versions, and the kernel for rows from no other kernel of ours, are in mgpu.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .mgpu import as_quantized, quantized_out_shapes  # noqa: F401  (shared with the Triton producers)

_I32, _F32 = jnp.int32, jnp.float32


def ptx(instruction, result_dtype, *args):
    """One PTX instruction applied elementwise to 32-bit operands (f registers for float32)."""
    args = jnp.broadcast_arrays(*args)
    reg = lambda dtype: "f" if dtype == _F32 else "r"
    [out] = plgpu.elementwise_inline_asm(
        instruction, args=list(args), pack=1,
        constraints=",".join(["=" + reg(result_dtype)] + [reg(a.dtype) for a in args]),
        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, result_dtype)])
    return out


def _div(a, b, ip):
    return a / b if ip else ptx("div.rn.f32 $0, $1, $2;", _F32, a, b)


def _round_to_int(v, ip):
    return jnp.round(v).astype(_I32) if ip else ptx("cvt.rni.s32.f32 $0, $1;", _I32, v)


def group_mask(gp: int, g: int, g0=0):
    return g0 + jax.lax.broadcasted_iota(_I32, (gp,), 0) < g


def _full(mask, shape):
    return jnp.broadcast_to(mask.reshape(mask.shape + (1,) * (len(shape) - 1)), shape)


def group_scale(amax, ip: bool):
    """(1 / step, step) of groups with max |x| amax: q = round(x / step) lies in [-127, 127]."""
    inv = jnp.where(amax > 0, _div(jnp.full_like(amax, 127.0), jnp.where(amax > 0, amax, 1.0), ip), 0.0)
    return inv, _div(amax, jnp.full_like(amax, 127.0), ip)


def round_to_words(lanes, inv, ip: bool):
    """Four lanes (float32, inv broadcast against them) rounded to int8 and packed into words
    (lane i in byte i); also q0 + q1 + q2 + q3 per word, for the sums of q."""
    q = [_round_to_int(v * inv, ip) for v in lanes]
    return (q[0] & 0xFF) | ((q[1] & 0xFF) << 8) | ((q[2] & 0xFF) << 16) | (q[3] << 24), q[0] + q[1] + q[2] + q[3]


def store_quantized(values, refs, row, gp: int, g: int, ip: bool, g0=0):
    """Round four lanes (GP, 2, 4) of a row, groups g0 .. g0 + GP, to int8 per group and store
    them into the QuantizedX planes `refs` = (words (M, G, 2, 4), d (M, G), dsum32 (M, G),
    dsum16 (M, G, 2))."""
    words_ref, d_ref, dsum32_ref, dsum16_ref = refs
    amax = None
    for v in values:
        a = jnp.max(jnp.max(jnp.abs(v), axis=-1), axis=-1)
        amax = a if amax is None else jnp.maximum(amax, a)
    inv, d = group_scale(amax, ip)
    words, qsum = round_to_words(values, inv[:, None, None], ip)
    sum16 = jnp.sum(qsum, axis=-1)                                     # (GP, 2)
    groups = pl.ds(g0, gp)
    mask = group_mask(gp, g, g0)
    plgpu.store(words_ref.at[row, groups, :, :], words, mask=_full(mask, (gp, 2, 4)))
    plgpu.store(d_ref.at[row, groups], d, mask=mask)
    plgpu.store(dsum32_ref.at[row, groups], d * jnp.sum(sum16, axis=-1).astype(_F32), mask=mask)
    plgpu.store(dsum16_ref.at[row, groups, :], d[:, None] * sum16.astype(_F32), mask=_full(mask, (gp, 2)))


def store_quantized_rows(x, refs, rows, row_mask, ip: bool):
    """Round rows x (R, K) (float32 in registers, K a multiple of 32) to int8 per 32 values, and
    store them at rows `rows` of the QuantizedX planes viewed per row: words (.., K / 4), d and
    dsum32 (.., K / 32), dsum16 (.., K / 16); rows where row_mask (R,) is false are not stored.
    The four bytes of a word are packed by a sum over the row's trailing axis of 4, which
    Triton keeps within a thread (its loads give each thread runs of contiguous values)."""
    words_ref, d_ref, dsum32_ref, dsum16_ref = refs
    r, k = x.shape
    g = k // 32
    grouped = x.reshape(r, g, 32)
    inv, d = group_scale(jnp.max(jnp.abs(grouped), axis=-1), ip)
    q = _round_to_int(grouped * inv[:, :, None], ip).reshape(r, k // 4, 4)
    shifts = 8 * jax.lax.broadcasted_iota(_I32, q.shape, 2)
    words = jnp.sum((q & 0xFF) << shifts, axis=-1)                      # disjoint bytes: the sum is their OR
    sum16 = jnp.sum(q.reshape(r, g, 2, 16), axis=-1)                    # (R, G, 2)
    mask = row_mask[:, None]
    plgpu.store(words_ref.at[rows, :], words, mask=mask)
    plgpu.store(d_ref.at[rows, :], d, mask=mask)
    plgpu.store(dsum32_ref.at[rows, :], d * jnp.sum(sum16, axis=-1).astype(_F32), mask=mask)
    plgpu.store(dsum16_ref.at[rows, :], (d[:, :, None] * sum16.astype(_F32)).reshape(r, 2 * g), mask=mask)
