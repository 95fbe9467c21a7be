"""Decode GEMV on integer dot products: GGUF weights x int8-quantized activations.

The float GEMV (kernel.py) spends five or more instructions per weight value on unpacking,
int->float conversion, scaling and a multiply-add, which bounds it at a fraction of the HBM
bandwidth. This kernel does what llama.cpp's MMVQ does: the activations are quantized to
int8 once per call (one float32 scale per 32 values, as ggml's Q8_1), each 32-bit word of
packed weight quants is turned into four int8 lanes with one or two logic ops, and a
`dp4a` (four int8 products summed into an int32) multiplies four values at once. Scales
and offsets are applied once per 16 or 32 values on the int32 sums, in float32.

Weights are read as 32-bit words, four packed bytes at a time: `words` takes the quant
planes either already as int32 words (`as_words`, done once at load) or as bytes, which the
kernel assembles into words itself.

Lowering: Pallas' Triton backend, with `dp4a` as inline PTX (`elementwise_inline_asm`):
neither Pallas-Triton nor Mosaic GPU exposes an integer dot-product primitive. In Pallas'
CPU interpreter (tests) `dp4a` is the same arithmetic written in jnp, so everything but the
one PTX instruction is tested on CPU; the GPU tests run the PTX.

Numerics: the result differs from the float product by the activation rounding (relative
error about 0.5% per value, mostly averaging out over K), as in llama.cpp. It is exact
against the float product of the dequantized weight and the dequantized int8 activations.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.quant_matmul.tiles import index, load_masked
from rjax.quant.formats import Q4_KChunks
from rjax.quant.qtensor import QTensor

_I32, _F32 = jnp.int32, jnp.float32


def _f(v):
    return v.astype(_F32)
LOW_NIBBLES = 0x0F0F0F0F
TYPES = (QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q6_K)


# --- activations -----------------------------------------------------------------------------

class QuantizedX(NamedTuple):
    """x (M, K) quantized per 32 values: x ~= d * q, q int8 in [-127, 127]."""
    words: jax.Array   # (M, K // 4) int32: four int8 q per word, little-endian
    d: jax.Array       # (M, K // 32) float32
    dsum32: jax.Array  # (M, K // 32) float32: d * (sum of q over the 32 values)
    dsum16: jax.Array  # (M, K // 16) float32: d * (sum of q over each 16 values)


def quantize_x(x: jax.Array) -> QuantizedX:
    """Round x (M, K), K a multiple of 32, to int8 per 32 values (ggml's Q8_1 scheme).

    The sums serve the weight formats with offsets or mins: sum(x * (q_w - 8)) is
    d_x * (dot(q_x, q_w) - 8 * sum(q_x)), so they are taken over the rounded q."""
    m, k = x.shape
    xf = x.astype(_F32).reshape(m, k // 32, 32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    d = amax / 127.0
    inv = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
    q = jnp.clip(jnp.round(xf * inv[..., None]), -127, 127).astype(jnp.int8)
    words = jax.lax.bitcast_convert_type(q.reshape(m, k // 4, 4), _I32)
    sum16 = _f(q.astype(_I32).reshape(m, k // 32, 2, 16).sum(-1))
    return QuantizedX(words, d, d * sum16.sum(-1), (d[..., None] * sum16).reshape(m, k // 16))


def dequantize_x(xq: QuantizedX) -> jax.Array:
    """The float32 activations the kernel multiplies: d * q, shape (M, K)."""
    m = xq.words.shape[0]
    q = jax.lax.bitcast_convert_type(xq.words, jnp.int8).reshape(m, -1, 32).astype(_F32)
    return (q * xq.d[..., None]).reshape(m, -1)


# --- weights as words ------------------------------------------------------------------------

_WORD_FIELDS = {QType.Q8_0: ("qs",), QType.Q4_0: ("qs",), QType.Q4_1: ("qs",),
                QType.Q4_K: ("scales", "qs"), QType.Q6_K: ("ql", "qh")}


def as_words(w: QTensor) -> QTensor:
    """The same QTensor with its packed quant planes viewed as int32 words (..., n // 4)."""
    fields = _WORD_FIELDS[w.qtype]
    planes = w.planes._replace(**{
        f: jax.lax.bitcast_convert_type(
            getattr(w.planes, f).reshape(*getattr(w.planes, f).shape[:-1], -1, 4), _I32)
        for f in fields})
    return QTensor(planes, w.qtype, w.shape)


# --- in-kernel helpers -----------------------------------------------------------------------

def _load_words(ref, idx, mask):
    """int32 words at ref[idx]: a word plane directly, a byte plane (trailing axis of 4 bytes)
    assembled little-endian."""
    if ref.dtype == jnp.int32:
        return load_masked(ref, idx, mask)
    b = load_masked(ref, tuple(idx) + (slice(None),), mask).astype(_I32) & 0xFF
    shifts = 8 * jax.lax.broadcasted_iota(_I32, b.shape, b.ndim - 1)
    return jnp.sum(b << shifts, axis=-1)


def dp4a(a, b, c, interpret: bool):
    """c + sum of the four signed int8 lane products of int32 words a and b (PTX dp4a)."""
    a, b, c = jnp.broadcast_arrays(a, b, c)
    if interpret:
        total = c
        for i in range(4):
            la = (a << (24 - 8 * i)) >> 24
            lb = (b << (24 - 8 * i)) >> 24
            total = total + la * lb
        return total
    [out] = plgpu.elementwise_inline_asm(
        "dp4a.s32.s32 $0, $1, $2, $3;", args=[a, b, c], constraints="=r,r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, _I32)])
    return out


# --- per-type steps --------------------------------------------------------------------------
# A step is split in two: `load` reads the step's weight tile (BN rows x BKB blocks) and the
# matching activations for every x row into registers; `dot` is arithmetic only and returns,
# per x row, the step's w * x contributions as (BN, BKB) float32. The kernel issues the next
# step's loads before the current step's arithmetic, which is how the HBM latency is hidden
# (Triton pipelines only loads that feed a tl.dot, so nothing else would overlap them).

def _load_q8_0(w_refs, x_refs, rows, blocks, wmask, bmask, ms):
    d_ref, qs_ref = w_refs
    xw_ref, xd_ref, _ = x_refs                 # xw (M, nb, 8), xd (M, nb)
    return (load_masked(d_ref, (rows, blocks), wmask),
            _load_words(qs_ref, (rows, blocks, slice(None)), wmask),            # (BN, BKB, 8)
            [(load_masked(xw_ref, (m, blocks, slice(None)), bmask),
              load_masked(xd_ref, (m, blocks), bmask)) for m in ms])


def _dot_q8_0(t, ip):
    d, w, xs = t
    return [_f(d) * _f(jnp.sum(dp4a(w, xw[None], 0, ip), axis=-1)) * xd[None] for xw, xd in xs]


def _load_q4_0(w_refs, x_refs, rows, blocks, wmask, bmask, ms):
    """Q4_0 and Q4_1 (whose extra plane is the min m): d, [m], qs words (BN, BKB, 4), and per
    x row the words of values 0..15 and 16..31, d_x and dsum32 (M, nb)."""
    *scale_refs, qs_ref = w_refs
    xw_ref, xd_ref, xs_ref = x_refs            # xw (M, nb, 2, 4)
    return ([load_masked(r, (rows, blocks), wmask) for r in scale_refs],
            _load_words(qs_ref, (rows, blocks, slice(None)), wmask),
            [tuple(load_masked(xw_ref, (m, blocks, h, slice(None)), bmask) for h in range(2))
             + (load_masked(xd_ref, (m, blocks), bmask), load_masked(xs_ref, (m, blocks), bmask)) for m in ms])


def _q4_sums(w, x0, x1, ip):
    """sum of q * xq over a 32-block of 4-bit quants (low nibbles values 0..15, high 16..31)."""
    lo = dp4a(w & LOW_NIBBLES, x0[None], 0, ip)
    return _f(jnp.sum(dp4a((w >> 4) & LOW_NIBBLES, x1[None], lo, ip), axis=-1))


def _dot_q4_0(t, ip):
    [d], w, xs = t
    return [_f(d) * (_q4_sums(w, x0, x1, ip) * xd[None] - 8.0 * xsum[None]) for x0, x1, xd, xsum in xs]


def _dot_q4_1(t, ip):
    [d, mn], w, xs = t
    return [_f(d) * _q4_sums(w, x0, x1, ip) * xd[None] + _f(mn) * xsum[None] for x0, x1, xd, xsum in xs]


def _load_q4_k(w_refs, x_refs, rows, blocks, wmask, bmask, ms, scales=True):
    d_ref, dmin_ref, sc_ref, qs_ref = w_refs    # scales as 3 words, qs words viewed (N, nb, 4, 8)
    xw_ref, xd_ref, xs_ref = x_refs            # xw (M, nb, 4, 2, 8), xd and xs = dsum32 (M, nb, 4, 2)
    return (load_masked(d_ref, (rows, blocks), wmask), load_masked(dmin_ref, (rows, blocks), wmask),
            [_load_words(sc_ref, (rows, blocks, i), wmask) for i in range(3)] if scales else None,
            _load_words(qs_ref, (rows, blocks, slice(None), slice(None)), wmask),    # (BN, BKB, 4, 8)
            [[(load_masked(xw_ref, (m, blocks, slice(None), h, slice(None)), bmask),  # (BKB, 4, 8)
               load_masked(xd_ref, (m, blocks, slice(None), h), bmask),
               load_masked(xs_ref, (m, blocks, slice(None), h), bmask)) for h in range(2)] for m in ms])


def _q4_k_halves(d, dmin, scale_min, w, xs, ip):
    """Sub-block 2c + h of a super-block is the low (h=0) or high (h=1) nibbles of its 32-byte
    chunk c; each half is handled for all four chunks at once, as (BN, BKB, 4) tensors.
    scale_min(h) gives the sub-blocks' 6-bit scales and mins, (BN, BKB, 4) each."""
    d, dmin = _f(d)[..., None], _f(dmin)[..., None]
    out = [0.0] * len(xs)
    for h in range(2):
        sc, mn = scale_min(h)
        dsc, dmn = d * _f(sc), dmin * _f(mn)
        q = (w >> (4 * h)) & LOW_NIBBLES
        for i, x in enumerate(xs):
            xw, xd, xsum = x[h]
            s = _f(jnp.sum(dp4a(q, xw[None], 0, ip), axis=-1))
            out[i] = out[i] + jnp.sum(dsc * s * xd[None] - dmn * xsum[None], axis=-1)
    return out


def _dot_q4_k(t, ip):
    d, dmin, (w0, w1, w2), w, xs = t
    w0, w1, w2 = w0[..., None], w1[..., None], w2[..., None]
    chunk = jax.lax.broadcasted_iota(_I32, (1, 1, 4), 2)

    def scale_min(h):
        # ggml's get_scale_min_k4 for sub-blocks 2c + h, c = 0..3: byte j of the 12 is byte
        # j % 4 of word j // 4; sub-blocks 0..3 take 6 bits of words 0 / 1, sub-blocks 4..7
        # a nibble of word 2 and the top 2 bits of words 0 / 1.
        sh = 8 * ((2 * chunk + h) & 3)
        return (jnp.where(chunk < 2, (w0 >> sh) & 63, ((w2 >> sh) & 0x0F) | (((w0 >> (sh + 6)) & 3) << 4)),
                jnp.where(chunk < 2, (w1 >> sh) & 63, ((w2 >> (sh + 4)) & 0x0F) | (((w1 >> (sh + 6)) & 3) << 4)))

    return _q4_k_halves(d, dmin, scale_min, w, xs, ip)


def _load_q4_k_chunks(w_refs, x_refs, rows, blocks, wmask, bmask, ms):
    """Q4_K in the Q4_KChunks layout: one scale word per quant chunk, aligned with the chunk
    axis of the quants, instead of the 12 packed bytes (measured 22-25% faster at the 8B
    shapes: the packed bytes cost five loads per row and block and ~20 integer ops per 32
    values to unpack)."""
    d_ref, dmin_ref, cs_ref, qs_ref = w_refs
    t = _load_q4_k((d_ref, dmin_ref, None, qs_ref), x_refs, rows, blocks, wmask, bmask, ms, scales=False)
    return t[:2] + (load_masked(cs_ref, (rows, blocks, slice(None)), wmask),) + t[3:]


def _dot_q4_k_chunks(t, ip):
    d, dmin, cs, w, xs = t
    return _q4_k_halves(d, dmin, lambda h: ((cs >> (8 * h)) & 0xFF, (cs >> (16 + 8 * h)) & 0xFF), w, xs, ip)


# Q6_K value 128h + 32j + 16t + l: low 4 bits in ql byte 64h + 32(j%2) + 16t + l (nibble
# j//2), high 2 bits in qh byte 32h + 16t + l (bits 2j, 2j+1), scale 8h + 2j + t.
_Q6_K_STEPS = [(h, t) for h in range(2) for t in range(2)]


def _load_q6_k(w_refs, x_refs, rows, blocks, wmask, bmask, ms):
    ql_ref, qh_ref, sc_ref, d_ref = w_refs     # ql words (N, nb, 2, 2, 2, 4), qh words (N, nb, 2, 2, 4)
    xw_ref, xd_ref, xs_ref = x_refs            # xw (M, nb, 2, 4, 2, 4), xd (M, nb, 2, 4), xs = dsum16 (M, nb, 2, 4, 2)
    return (load_masked(d_ref, (rows, blocks), wmask),
            [(_load_words(qh_ref, (rows, blocks, h, t, slice(None)), wmask),            # (BN, BKB, 4)
              [_load_words(ql_ref, (rows, blocks, h, jm, t, slice(None)), wmask) for jm in range(2)],
              [load_masked(sc_ref, (rows, blocks, 8 * h + 2 * j + t), wmask) for j in range(4)])
             for h, t in _Q6_K_STEPS],
            [[[(load_masked(xw_ref, (m, blocks, h, j, t, slice(None)), bmask),
                load_masked(xd_ref, (m, blocks, h, j), bmask),
                load_masked(xs_ref, (m, blocks, h, j, t), bmask)) for j in range(4)]
              for h, t in _Q6_K_STEPS] for m in ms])


def _dot_q6_k(t, ip):
    d, ws, xs = t
    out = [0.0] * len(xs)
    for k, (qh, ql, scs) in enumerate(ws):
        for j in range(4):
            q = ((ql[j % 2] >> (4 * (j // 2))) & LOW_NIBBLES) | (((qh >> (2 * j)) & 0x03030303) << 4)
            for i, x in enumerate(xs):
                xw, xd, xsum = x[k][j]
                s = _f(jnp.sum(dp4a(q, xw[None], 0, ip), axis=-1))
                out[i] = out[i] + _f(scs[j]) * (s * xd[None] - 32.0 * xsum[None])
    return [_f(d) * o for o in out]


class _Format(NamedTuple):
    block_size: int
    load: object
    dot: object
    w_views: object      # (planes, n, nb) -> arrays, words or bytes (trailing 4)
    x_views: object      # (QuantizedX, m, nb) -> (xw, xd, xs)


def _words_view(p, *shape):
    """Reshape a quant plane to `shape` in words: int32 as is, uint8 with a trailing 4."""
    if p.dtype == _I32:
        return p.reshape(shape)
    if p.dtype != jnp.uint8:
        p = jax.lax.bitcast_convert_type(p, jnp.uint8)
    return p.reshape(*shape, 4)


def _w_q8_0(p, n, nb):
    return p.d, _words_view(p.qs, n, nb, 8)


def _w_q4_0(p, n, nb):
    return p.d, _words_view(p.qs, n, nb, 4)


def _w_q4_1(p, n, nb):
    return p.d, p.m, _words_view(p.qs, n, nb, 4)


def _w_q4_k(p, n, nb):
    return p.d, p.dmin, _words_view(p.scales, n, nb, 3), _words_view(p.qs, n, nb, 4, 8)


def _w_q4_k_chunks(p, n, nb):
    return p.d, p.dmin, p.chunk_scales, _words_view(p.qs, n, nb, 4, 8)


def _w_q6_k(p, n, nb):
    return _words_view(p.ql, n, nb, 2, 2, 2, 4), _words_view(p.qh, n, nb, 2, 2, 4), p.scales, p.d


def _x_32(xq, m, nb):
    return xq.words.reshape(m, nb, 8), xq.d.reshape(m, nb), xq.dsum32.reshape(m, nb)


def _x_q4(xq, m, nb):
    return xq.words.reshape(m, nb, 2, 4), xq.d.reshape(m, nb), xq.dsum32.reshape(m, nb)


def _x_q4_k(xq, m, nb):
    return (xq.words.reshape(m, nb, 4, 2, 8), xq.d.reshape(m, nb, 4, 2), xq.dsum32.reshape(m, nb, 4, 2))


def _x_q6_k(xq, m, nb):
    return (xq.words.reshape(m, nb, 2, 4, 2, 4), xq.d.reshape(m, nb, 2, 4),
            xq.dsum16.reshape(m, nb, 2, 4, 2))


FORMATS = {
    QType.Q8_0: _Format(32, _load_q8_0, _dot_q8_0, _w_q8_0, _x_32),
    QType.Q4_0: _Format(32, _load_q4_0, _dot_q4_0, _w_q4_0, _x_q4),
    QType.Q4_1: _Format(32, _load_q4_0, _dot_q4_1, _w_q4_1, _x_q4),
    QType.Q4_K: _Format(256, _load_q4_k, _dot_q4_k, _w_q4_k, _x_q4_k),
    QType.Q6_K: _Format(256, _load_q6_k, _dot_q6_k, _w_q6_k, _x_q6_k),
}
Q4_K_CHUNKS = _Format(256, _load_q4_k_chunks, _dot_q4_k_chunks, _w_q4_k_chunks, _x_q4_k)


def _format_of(w: QTensor) -> _Format:
    return Q4_K_CHUNKS if isinstance(w.planes, Q4_KChunks) else FORMATS[w.qtype]


@dataclasses.dataclass(frozen=True)
class Int8GemvConfig:
    block_n: int = 16       # weight rows per program
    block_k: int = 8        # GGUF blocks per step (power of two)
    split_k: int = 1        # programs sharing one row tile along K
    num_warps: int = 4
    num_stages: int = 3
    prefetch: bool = True   # load step i + 1 before the arithmetic of step i


def _iota(n):
    return jax.lax.broadcasted_iota(_I32, (n,), 0)


def _kernel(*refs, fmt, cfg, m_rows, n_rows, n_blocks, blocks_per_split, n_w, interpret):
    x_refs, w_refs, o_ref = refs[:3], refs[3:3 + n_w], refs[-1]
    bn, bkb = cfg.block_n, cfg.block_k
    pid_n, pid_s = pl.program_id(0), pl.program_id(1)
    n0 = pid_n * bn
    kb0 = pid_s * blocks_per_split
    kb_end = jnp.minimum(kb0 + blocks_per_split, n_blocks)
    rows = pl.ds(n0, bn)
    rmask = (n0 + _iota(bn)) < n_rows
    ms = list(range(m_rows))

    def load(i):
        b0 = kb0 + i * bkb
        blocks = pl.ds(b0, bkb)
        bmask = (b0 + _iota(bkb)) < kb_end     # past the split's end (the prefetch after the
        wmask = rmask[:, None] & bmask[None, :]  # last step): masked, nothing is read
        return fmt.load(w_refs, x_refs, rows, blocks, wmask, bmask, ms)

    def step(i, carry):
        accs, tile = carry
        if not cfg.prefetch:
            return tuple(a + p for a, p in zip(accs, fmt.dot(load(i), interpret))), tile
        following = load(i + 1)
        return tuple(a + p for a, p in zip(accs, fmt.dot(tile, interpret))), following

    zeros = tuple(jnp.zeros((bn, bkb), _F32) for _ in ms)
    accs, _ = jax.lax.fori_loop(0, blocks_per_split // bkb, step,
                                (zeros, load(0) if cfg.prefetch else ()))
    for m, acc in enumerate(accs):
        idx = (index(m), rows) if cfg.split_k == 1 else (pid_s, index(m), rows)
        plgpu.store(o_ref.at[idx], jnp.sum(acc, axis=1).astype(o_ref.dtype), mask=rmask)


MAX_M = 8


def supports(qtype: QType) -> bool:
    return qtype in FORMATS


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def int8_gemv(x: jax.Array, w: QTensor, cfg: Int8GemvConfig = Int8GemvConfig(),
              interpret: bool = False) -> jax.Array:
    """x (M <= MAX_M, K) @ dequantize(w).T -> (M, N) in x.dtype, on int8 dot products."""
    if w.qtype not in FORMATS:
        raise NotImplementedError(f"int8_gemv: no kernel for {w.qtype.name}")
    fmt = _format_of(w)
    n_rows, k = w.shape
    m_rows = x.shape[0]
    if x.ndim != 2 or x.shape[1] != k or not 1 <= m_rows <= MAX_M:
        raise ValueError(f"int8_gemv: x of shape {x.shape} for weight {w.qtype.name} {w.shape} "
                         f"(M must be 1..{MAX_M})")
    n_blocks = k // fmt.block_size
    xq = quantize_x(x)
    x_views = fmt.x_views(xq, m_rows, n_blocks)
    w_views = fmt.w_views(w.planes, n_rows, n_blocks)
    blocks_per_split = pl.cdiv(pl.cdiv(n_blocks, cfg.split_k), cfg.block_k) * cfg.block_k
    grid = (pl.cdiv(n_rows, cfg.block_n), cfg.split_k)
    if cfg.split_k == 1:
        out_shape = jax.ShapeDtypeStruct((m_rows, n_rows), x.dtype)
    else:
        out_shape = jax.ShapeDtypeStruct((cfg.split_k, m_rows, n_rows), _F32)
    kernel = functools.partial(_kernel, fmt=fmt, cfg=cfg, m_rows=m_rows, n_rows=n_rows, n_blocks=n_blocks,
                               blocks_per_split=blocks_per_split, n_w=len(w_views), interpret=interpret)
    wbytes = sum(math.prod(v.shape) * v.dtype.itemsize for v in w_views)
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        cost_estimate=pl.CostEstimate(flops=2 * m_rows * n_rows * k, transcendentals=0,
                                      bytes_accessed=wbytes + x.size * 2 + m_rows * n_rows * 4),
        interpret=interpret, name=f"int8_gemv_{w.qtype.name.lower()}",
    )(*x_views, *w_views)
    if cfg.split_k > 1:
        out = out.sum(axis=0).astype(x.dtype)
    return out
