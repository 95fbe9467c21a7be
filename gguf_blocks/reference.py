"""Pure-JAX dequantizers over the planes of `gguf_blocks.formats`: the ground truth that the
Pallas kernels are tested against.

Each follows the float32 arithmetic of `gguf.quants` (ggml's reference) operation by
operation, so results are bit-exact with `gguf.quants.dequantize`. XLA may contract
`a * b + c` into a fused multiply-add; that cannot change a result here because every
product of an f16 scale (11 significant bits) with the small integers it multiplies fits in
float32's 24 bits and is therefore exact.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from gguf_blocks.formats import IQ4_NL_VALUES, QK_K, Q4_KChunks
from gguf_blocks.words import as_bytes
from gguf_blocks.qtensor import QTensor

_F32 = jnp.float32


def _f32(x):
    return x.astype(_F32)


def _shifts(x, shifts, axis):
    """Insert an axis at `axis` (counted from the end) holding x >> s for each s in `shifts`."""
    s = jnp.asarray(shifts, dtype=x.dtype).reshape((-1,) + (1,) * (-axis - 1))
    return jnp.expand_dims(x, axis) >> s


def _nibbles(qs):
    """(.., 16) packed bytes -> (.., 32) values: low nibbles first, then high nibbles."""
    return jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits32(qh):
    """(.., 4) bytes of a little-endian u32 -> (.., 32) bits, bit j first-to-last."""
    return (_shifts(qh, range(8), -1) & 1).reshape(*qh.shape[:-1], 32)


def _k_scale_min(scales):
    """Q4_K/Q5_K (.., 12) packed 6-bit scales and mins -> two (.., 8) uint8 arrays."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = jnp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _iq4nl(idx):
    return _f32(jnp.take(jnp.asarray(IQ4_NL_VALUES, dtype=jnp.int8), idx.astype(jnp.int32)))


def _dq_q4_0(p):
    return _f32(p.d)[..., None] * _f32(_nibbles(p.qs).astype(jnp.int8) - 8)


def _dq_q4_1(p):
    return _f32(p.d)[..., None] * _f32(_nibbles(p.qs)) + _f32(p.m)[..., None]


def _q5(p):
    return _nibbles(p.qs) | (_bits32(p.qh) << 4)


def _dq_q5_0(p):
    return _f32(p.d)[..., None] * _f32(_q5(p).astype(jnp.int8) - 16)


def _dq_q5_1(p):
    return _f32(p.d)[..., None] * _f32(_q5(p)) + _f32(p.m)[..., None]


def _dq_q8_0(p):
    return _f32(p.d)[..., None] * _f32(p.qs)


def _dq_q2_k(p):
    lead = p.qs.shape[:-1]
    dl = (_f32(p.d)[..., None] * _f32(p.scales & 0x0F))[..., None]   # (.., 16, 1)
    ml = (_f32(p.dmin)[..., None] * _f32(p.scales >> 4))[..., None]
    q = _shifts(p.qs.reshape(*lead, 2, 32), (0, 2, 4, 6), -2) & 3    # (.., 2, 4, 32)
    return (dl * _f32(q.reshape(*lead, 16, 16)) - ml).reshape(*lead, QK_K)


def _dq_q3_k(p):
    lead = p.qs.shape[:-1]
    lo = (_shifts(p.scales[..., :8], (0, 4), -2) & 0x0F).reshape(*lead, 16)
    hi = (_shifts(p.scales[..., 8:], (0, 2, 4, 6), -2) & 0x03).reshape(*lead, 16)
    sc = _f32((lo | (hi << 4)).astype(jnp.int8) - 32)
    dl = (_f32(p.d)[..., None] * sc)[..., None]                       # (.., 16, 1)
    ql = _shifts(p.qs.reshape(*lead, 2, 32), (0, 2, 4, 6), -2) & 3   # (.., 2, 4, 32)
    qh = (_shifts(p.hmask, range(8), -2) & 1) ^ 1                     # (.., 8, 32): 1 = subtract 4
    q = ql.reshape(*lead, 16, 16).astype(jnp.int8) - (qh.reshape(*lead, 16, 16) << 2).astype(jnp.int8)
    return (dl * _f32(q)).reshape(*lead, QK_K)


def _k_low4(qs):
    """(.., 128) K-quant nibbles -> (.., 8, 32): per 32 bytes, low nibbles then high nibbles."""
    return (_shifts(qs.reshape(*qs.shape[:-1], 4, 32), (0, 4), -2) & 0x0F).reshape(*qs.shape[:-1], 8, 32)


def _q4_k_chunk_scale_min(chunk_scales):
    """Q4_KChunks' (.., 4) int32 chunk words -> the (.., 8) scales and mins of sub-blocks 0..7."""
    b = jax.lax.bitcast_convert_type(chunk_scales, jnp.uint8)          # (.., 4 chunks, 4 bytes)
    return b[..., :2].reshape(*b.shape[:-2], 8), b[..., 2:].reshape(*b.shape[:-2], 8)


def _dq_q4_k(p):
    lead = p.qs.shape[:-1]
    sc, mn = _q4_k_chunk_scale_min(p.chunk_scales) if hasattr(p, "chunk_scales") else _k_scale_min(p.scales)
    d = (_f32(p.d)[..., None] * _f32(sc))[..., None]                  # (.., 8, 1)
    dm = (_f32(p.dmin)[..., None] * _f32(mn))[..., None]
    return (d * _f32(_k_low4(p.qs)) - dm).reshape(*lead, QK_K)


def _dq_q5_k(p):
    lead = p.qs.shape[:-1]
    sc, mn = _k_scale_min(p.scales)
    d = (_f32(p.d)[..., None] * _f32(sc))[..., None]
    dm = (_f32(p.dmin)[..., None] * _f32(mn))[..., None]
    qh = _shifts(p.qh, range(8), -2) & 1                              # (.., 8, 32)
    return (d * _f32(_k_low4(p.qs) | (qh << 4)) - dm).reshape(*lead, QK_K)


def _dq_q6_k(p):
    lead = p.ql.shape[:-1]
    d = (_f32(p.d)[..., None] * _f32(p.scales))[..., None]            # (.., 16, 1)
    ql = (_shifts(p.ql.reshape(*lead, 2, 64), (0, 4), -2) & 0x0F).reshape(*lead, 8, 32)
    qh = (_shifts(p.qh.reshape(*lead, 2, 32), (0, 2, 4, 6), -2) & 0x03).reshape(*lead, 8, 32)
    q = (ql | (qh << 4)).astype(jnp.int8) - 32
    return (d * _f32(q.reshape(*lead, 16, 16))).reshape(*lead, QK_K)


def _dq_iq4_nl(p):
    return _f32(p.d)[..., None] * _iq4nl(_nibbles(p.qs))


def _dq_iq4_xs(p):
    lead = p.qs.shape[:-1]
    lo = (_shifts(p.scales_l, (0, 4), -1) & 0x0F).reshape(*lead, 8)
    hi = (_shifts(p.scales_h, range(0, 16, 2), -1) & 0x03).astype(jnp.uint8)
    sc = _f32((lo | (hi << 4)).astype(jnp.int8) - 32)
    dl = (_f32(p.d)[..., None] * sc)[..., None]                       # (.., 8, 1)
    idx = (_shifts(p.qs.reshape(*lead, 8, 16), (0, 4), -2) & 0x0F).reshape(*lead, 8, 32)
    return (dl * _iq4nl(idx)).reshape(*lead, QK_K)


DEQUANTIZERS = {
    QType.Q4_0: _dq_q4_0, QType.Q4_1: _dq_q4_1, QType.Q5_0: _dq_q5_0, QType.Q5_1: _dq_q5_1,
    QType.Q8_0: _dq_q8_0, QType.Q2_K: _dq_q2_k, QType.Q3_K: _dq_q3_k, QType.Q4_K: _dq_q4_k,
    QType.Q5_K: _dq_q5_k, QType.Q6_K: _dq_q6_k, QType.IQ4_NL: _dq_iq4_nl, QType.IQ4_XS: _dq_iq4_xs,
}


def q4_k_chunks(w: QTensor) -> QTensor:
    """A Q4_K weight in the `formats.Q4_KChunks` layout (scales re-encoded per quant chunk),
    on the device its planes are on; the same values. Anything else is returned as is."""
    if not isinstance(w, QTensor) or w.qtype != QType.Q4_K or isinstance(w.planes, Q4_KChunks):
        return w
    p = w.planes
    sc, mn = _k_scale_min(as_bytes(w.qtype, p).scales)                  # (rows, nb, 8) each
    b = jnp.stack([sc[..., 0::2], sc[..., 1::2], mn[..., 0::2], mn[..., 1::2]], axis=-1)
    words = jax.lax.bitcast_convert_type(b.astype(jnp.uint8), jnp.int32)   # (rows, nb, 4)
    return QTensor(Q4_KChunks(p.d, p.dmin, words, p.qs), w.qtype, w.shape)


def dequantize_blocks(qtype: QType, planes) -> jax.Array:
    """Planes with leading dims (..., n_blocks) -> float32 (..., n_blocks, block_size)."""
    out = DEQUANTIZERS[qtype](as_bytes(qtype, jax.tree.map(jnp.asarray, planes)))
    assert out.shape[-1] == GGML_QUANT_SIZES[qtype][0], (qtype, out.shape)
    return out


def take_rows(w: QTensor, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Rows `ids` (any shape) of a QTensor, dequantized -> ids.shape + (in_features,): an
    embedding lookup that dequantizes only the rows it takes."""
    flat = ids.reshape(-1)
    rows = jax.tree.map(lambda p: jnp.take(p, flat, axis=0), w.planes)
    sub = QTensor(rows, w.qtype, (int(flat.shape[0]), w.shape[1]))
    return dequantize(sub).astype(dtype).reshape(*ids.shape, w.shape[1])


def dequantize(w) -> jax.Array:
    """A QTensor, or a dense F32/F16/BF16 array -> float32 array of its logical shape."""
    if isinstance(w, QTensor):
        return dequantize_blocks(w.qtype, w.planes).reshape(w.shape)
    w = jnp.asarray(w)
    if w.dtype == jnp.bfloat16:  # by bits, as gguf does, so NaN payloads survive too
        bits = jax.lax.bitcast_convert_type(w, jnp.uint16).astype(jnp.uint32) << 16
        return jax.lax.bitcast_convert_type(bits, _F32)
    return w.astype(_F32)
