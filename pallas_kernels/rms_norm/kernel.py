"""Residual add + RMS norm in one Pallas kernel, for decode-sized row counts.

Between two transformer blocks XLA runs the residual add, the sum of squares and the scaling
as two or three kernels (a reduction cannot feed a broadcast inside one of its fusions), and
at decode batch sizes each of them is a launch of a few microseconds over a few kilobytes.
Here one program per row reads the residual row and the S partial sums of the block output
(a split-K matmul hands them over unsummed, so their sum costs no kernel either), and writes
the new residual (float32) and the normed row.

With `quantize`, the normed row is not written as floats but rounded to int8 per 32 values
for the int8 decode GEMV that reads it (pallas_kernels.int8_activations), in the same pass:
the row is then handled as 32-value groups of four byte lanes (K a multiple of 32), by a few
programs per row, each over CHUNK_GROUPS groups: every program reads the whole row for the
sum of squares (a few kilobytes, from L2) and rounds and writes its chunk only. With one
program per row the rounding was bound by one SM's issue rate. The plain norm stays at one
program per row, where chunks measured slower (docs/kernels.md, "Norms and activations").

Lowering: Pallas' Triton backend (a row reduction and elementwise ops; Mosaic GPU brings
nothing for a kernel this small). Rows of any K: the row is one power-of-two tile, masked.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.int8_activations import kernel as q8

_F32 = jnp.float32


def _kernel(*refs, k, tile, n_parts, eps):
    x_ref, w_ref, x_out_ref, y_ref = refs[0], refs[-3], refs[-2], refs[-1]
    parts_ref = refs[1] if n_parts else None
    row = pl.program_id(0)
    cols = pl.ds(0, tile)
    mask = jax.lax.broadcasted_iota(jnp.int32, (tile,), 0) < k
    x = plgpu.load(x_ref.at[row, cols], mask=mask, other=0).astype(_F32)
    for s in range(n_parts):  # jnp.int32(s): the interpreter cannot discharge plain int indices
        x = x + plgpu.load(parts_ref.at[jnp.int32(s), row, cols], mask=mask, other=0).astype(_F32)
    r = jax.lax.rsqrt(jnp.sum(x * x) / k + eps)
    w = plgpu.load(w_ref.at[cols], mask=mask, other=0).astype(_F32)
    plgpu.store(x_out_ref.at[row, cols], x, mask=mask)
    plgpu.store(y_ref.at[row, cols], (x * r * w).astype(y_ref.dtype), mask=mask)


def _quantizing_kernel(*refs, k, gp, n_parts, eps, ip):
    """The same, on (G, 2, 4, 4) views of every row, storing the normed row as QuantizedX."""
    x_ref, w_ref, x_out_ref, q_refs = refs[0], refs[-6], refs[-5], refs[-4:]
    parts_ref = refs[1] if n_parts else None
    g = k // 32
    row, g0 = pl.program_id(0), pl.program_id(1) * gp

    def summed(size, start):
        xs = q8.lanes(x_ref, (row,), size, g, start)
        for s in range(n_parts):
            xs = [a + b for a, b in zip(xs, q8.lanes(parts_ref, (jnp.int32(s), row), size, g, start))]
        return xs

    ss = None
    for v in summed(pl.next_power_of_2(g), 0):
        ss = v * v if ss is None else ss + v * v
    r = jax.lax.rsqrt(jnp.sum(ss) / k + eps)
    xs = summed(gp, g0)
    q8.store_lanes(x_out_ref, (row,), xs, gp, g, g0)
    q8.store_quantized([v * r * w for v, w in zip(xs, q8.lanes(w_ref, (), gp, g, g0))], q_refs, row, gp, g,
                       ip, g0)


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "quantize", "interpret"))
def add_rms_norm_kernel(x: jax.Array, parts: jax.Array | None, w: jax.Array, eps: float, out_dtype,
                        quantize: bool = False, interpret: bool = False):
    """x (M, K) float32, parts (S, M, K) or None, w (K,) -> (x + sum(parts), rms_norm(.) * w),
    the second in out_dtype, or with `quantize` as a QuantizedX (of dtype out_dtype)."""
    m, k = x.shape
    if (parts is not None and parts.shape[1:] != (m, k)) or w.shape != (k,):
        raise ValueError(f"add_rms_norm: parts {None if parts is None else parts.shape} and weight "
                         f"{w.shape} do not match x {x.shape}")
    if quantize and k % 32:
        raise ValueError(f"add_rms_norm: quantize needs K a multiple of 32, got x {x.shape}")
    n_parts = 0 if parts is None else parts.shape[0]
    params = plgpu.CompilerParams(num_warps=4 if k <= 4096 else 8, num_stages=1)
    if quantize:
        g = k // 32
        gp, chunks = q8.chunking(g)
        kernel = functools.partial(_quantizing_kernel, k=k, gp=gp, n_parts=n_parts, eps=eps, ip=interpret)
        x_out, *planes = pl.pallas_call(
            kernel, grid=(m, chunks), compiler_params=params, interpret=interpret, name="add_rms_norm_q8",
            out_shape=(jax.ShapeDtypeStruct((m, g, 2, 4, 4), _F32), *q8.quantized_out_shapes(m, k)),
        )(x.astype(_F32).reshape(m, g, 2, 4, 4), *([parts.reshape(n_parts, m, g, 2, 4, 4)] if n_parts else []),
          w.reshape(g, 2, 4, 4))
        return x_out.reshape(m, k), q8.as_quantized(planes, m, k, out_dtype)
    tile = pl.next_power_of_2(k)
    kernel = functools.partial(_kernel, k=k, tile=tile, n_parts=n_parts, eps=eps)
    return pl.pallas_call(
        kernel, grid=(m,),
        out_shape=(jax.ShapeDtypeStruct((m, k), _F32), jax.ShapeDtypeStruct((m, k), out_dtype)),
        compiler_params=params, interpret=interpret, name="add_rms_norm",
    )(x.astype(_F32), *([parts] if n_parts else []), w)
