"""The int8 GEMV's per-type steps (int8_gemv.py): for each GGUF block type, the loads of a
weight tile and of the matching activations (raw, or a QuantizedX's planes), and the
arithmetic that turns packed quant words into int8 lanes and sums them with `dp4a`; and the
views of the weight and x planes the kernel reads (`FORMATS`)."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType as QType
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.int8_activations import kernel as q8
from pallas_kernels.int8_activations.reference import activate
from pallas_kernels.quant_matmul.tiles import load_masked
from gguf_blocks.formats import Q4_KChunks
from gguf_blocks.qtensor import QTensor

I32, F32 = jnp.int32, jnp.float32


def as_f32(v):
    return v.astype(F32)


LOW_NIBBLES = 0x0F0F0F0F


TYPES = (QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q6_K)


# --- in-kernel helpers -----------------------------------------------------------------------

def _load_words(ref, idx, mask):
    """int32 words at ref[idx]: a word plane directly, a byte plane (trailing axis of 4 bytes)
    assembled little-endian."""
    if ref.dtype == jnp.int32:
        return load_masked(ref, idx, mask)
    b = load_masked(ref, tuple(idx) + (slice(None),), mask).astype(I32) & 0xFF
    shifts = 8 * jax.lax.broadcasted_iota(I32, b.shape, b.ndim - 1)
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
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, I32)])
    return out


# --- activations in the kernel ----------------------------------------------------------------
# x comes either as a QuantizedX (its planes viewed per block, loaded as they are) or raw, as
# (M, n_blocks, ..., 4 lanes) views: then each step rounds the 32-value groups it covers,
# which needs nothing from outside the group. Either way `_group` gives the dot the same
# (words per part, d, dsum) per group.

def _lanes(x_ref, idx, mask):
    """The four byte lanes of x at idx, as stored (rounded in `dot`)."""
    return [load_masked(x_ref, tuple(idx) + (i,), mask) for i in range(4)]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _GatedLane:
    """A lane of a GatedX's x, loaded as its gate and up lanes; its value is act(gate) * up,
    evaluated with the rounding (in `dot`, after the step's loads were issued). A pytree: the
    prefetched tile rides in the loop's carry."""
    gate: jax.Array
    up: jax.Array
    activation: str = dataclasses.field(metadata=dict(static=True))

    def value(self):
        return activate(self.gate, self.activation) * as_f32(self.up)


def gated(gate, up, activation: str):
    """The loaded x structure of a GatedX: gate's and up's (same structure) lane by lane."""
    return jax.tree.map(lambda g, u: _GatedLane(g, u, activation), gate, up)


def _quantize(parts, ip):
    """Round one 32-value group per index, as `quantize_x`: parts are lane quads of shape
    S + (W,) that together make the group. -> words per part, d (S), q sums per part (S)."""
    parts = [[v.value() if isinstance(v, _GatedLane) else as_f32(v) for v in lanes] for lanes in parts]
    amax = None
    for lanes in parts:
        for v in lanes:
            a = jnp.max(jnp.abs(v), axis=-1)
            amax = a if amax is None else jnp.maximum(amax, a)
    inv, d = q8.group_scale(amax, ip)
    words, sums = [], []
    for lanes in parts:
        w, qsum = q8.round_to_words(lanes, inv[..., None], ip)
        words.append(w)
        sums.append(jnp.sum(qsum, axis=-1))
    return words, d, sums


def _group(x, ip, per_part=False):
    """(words per part, d, d * sum of q): over the whole group, or per part with `per_part`
    (Q6_K's 16-value scales). x is a loaded tuple as is, or a list of raw lane parts."""
    if isinstance(x, tuple):
        return x
    words, d, sums = _quantize(x, ip)
    if per_part:
        return words, d, [d * as_f32(s) for s in sums]
    total = sums[0]
    for s in sums[1:]:
        total = total + s
    return words, d, d * as_f32(total)


# --- per-type steps --------------------------------------------------------------------------
# A step is split in two: loads (`load_w` the step's weight tile, BN rows x BKB blocks;
# `load_x` / `load_xq` the matching activations of one x row, raw or rounded) and `dot`,
# arithmetic only (the rounding of raw x included), which returns per x row the step's
# w * x contributions as (BN, BKB) float32. The kernel issues the next step's loads before
# the current step's arithmetic, which is how the HBM latency is hidden (Triton pipelines
# only loads that feed a tl.dot, so nothing else would overlap them).

def _w_tile_q8_0(w_refs, rows, blocks, wmask):
    d_ref, qs_ref = w_refs
    return load_masked(d_ref, (rows, blocks), wmask), _load_words(qs_ref, (rows, blocks, slice(None)), wmask)


def _x_q8_0(x_ref, m, blocks, bmask):        # x (M, nb, 8, 4)
    return [_lanes(x_ref, (m, blocks, slice(None)), bmask)]


def _xq_q8_0(x_refs, m, blocks, bmask):      # words (M, nb, 8), d (M, nb)
    xw_ref, xd_ref, _ = x_refs
    return ([load_masked(xw_ref, (m, blocks, slice(None)), bmask)], load_masked(xd_ref, (m, blocks), bmask), None)


def _dot_q8_0(w, xs, ip):
    d, qs = w
    out = []
    for x in xs:
        [xw], xd, _ = _group(x, ip)
        out.append(as_f32(d) * as_f32(jnp.sum(dp4a(qs, xw[None], 0, ip), axis=-1)) * xd[None])
    return out


def _w_tile_q4_0(w_refs, rows, blocks, wmask):
    """Q4_0 and Q4_1 (whose extra plane is the min m): [d, (m)], qs words (BN, BKB, 4)."""
    *scale_refs, qs_ref = w_refs
    return ([load_masked(r, (rows, blocks), wmask) for r in scale_refs],
            _load_words(qs_ref, (rows, blocks, slice(None)), wmask))


def _x_q4_0(x_ref, m, blocks, bmask):        # x (M, nb, 2, 4, 4): values 0..15, 16..31
    return [_lanes(x_ref, (m, blocks, h, slice(None)), bmask) for h in range(2)]


def _xq_q4_0(x_refs, m, blocks, bmask):      # words (M, nb, 2, 4), d, dsum32 (M, nb)
    xw_ref, xd_ref, xs_ref = x_refs
    return ([load_masked(xw_ref, (m, blocks, h, slice(None)), bmask) for h in range(2)],
            load_masked(xd_ref, (m, blocks), bmask), load_masked(xs_ref, (m, blocks), bmask))


def _q4_sums(w, x0, x1, ip):
    """sum of q * xq over a 32-block of 4-bit quants (low nibbles values 0..15, high 16..31)."""
    lo = dp4a(w & LOW_NIBBLES, x0[None], 0, ip)
    return as_f32(jnp.sum(dp4a((w >> 4) & LOW_NIBBLES, x1[None], lo, ip), axis=-1))


def _dot_q4_0(w, xs, ip):
    [d], qs = w
    out = []
    for x in xs:
        (x0, x1), xd, xsum = _group(x, ip)
        out.append(as_f32(d) * (_q4_sums(qs, x0, x1, ip) * xd[None] - 8.0 * xsum[None]))
    return out


def _dot_q4_1(w, xs, ip):
    [d, mn], qs = w
    out = []
    for x in xs:
        (x0, x1), xd, xsum = _group(x, ip)
        out.append(as_f32(d) * _q4_sums(qs, x0, x1, ip) * xd[None] + as_f32(mn) * xsum[None])
    return out


def _w_tile_q4_k(w_refs, rows, blocks, wmask):
    d_ref, dmin_ref, sc_ref, qs_ref = w_refs    # scales as 3 words, qs words viewed (N, nb, 4, 8)
    return (load_masked(d_ref, (rows, blocks), wmask), load_masked(dmin_ref, (rows, blocks), wmask),
            [_load_words(sc_ref, (rows, blocks, i), wmask) for i in range(3)],
            _load_words(qs_ref, (rows, blocks, slice(None), slice(None)), wmask))     # (BN, BKB, 4, 8)


def _x_q4_k(x_ref, m, blocks, bmask):        # x (M, nb, 4, 2, 8, 4): chunk c, half h, word, lane
    return [[_lanes(x_ref, (m, blocks, slice(None), h, slice(None)), bmask)] for h in range(2)]


def _xq_q4_k(x_refs, m, blocks, bmask):      # words (M, nb, 4, 2, 8), d and dsum32 (M, nb, 4, 2)
    xw_ref, xd_ref, xs_ref = x_refs
    return [([load_masked(xw_ref, (m, blocks, slice(None), h, slice(None)), bmask)],
             load_masked(xd_ref, (m, blocks, slice(None), h), bmask),
             load_masked(xs_ref, (m, blocks, slice(None), h), bmask)) for h in range(2)]


def _q4_k_halves(d, dmin, scale_min, qs, xs, ip):
    """Sub-block 2c + h of a super-block is the low (h=0) or high (h=1) nibbles of its 32-byte
    chunk c; each half is handled for all four chunks at once, as (BN, BKB, 4) tensors.
    scale_min(h) gives the sub-blocks' 6-bit scales and mins, (BN, BKB, 4) each."""
    d, dmin = as_f32(d)[..., None], as_f32(dmin)[..., None]
    xs = [[_group(half, ip) for half in x] for x in xs]
    out = [0.0] * len(xs)
    for h in range(2):
        sc, mn = scale_min(h)
        dsc, dmn = d * as_f32(sc), dmin * as_f32(mn)
        q = (qs >> (4 * h)) & LOW_NIBBLES
        for i, x in enumerate(xs):
            [xw], xd, xsum = x[h]
            s = as_f32(jnp.sum(dp4a(q, xw[None], 0, ip), axis=-1))
            # Kept per chunk, (BN, BKB, 4), and summed over the chunks once, after the loop:
            # summed here, XLA's Triton spread the chunk axis over lanes and spent 32 shuffles
            # and 32 adds per step on it (SASS under ncu, H100).
            out[i] = out[i] + (dsc * s * xd[None] - dmn * xsum[None])
    return out


def _dot_q4_k(w, xs, ip):
    d, dmin, (w0, w1, w2), qs = w
    w0, w1, w2 = w0[..., None], w1[..., None], w2[..., None]
    chunk = jax.lax.broadcasted_iota(I32, (1, 1, 4), 2)

    def scale_min(h):
        # ggml's get_scale_min_k4 for sub-blocks 2c + h, c = 0..3: byte j of the 12 is byte
        # j % 4 of word j // 4; sub-blocks 0..3 take 6 bits of words 0 / 1, sub-blocks 4..7
        # a nibble of word 2 and the top 2 bits of words 0 / 1.
        sh = 8 * ((2 * chunk + h) & 3)
        return (jnp.where(chunk < 2, (w0 >> sh) & 63, ((w2 >> sh) & 0x0F) | (((w0 >> (sh + 6)) & 3) << 4)),
                jnp.where(chunk < 2, (w1 >> sh) & 63, ((w2 >> (sh + 4)) & 0x0F) | (((w1 >> (sh + 6)) & 3) << 4)))

    return _q4_k_halves(d, dmin, scale_min, qs, xs, ip)


def _w_tile_q4_k_chunks(w_refs, rows, blocks, wmask):
    """Q4_K in the Q4_KChunks layout: one scale word per quant chunk, aligned with the chunk
    axis of the quants, instead of the 12 packed bytes (measured faster: the packed bytes cost
    five loads per row and block and ~20 integer ops per 32 values to unpack)."""
    d_ref, dmin_ref, cs_ref, qs_ref = w_refs
    return (load_masked(d_ref, (rows, blocks), wmask), load_masked(dmin_ref, (rows, blocks), wmask),
            load_masked(cs_ref, (rows, blocks, slice(None)), wmask),
            _load_words(qs_ref, (rows, blocks, slice(None), slice(None)), wmask))


def _dot_q4_k_chunks(w, xs, ip):
    d, dmin, cs, qs = w
    return _q4_k_halves(d, dmin, lambda h: ((cs >> (8 * h)) & 0xFF, (cs >> (16 + 8 * h)) & 0xFF), qs, xs, ip)


# Q6_K value 128h + 32j + 16t + l: low 4 bits in ql byte 64h + 32(j%2) + 16t + l (nibble
# j//2), high 2 bits in qh byte 32h + 16t + l (bits 2j, 2j+1), scale 8h + 2j + t.
_Q6_K_STEPS = [(h, t) for h in range(2) for t in range(2)]


def _w_tile_q6_k(w_refs, rows, blocks, wmask):
    """d, per step (h, t) its qh and ql words, and the 16 scales: as 4 words (the GPU layout;
    one load each instead of one per byte, the bytes taken apart in `dot`) or as 16 bytes."""
    ql_ref, qh_ref, sc_ref, d_ref = w_refs     # ql words (N, nb, 2, 2, 2, 4), qh words (N, nb, 2, 2, 4)
    return (load_masked(d_ref, (rows, blocks), wmask),
            [(_load_words(qh_ref, (rows, blocks, h, t, slice(None)), wmask),            # (BN, BKB, 4)
              [_load_words(ql_ref, (rows, blocks, h, jm, t, slice(None)), wmask) for jm in range(2)])
             for h, t in _Q6_K_STEPS],
            [load_masked(sc_ref, (rows, blocks, i), wmask) for i in range(sc_ref.shape[-1])])


def _q6_k_scale(scales, s):
    """Scale s (int8, as int32) of a super-block from its 4 words or 16 bytes."""
    if len(scales) == 4:
        return (scales[s // 4] << (24 - 8 * (s % 4))) >> 24
    return scales[s]


def _x_q6_k(x_ref, m, blocks, bmask):        # x (M, nb, 2, 4, 2, 4, 4): h, j, t, word, lane
    return [[[_lanes(x_ref, (m, blocks, h, j, t, slice(None)), bmask) for t in range(2)] for j in range(4)]
            for h in range(2)]


def _xq_q6_k(x_refs, m, blocks, bmask):      # words (M, nb, 2, 4, 2, 4), d (M, nb, 2, 4), dsum16 (.., 2)
    xw_ref, xd_ref, xs_ref = x_refs
    return [[([load_masked(xw_ref, (m, blocks, h, j, t, slice(None)), bmask) for t in range(2)],
              load_masked(xd_ref, (m, blocks, h, j), bmask),
              [load_masked(xs_ref, (m, blocks, h, j, t), bmask) for t in range(2)]) for j in range(4)]
            for h in range(2)]


def _dot_q6_k(w, xs, ip):
    d, ws, scales = w
    out = [0.0] * len(xs)
    for i, x in enumerate(xs):
        groups = [[_group(x[h][j], ip, per_part=True) for j in range(4)] for h in range(2)]
        for k, (qh, ql) in enumerate(ws):
            h, t = _Q6_K_STEPS[k]
            for j in range(4):
                q = ((ql[j % 2] >> (4 * (j // 2))) & LOW_NIBBLES) | (((qh >> (2 * j)) & 0x03030303) << 4)
                words, xd, xsums = groups[h][j]
                s = as_f32(jnp.sum(dp4a(q, words[t][None], 0, ip), axis=-1))
                out[i] = out[i] + as_f32(_q6_k_scale(scales, 8 * h + 2 * j + t)) * (s * xd[None] - 32.0 * xsums[t][None])
    return [as_f32(d) * o for o in out]


class _Format(NamedTuple):
    block_size: int
    load_w: object
    load_x: object       # raw x, rounded in `dot`
    load_xq: object      # a QuantizedX's planes
    dot: object
    w_views: object      # (planes, n, nb) -> arrays, words or bytes (trailing 4)
    x_view: object       # (x, m, nb) -> x by block, group and lane
    xq_views: object     # (QuantizedX, m, nb) -> (words, d, dsum)
    acc_tail: tuple = ()  # trailing axes of `dot`'s (BN, BKB, ...) contributions


def _words_view(p, *shape):
    """Reshape a quant plane to `shape` in words: int32 as is, uint8 with a trailing 4."""
    if p.dtype == I32:
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


def _x_view(*group_shape):
    """x (M, K) viewed as (M, n_blocks) + group_shape + (4 lanes,): a free reshape."""
    return lambda x, m, nb: x.reshape(m, nb, *group_shape, 4)


def _xq_view(words, groups, sums="dsum32"):
    return lambda xq, m, nb: (xq.words.reshape(m, nb, *words), xq.d.reshape(m, nb, *groups),
                              getattr(xq, sums).reshape(m, nb, *groups, *((2,) if sums == "dsum16" else ())))


_Q4_0_X = dict(load_x=_x_q4_0, load_xq=_xq_q4_0, x_view=_x_view(2, 4), xq_views=_xq_view((2, 4), ()))


_Q4_K_X = dict(load_x=_x_q4_k, load_xq=_xq_q4_k, x_view=_x_view(4, 2, 8), xq_views=_xq_view((4, 2, 8), (4, 2)),
               acc_tail=(4,))


FORMATS = {
    QType.Q8_0: _Format(32, _w_tile_q8_0, _x_q8_0, _xq_q8_0, _dot_q8_0, _w_q8_0, _x_view(8), _xq_view((8,), ())),
    QType.Q4_0: _Format(32, _w_tile_q4_0, dot=_dot_q4_0, w_views=_w_q4_0, **_Q4_0_X),
    QType.Q4_1: _Format(32, _w_tile_q4_0, dot=_dot_q4_1, w_views=_w_q4_1, **_Q4_0_X),
    QType.Q4_K: _Format(256, _w_tile_q4_k, dot=_dot_q4_k, w_views=_w_q4_k, **_Q4_K_X),
    QType.Q6_K: _Format(256, _w_tile_q6_k, _x_q6_k, _xq_q6_k, _dot_q6_k, _w_q6_k, _x_view(2, 4, 2, 4),
                        _xq_view((2, 4, 2, 4), (2, 4), "dsum16")),
}


Q4_K_CHUNKS = _Format(256, _w_tile_q4_k_chunks, dot=_dot_q4_k_chunks, w_views=_w_q4_k_chunks, **_Q4_K_X)


def format_of(w: QTensor) -> _Format:
    return Q4_K_CHUNKS if isinstance(w.planes, Q4_KChunks) else FORMATS[w.qtype]
