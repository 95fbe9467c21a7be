"""Skinny GEMM on the tensor cores' int8 products: GGUF weights x int8-quantized activations,
for decode steps of several rows (batched decode, draft verification).

The dp4a GEMV (int8_gemv.py) repeats its dot products once per x row, and the float kernel
(kernel.py) dequantizes every weight to bf16 before its MMA; both cost about the same from
M = 8 on, two to three times the M = 1 time (H100, benchmarks/NOTES-quant_matmul.md). Here
the weight's quants go to the MMA as they are, int8: Q8_0's bytes need no work at all, Q4_K's
nibbles a shift and a mask. Each 32-value group is one [BM, 32] x [32, BN] int8 product with
int32 sums, scaled once per group and column in float32 (x's scale per row, the weight's per
column), as llama.cpp's MMQ does.

Measured on the H100 (benchmarks/NOTES-quant_matmul.md, session 9): 10-21% faster than the
float kernel for Q4_K at M=8, 4-11% at M=16, slower at M=32, and no faster for Q8_0 even though
its quants need no unpacking: both kernels stop at about 45-52 us at the 8B shapes, against 19-27
at M=1. In a model step the rounding of x that it needs cost what its products saved, so the
dispatch leaves it off (`gemv.INT8_MMA_MAX_M`).

x comes rounded (a QuantizedX from the norm or GLU kernel before the product), or is rounded
by `pallas_kernels.int8_activations.quantize` first. Byte order within a group does not
matter to the sums as long as x and the weight agree: both are unpacked by `int8_lanes`.

Lowering: Pallas' Triton backend (int8 `dot` with int32 accumulation lowers to Triton's
integer MMA); in Pallas' CPU interpreter the same code runs, which the tests rely on.

Numerics: exact against the float product of the dequantized weight and the dequantized int8
activations (the int32 sums are exact), so it differs from the float product by the
activation rounding, as int8_gemv.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.int8_activations import GatedX, QuantizedX, quantize
from pallas_kernels.quant_matmul.int8_gemv import LOW_NIBBLES, _words_view
from pallas_kernels.quant_matmul.tiles import index, join_lanes, load_masked, split_k_launch
from rjax.quant.formats import Q4_KChunks
from rjax.quant.qtensor import QTensor

_I32, _F32 = jnp.int32, jnp.float32
TYPES = (QType.Q8_0, QType.Q4_K)
MAX_M = 64


@dataclasses.dataclass(frozen=True)
class Int8MmaConfig:
    block_n: int = 64       # weight rows per program (>= 16, power of two)
    block_k: int = 4        # GGUF blocks per loop step
    split_k: int = 1        # programs sharing one row tile along K
    num_warps: int = 4
    num_stages: int = 3


def int8_lanes(words: jax.Array, signed: bool) -> jax.Array:
    """int32 words (R, W) -> their four byte lanes (R, 4W) as int8, little-endian order:
    sign-extended bytes (`signed`, int8 quants) or the bytes as they are (values 0..127)."""
    if signed:
        lanes = [(words << (24 - 8 * i)) >> 24 for i in range(4)]
    else:
        lanes = [(words >> (8 * i)) & 0xFF for i in range(4)]
    return join_lanes(lanes).astype(jnp.int8)


def _int_dot(x8, w8):
    """x8 (BM, 32) . w8 (BN, 32) -> (BM, BN) int32 sums, on the integer MMA."""
    return jax.lax.dot_general(x8, w8, (((1,), (1,)), ((), ())), preferred_element_type=_I32)


def _q8_0_block(w_refs, x_refs, rows, xrows, b, wmask, xmask):
    """One Q8_0 block: x's 32 values against the weight's, scaled by both. -> (BM, BN) f32."""
    d_ref, qs_ref = w_refs
    xw_ref, xd_ref, _ = x_refs
    if qs_ref.dtype == jnp.int8:
        w8 = load_masked(qs_ref, (rows, b, slice(None)), wmask)
    else:
        w8 = int8_lanes(load_masked(qs_ref, (rows, b, slice(None)), wmask), signed=True)
    x8 = int8_lanes(load_masked(xw_ref, (xrows, b, slice(None)), xmask), signed=True)
    wd = load_masked(d_ref, (rows, b), wmask).astype(_F32)
    xd = load_masked(xd_ref, (xrows, b), xmask)
    return _int_dot(x8, w8).astype(_F32) * xd[:, None] * wd[None, :]


def _q4_k_block(w_refs, x_refs, rows, xrows, b, wmask, xmask):
    """One Q4_K super-block in the Q4_KChunks layout: chunk c's low nibbles are sub-block 2c,
    its high nibbles 2c + 1, each with its 6-bit scale and min (bytes of chunk_scales[c])."""
    d_ref, dmin_ref, cs_ref, qs_ref = w_refs
    xw_ref, xd_ref, xs_ref = x_refs
    d = load_masked(d_ref, (rows, b), wmask).astype(_F32)
    dmin = load_masked(dmin_ref, (rows, b), wmask).astype(_F32)
    out = None
    for c in range(4):
        words = load_masked(qs_ref, (rows, b, index(c), slice(None)), wmask)       # (BN, 8)
        cs = load_masked(cs_ref, (rows, b, index(c)), wmask)
        for h in range(2):
            w8 = int8_lanes((words >> (4 * h)) & LOW_NIBBLES, signed=False)
            x8 = int8_lanes(load_masked(xw_ref, (xrows, b, index(c), index(h), slice(None)), xmask), signed=True)
            xd = load_masked(xd_ref, (xrows, b, index(c), index(h)), xmask)
            xs = load_masked(xs_ref, (xrows, b, index(c), index(h)), xmask)
            scale = d * ((cs >> (8 * h)) & 0xFF).astype(_F32)
            offset = dmin * ((cs >> (16 + 8 * h)) & 0xFF).astype(_F32)
            part = (_int_dot(x8, w8).astype(_F32) * xd[:, None] * scale[None, :]
                    - xs[:, None] * offset[None, :])
            out = part if out is None else out + part
    return out


def _q8_0_views(w: QTensor, n, nb):
    p = w.planes
    qs = p.qs.reshape(n, nb, 32) if p.qs.dtype == jnp.int8 else _words_view(p.qs, n, nb, 8)
    return p.d, qs


def _q4_k_views(w: QTensor, n, nb):
    p = w.planes
    return p.d, p.dmin, p.chunk_scales, _words_view(p.qs, n, nb, 4, 8)


# type -> (block step, weight views, x words per block, x groups per block)
_FORMATS = {
    QType.Q8_0: (_q8_0_block, _q8_0_views, (8,), ()),
    QType.Q4_K: (_q4_k_block, _q4_k_views, (4, 2, 8), (4, 2)),
}


def supports(w: QTensor) -> bool:
    """Q8_0 with its quants as int8 bytes or words; Q4_K in the GPU layout (Q4_KChunks, words)."""
    if w.qtype == QType.Q8_0:
        return True
    return (w.qtype == QType.Q4_K and isinstance(w.planes, Q4_KChunks)
            and w.planes.qs.dtype == jnp.int32)


def _iota(n):
    return jax.lax.broadcasted_iota(_I32, (n,), 0)


def _kernel(xw_ref, xd_ref, xs_ref, *refs, block, cfg, block_m, split_out, m_rows, n_rows, n_blocks,
            blocks_per_split):
    *w_refs, o_ref = refs
    bn = cfg.block_n
    pid_n, pid_s = pl.program_id(0), pl.program_id(1)
    n0 = pid_n * bn
    kb0 = pid_s * blocks_per_split
    kb_end = jnp.minimum(kb0 + blocks_per_split, n_blocks)
    rows, xrows = pl.ds(n0, bn), pl.ds(0, block_m)
    rmask = (n0 + _iota(bn)) < n_rows
    xmask = _iota(block_m) < m_rows

    def step(i, acc):
        for j in range(cfg.block_k):
            b = kb0 + i * cfg.block_k + j
            valid = b < kb_end
            acc = acc + block(w_refs, (xw_ref, xd_ref, xs_ref), rows, xrows, b, rmask & valid, xmask & valid)
        return acc

    acc = jax.lax.fori_loop(0, blocks_per_split // cfg.block_k, step, jnp.zeros((block_m, bn), _F32))
    idx = (pid_s, xrows, rows) if split_out else (xrows, rows)
    plgpu.store(o_ref.at[idx], acc.astype(o_ref.dtype), mask=xmask[:, None] & rmask[None, :])


@functools.partial(jax.jit, static_argnames=("cfg", "interpret", "partials"))
def int8_mma(x: jax.Array | QuantizedX | GatedX, w: QTensor, cfg: Int8MmaConfig = Int8MmaConfig(),
             interpret: bool = False, partials: bool = False) -> jax.Array:
    """x (M <= MAX_M, K) @ dequantize(w).T -> (M, N) on int8 MMA, in x's dtype (a QuantizedX's
    `dtype`); with `partials`, the split-K partial sums (split_k, M, N) in float32. Raw x (or a
    GatedX, its GLU applied there) is rounded to int8 by the rounding kernel first."""
    if not supports(w):
        raise NotImplementedError(f"int8_mma: no kernel for {w.qtype.name} in layout {type(w.planes).__name__}")
    n_rows, k = w.shape
    m_rows = x.shape[0]
    if len(x.shape) != 2 or x.shape[1] != k or not 1 <= m_rows <= MAX_M:
        raise ValueError(f"int8_mma: x of shape {x.shape} for weight {w.qtype.name} {w.shape} "
                         f"(M must be 1..{MAX_M})")
    if cfg.block_n < 16 or cfg.block_n & (cfg.block_n - 1):
        raise ValueError(f"int8_mma: block_n={cfg.block_n} must be a power of two >= 16")
    out_dtype = x.dtype
    if not isinstance(x, QuantizedX):
        impl = "interpret" if interpret else "pallas"
        x = (quantize(x.gate_up, x.activation, implementation=impl) if isinstance(x, GatedX)
             else quantize(x, implementation=impl))
    block, views, x_words, x_groups = _FORMATS[w.qtype]
    n_blocks = k // GGML_QUANT_SIZES[w.qtype][0]
    x_views = (x.words.reshape(m_rows, n_blocks, *x_words), x.d.reshape(m_rows, n_blocks, *x_groups),
               x.dsum32.reshape(m_rows, n_blocks, *x_groups))
    w_views = views(w, n_rows, n_blocks)
    block_m = max(16, pl.next_power_of_2(m_rows))
    blocks_per_split, out_shape = split_k_launch(n_blocks, cfg.block_k, cfg.split_k, m_rows, n_rows, out_dtype,
                                                 partials)
    grid = (pl.cdiv(n_rows, cfg.block_n), cfg.split_k)
    kernel = functools.partial(_kernel, block=block, cfg=cfg, block_m=block_m, split_out=len(out_shape.shape) == 3,
                               m_rows=m_rows, n_rows=n_rows, n_blocks=n_blocks, blocks_per_split=blocks_per_split)
    nbytes = sum(math.prod(v.shape) * v.dtype.itemsize for v in (*x_views, *w_views))
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        cost_estimate=pl.CostEstimate(flops=2 * m_rows * n_rows * k, transcendentals=0,
                                      bytes_accessed=nbytes + m_rows * n_rows * 4),
        interpret=interpret, name=f"int8_mma_{w.qtype.name.lower()}",
    )(*x_views, *w_views)
    if cfg.split_k > 1 and not partials:
        out = out.sum(axis=0).astype(out_dtype)
    return out
