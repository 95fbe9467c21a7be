"""Residual add + RMS norm in one Mosaic GPU kernel, for decode-sized row counts.

Between two transformer blocks XLA runs the residual add, the sum of squares and the scaling
as two kernels (a reduction cannot feed a broadcast inside one of its fusions), and at decode
batch sizes each of them is a launch of about a microsecond over a few kilobytes. Here one
launch reads the residual row and the S partial sums of the block output (a split-K matmul
hands them over unsummed, so their sum costs no kernel either), and writes the new residual
(float32) and the normed row.

One program (one warpgroup) per row, reading the row, its partials and the weight straight from
global memory into registers and writing both outputs back the same way: at a few kilobytes a
row, staging through shared memory by TMA measured slower (docs/kernels.md, "Norms and
activations"). K a multiple of 128 is strided over the warpgroup's 128 threads. Other K (576,
smollm2's) are multiples of 64 only: the row is then viewed as (K / 64, 64), 32 lanes x 2
values across a view row, and every warp holds the whole row (the warps replicated), so its sum
of squares needs no exchange between warps.

With `quantize`, the normed row is not written as floats but rounded to int8 per 32 values
for the int8 decode GEMV that reads it (pallas_kernels.int8_activations), in the same pass, by
a few programs per row, each over a chunk of groups: every program reads the whole row for the
sum of squares (a few kilobytes, from L2) and rounds and writes its chunk only. With one
program per row the rounding was bound by one SM's issue rate.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.int8_activations import mgpu as q8

_F32 = jnp.float32
COLS = 64  # the view rows of K that are not a multiple of 128
_REPLICATED = plgpu.Layout.TILED(plgpu.Tiling(((1, COLS), (2,))), warp_dims=(plgpu.Replicated(4),),
                                 lane_dims=(-2,), vector_dim=-1)


def supports(k: int) -> bool:
    return k % COLS == 0


def _load_row(ref, strided: bool):
    # Strided: the layout Mosaic infers. Else the replicated view, which has no vectorized
    # global-memory path (`optimized=False`: plain 8-byte loads, which is what it needs).
    return ref[...] if strided else plgpu.load(ref, layout=_REPLICATED, optimized=False)


def _summed_row(x_ref, parts_ref, row, n_parts: int, k: int, eps: float, strided: bool):
    """The row x + sum(parts) in float32, and its 1 / rms."""
    x = _load_row(x_ref.at[row], strided)
    for s in range(n_parts):
        x = x + _load_row(parts_ref.at[s, row], strided).astype(_F32)
    ss = x * x
    ss = jnp.sum(ss) if strided else jnp.sum(jnp.sum(ss, axis=1), axis=0)
    return x, jax.lax.rsqrt(ss / k + eps)


def _kernel(x_ref, *refs, n_parts: int, k: int, eps: float, strided: bool):
    parts_ref = refs[0] if n_parts else None
    w_ref, x_out_ref, y_ref = refs[-3:]
    row = jax.lax.axis_index("row")
    x, r = _summed_row(x_ref, parts_ref, row, n_parts, k, eps, strided)
    x_out_ref[row] = x
    y_ref[row] = (x * r * _load_row(w_ref, strided).astype(_F32)).astype(y_ref.dtype)


def _quantizing_kernel(x_ref, x_lanes_ref, *refs, n_parts: int, k: int, eps: float, strided: bool, gp: int):
    """The same, the normed row rounded to int8 per 32 values: a program per chunk of GP groups,
    each summing the whole row for its 1 / rms; the first chunk's program writes the residual."""
    parts_ref, parts_lanes_ref = refs[:2] if n_parts else (None, None)
    w_lanes_ref, x_out_ref, *q_refs = refs[2 * bool(n_parts):]
    row, chunk = jax.lax.axis_index("row"), jax.lax.axis_index("chunk")
    g0 = chunk * gp
    x, r = _summed_row(x_ref, parts_ref, row, n_parts, k, eps, strided)

    @pl.when(chunk == 0)
    def _():
        x_out_ref[row] = x

    xs = q8.lanes(x_lanes_ref, (row,), gp, g0)
    for s in range(n_parts):
        xs = [a + b for a, b in zip(xs, q8.lanes(parts_lanes_ref, (s, row), gp, g0))]
    q8.store_quantized([v * r * w for v, w in zip(xs, q8.lanes(w_lanes_ref, (), gp, g0))], q_refs, row, gp, g0)


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "quantize", "interpret"))
def add_rms_norm_kernel(x: jax.Array, parts: jax.Array | None, w: jax.Array, eps: float, out_dtype,
                      quantize: bool = False, interpret: bool = False):
    """x (M, K) float32, parts (S, M, K) or None, w (K,) -> (x + sum(parts), rms_norm(.) * w in
    out_dtype, or with `quantize` as a QuantizedX of dtype out_dtype)."""
    m, k = x.shape
    if (parts is not None and parts.shape[1:] != (m, k)) or w.shape != (k,):
        raise ValueError(f"add_rms_norm: parts {None if parts is None else parts.shape} and weight "
                         f"{w.shape} do not match x {x.shape}")
    if not supports(k):
        raise ValueError(f"add_rms_norm: the kernel needs K a multiple of {COLS}, got x {x.shape}")
    n_parts = 0 if parts is None else parts.shape[0]
    strided = k % 128 == 0
    view = (k,) if strided else (k // COLS, COLS)
    x = x.astype(_F32)
    rows = lambda a, lead: a.reshape(*lead, *view)  # noqa: E731
    interpret = plgpu.InterpretGPUParams() if interpret else None
    if not quantize:
        x_out, y = plgpu.kernel(
            functools.partial(_kernel, n_parts=n_parts, k=k, eps=float(eps), strided=strided),
            out_type=(jax.ShapeDtypeStruct((m, *view), _F32), jax.ShapeDtypeStruct((m, *view), out_dtype)),
            grid=(m,), grid_names=("row",), interpret=interpret,
        )(rows(x, (m,)), *([rows(parts, (n_parts, m))] if n_parts else []), w.reshape(view))
        return x_out.reshape(m, k), y.reshape(m, k)
    g = k // 32
    gp = q8.chunk_groups(g)
    lanes = lambda a, lead: a.reshape(*lead, g, 2, 4, 4)  # noqa: E731
    x_out, *planes = plgpu.kernel(
        functools.partial(_quantizing_kernel, n_parts=n_parts, k=k, eps=float(eps), strided=strided, gp=gp),
        out_type=(jax.ShapeDtypeStruct((m, *view), _F32), *q8.quantized_out_shapes(m, k)),
        grid=(m, g // gp), grid_names=("row", "chunk"), interpret=interpret,
    )(rows(x, (m,)), lanes(x, (m,)), *([rows(parts, (n_parts, m)), lanes(parts, (n_parts, m))] if n_parts else []),
      lanes(w, ()))
    return x_out.reshape(m, k), q8.as_quantized(planes, m, k, out_dtype)
