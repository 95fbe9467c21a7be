"""Residual add + RMS norm as a Mosaic GPU kernel, for decode-sized row counts.

Same contract as the reference without `quantize`: x (M, K) float32, the block output's S
split-K partial sums (S, M, K) or None, w (K,) -> (x + sum(parts), rms_norm(.) * w in out_dtype).

One program (one warpgroup) per row, reading the row, its partials and the weight straight from
global memory into registers and writing both outputs back the same way: at a few kilobytes a
row, staging through shared memory by TMA measured slower (docs/kernels.md, "Norms and
activations"). K a multiple of 128 is strided over the warpgroup's 128 threads. Other K (576,
smollm2's) are multiples of 64 only: the row is then viewed as (K / 64, 64), 32 lanes x 2
values across a view row, and every warp holds the whole row (the warps replicated), so its sum
of squares needs no exchange between warps.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.pallas import mosaic_gpu as plgpu

_F32 = jnp.float32
COLS = 64  # the view rows of K that are not a multiple of 128
_REPLICATED = plgpu.Layout.TILED(fa.Tiling(((1, COLS), (2,))), warp_dims=(plgpu.Replicated(4),), lane_dims=(-2,),
                                 vector_dim=-1)


def supports(k: int) -> bool:
    return k % COLS == 0


def _kernel(x_ref, *refs, n_parts: int, k: int, eps: float, strided: bool):
    parts_ref = refs[0] if n_parts else None
    w_ref, x_out_ref, y_ref = refs[-3:]
    row = jax.lax.axis_index("row")
    # Strided: the layout Mosaic infers. Else the replicated view, which has no vectorized
    # global-memory path (`optimized=False`: plain 8-byte loads, which is what it needs).
    load = (lambda ref: ref[...]) if strided else (lambda ref: plgpu.load(ref, layout=_REPLICATED, optimized=False))
    x = load(x_ref.at[row])
    for s in range(n_parts):
        x = x + load(parts_ref.at[s, row]).astype(_F32)
    ss = x * x
    ss = jnp.sum(ss) if strided else jnp.sum(jnp.sum(ss, axis=1), axis=0)
    r = jax.lax.rsqrt(ss / k + eps)
    x_out_ref[row] = x
    y_ref[row] = (x * r * load(w_ref).astype(_F32)).astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "interpret"))
def add_rms_norm_mgpu(x: jax.Array, parts: jax.Array | None, w: jax.Array, eps: float, out_dtype,
                      interpret: bool = False):
    """x (M, K) float32, parts (S, M, K) or None, w (K,) -> (x + sum(parts), rms_norm(.) * w in out_dtype)."""
    m, k = x.shape
    if (parts is not None and parts.shape[1:] != (m, k)) or w.shape != (k,):
        raise ValueError(f"add_rms_norm: parts {None if parts is None else parts.shape} and weight "
                         f"{w.shape} do not match x {x.shape}")
    if not supports(k):
        raise ValueError(f"add_rms_norm: the Mosaic GPU kernel needs K a multiple of {COLS}, got x {x.shape}")
    n_parts = 0 if parts is None else parts.shape[0]
    strided = k % 128 == 0
    view = (k,) if strided else (k // COLS, COLS)
    x_out, y = plgpu.kernel(
        functools.partial(_kernel, n_parts=n_parts, k=k, eps=float(eps), strided=strided),
        out_type=(jax.ShapeDtypeStruct((m, *view), _F32), jax.ShapeDtypeStruct((m, *view), out_dtype)),
        grid=(m,), grid_names=("row",), interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(x.astype(_F32).reshape(m, *view), *([parts.reshape(n_parts, m, *view)] if n_parts else []), w.reshape(view))
    return x_out.reshape(m, k), y.reshape(m, k)
