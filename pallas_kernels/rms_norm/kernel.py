"""Residual add + RMS norm in one kernel, for decode-sized row counts.

Between two transformer blocks XLA runs the residual add, the sum of squares and the scaling
as two kernels (a reduction cannot feed a broadcast inside one of its fusions), and at decode
batch sizes each of them is a launch of about a microsecond over a few kilobytes. Here one
launch reads the residual row and the S partial sums of the block output (a split-K matmul
hands them over unsummed, so their sum costs no kernel either), and writes the new residual
(float32) and the normed row: the plain norm is the Mosaic GPU kernel of mgpu.py.

With `quantize`, the normed row is not written as floats but rounded to int8 per 32 values
for the int8 decode GEMV that reads it (pallas_kernels.int8_activations), in the same pass:
the row is then handled as 32-value groups of four byte lanes (K a multiple of 32), by a few
programs per row, each over CHUNK_GROUPS groups: every program reads the whole row for the
sum of squares (a few kilobytes, from L2) and rounds and writes its chunk only. With one
program per row the rounding was bound by one SM's issue rate. This one still lowers through
Pallas' Triton backend, like the rounding helpers it shares with the int8 producers
(pallas_kernels.int8_activations).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.int8_activations import kernel as q8

from .mgpu import COLS, add_rms_norm_mgpu, supports

_F32 = jnp.float32


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
    if not quantize and not supports(k):
        raise ValueError(f"add_rms_norm: the kernel needs K a multiple of {COLS}, got x {x.shape}")
    if not quantize:
        return add_rms_norm_mgpu(x, parts, w, eps, out_dtype, interpret=interpret)
    n_parts = 0 if parts is None else parts.shape[0]
    g = k // 32
    gp, chunks = q8.chunking(g)
    kernel = functools.partial(_quantizing_kernel, k=k, gp=gp, n_parts=n_parts, eps=eps, ip=interpret)
    x_out, *planes = pl.pallas_call(
        kernel, grid=(m, chunks), interpret=interpret, name="add_rms_norm_q8",
        compiler_params=plgpu.CompilerParams(num_warps=4 if k <= 4096 else 8, num_stages=1),
        out_shape=(jax.ShapeDtypeStruct((m, g, 2, 4, 4), _F32), *q8.quantized_out_shapes(m, k)),
    )(x.astype(_F32).reshape(m, g, 2, 4, 4), *([parts.reshape(n_parts, m, g, 2, 4, 4)] if n_parts else []),
      w.reshape(g, 2, 4, 4))
    return x_out.reshape(m, k), q8.as_quantized(planes, m, k, out_dtype)
