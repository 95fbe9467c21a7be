"""In-kernel dequantization of a tile of GGUF blocks, read straight from the planes.

A kernel step covers `BN` weight rows and `BKB` consecutive blocks of each row. Every type
splits its block into `segments` contiguous runs ("segments") of `seg_len` values, chosen so
that each run decodes from the planes without moving data across registers (Q4_0's low
nibbles are values 0..15, its high nibbles values 16..31; Q4_K's 32-byte quant chunks give
two 32-value runs each). A run comes back as a `Part`:

    values = q * scale[..., None] + bias[..., None]        q: (BN, BKB, sub, seg_len // sub)

where `q` holds the run's integer quants as float32 and `scale`/`bias` one factor per
`seg_len // sub` values (Q6_K has a scale per 16 values, so its 32-value runs have sub=2).
The kernel multiplies each run by the matching slice of x, viewed outside the kernel as
(M, n_blocks, segments, sub, seg_len // sub): a free reshape, so x is read in its own order
and nothing is permuted in memory.

Plane `views` are free reshapes too (contiguous arrays), picked so that every load is a
plain slice: all tile dimensions are powers of two, as Triton requires.

Q4_K in the GPU layout, Q4_0 and Q4_1 also have a `tile` for bf16x2 dequantization (see
below): whole blocks straight to bf16 with packed PTX instructions, for the tensor-core path.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType as QType
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gguf_blocks.formats import Q4_KChunks
from gguf_blocks.qtensor import QTensor

_F32 = jnp.float32
# float32 bits of 2**23: OR-ing an integer 0 <= v < 2**23 into the mantissa gives exactly
# 2**23 + v. One logic op and one add per value instead of an int->float conversion, which
# runs at a quarter of the FP32 rate on Hopper and would bound the decode GEMV.
_MAGIC_BITS = 0x4B000000
_MAGIC = 8388608.0


def int_to_f32(v: jax.Array, zero: int = 0) -> jax.Array:
    """float32(v - zero) for integer v with 0 <= v < 2**23, exact."""
    bits = v.astype(jnp.int32) | _MAGIC_BITS
    return jax.lax.bitcast_convert_type(bits, _F32) - (_MAGIC + zero)


class Part(NamedTuple):
    seg: int                 # which run of the block: values seg*seg_len ... (seg+1)*seg_len - 1
    q: jax.Array             # (BN, BKB, sub, seg_len // sub) float32, integer-valued
    scale: jax.Array         # (BN, BKB, sub) float32
    bias: jax.Array | None   # (BN, BKB, sub) float32, or None


class TileFormat(NamedTuple):
    block_size: int
    segments: int
    seg_len: int
    sub: int
    views: Callable      # planes -> tuple of arrays (free reshapes), in kernel-argument order
    parts: Callable      # (refs, rows, blocks, mask (BN, BKB)) -> list[Part]; runs in the kernel
    # Or, for "bf16x2" dequantization: (refs, rows, blocks, mask, interpret) -> the tile's
    # values in bf16 as `sub` tiles (BN, BKB, [segments,] seg_len // sub), tile h the values of
    # x viewed (M, n_blocks, segments, sub, seg_len // sub)[:, :, :, h].
    tile: Callable | None = None


def index(i):
    """A static index as a scalar array: Pallas' interpreter cannot discharge plain ints."""
    return jnp.int32(i) if isinstance(i, int) else i


def load_masked(ref, idx, mask):
    """Masked load of ref[idx]; `mask` has the leading dims of the result, broadcast over the rest."""
    view = ref.at[tuple(index(i) for i in idx)]
    extra = len(view.shape) - mask.ndim
    m = mask.reshape(mask.shape + (1,) * extra) if extra else mask
    return plgpu.load(view, mask=m, other=0)


def join_lanes(lanes: list[jax.Array]) -> jax.Array:
    """Four lanes (..., W), lane i holding byte i of each of W words -> (..., 4W) in byte order
    (byte 4j + i is lanes[i][..., j]). Built from two-way joins, the one way Triton interleaves
    tensors: byte 2k + l of a word comes from join(join(b0, b2), join(b1, b3))[..., k, l]."""
    b = lanes
    pairs = jnp.stack([jnp.stack([b[0], b[2]], axis=-1), jnp.stack([b[1], b[3]], axis=-1)], axis=-1)
    return pairs.reshape(*b[0].shape[:-1], 4 * b[0].shape[-1])


def bytes_of_words(w: jax.Array) -> jax.Array:
    """int32 words (..., W) -> their bytes, little-endian, as int32 0..255 (..., 4W)."""
    return join_lanes([(w >> (8 * i)) & 0xFF for i in range(4)])


def load_bytes(ref, idx, mask):
    """The bytes of a quant plane at idx (the last index a whole-row slice), as int32 0..255:
    a byte plane as stored, a word plane (gguf_blocks.words) expanded in registers."""
    v = load_masked(ref, idx, mask)
    return bytes_of_words(v) if ref.dtype == jnp.int32 else v.astype(jnp.int32) & 0xFF


def load_byte(ref, idx, i, mask):
    """Byte i of the last axis of a byte or word plane, as int32 0..255."""
    if ref.dtype == jnp.int32:
        return (load_masked(ref, tuple(idx) + (i // 4,), mask) >> (8 * (i % 4))) & 0xFF
    return load_masked(ref, tuple(idx) + (i,), mask).astype(jnp.int32) & 0xFF


def bytes_view(p, *shape):
    """A quant plane reshaped to `shape`, whose last axis counts bytes (words: a quarter)."""
    return p.reshape(*shape[:-1], shape[-1] // 4) if p.dtype == jnp.int32 else p.reshape(shape)


def _f(v):
    return v.astype(_F32)


def _run(v):
    """(BN, BKB, L) -> (BN, BKB, 1, L): a run with one scale."""
    return v.reshape(v.shape[:2] + (1,) + v.shape[2:])


def _col(v):
    """(BN, BKB) -> (BN, BKB, 1): one factor per run."""
    return v.reshape(v.shape + (1,))


# --- 32-value block types ------------------------------------------------------------------

def _q8_0_parts(refs, rows, blocks, mask):
    d_ref, qs_ref = refs
    d = _f(load_masked(d_ref, (rows, blocks), mask))
    qs = load_bytes(qs_ref, (rows, blocks, slice(None)), mask)            # (BN, BKB, 32), int8 bits
    q = int_to_f32(qs ^ 0x80, zero=128)
    return [Part(0, _run(q), _col(d), None)]


def _nibble_parts(qs, scale, bias, zero):
    lo = int_to_f32(qs & 0x0F, zero)
    hi = int_to_f32(qs >> 4, zero)
    return [Part(0, _run(lo), scale, bias), Part(1, _run(hi), scale, bias)]


def _q4_0_parts(refs, rows, blocks, mask):
    d_ref, qs_ref = refs
    d = _f(load_masked(d_ref, (rows, blocks), mask))
    qs = load_bytes(qs_ref, (rows, blocks, slice(None)), mask)            # (BN, BKB, 16)
    return _nibble_parts(qs, _col(d), None, zero=8)


def _q4_1_parts(refs, rows, blocks, mask):
    d_ref, m_ref, qs_ref = refs
    d = _f(load_masked(d_ref, (rows, blocks), mask))
    m = _f(load_masked(m_ref, (rows, blocks), mask))
    qs = load_bytes(qs_ref, (rows, blocks, slice(None)), mask)
    return _nibble_parts(qs, _col(d), _col(m), zero=0)


def _q5_0_parts(refs, rows, blocks, mask):
    d_ref, qh_ref, qs_ref = refs
    d = _f(load_masked(d_ref, (rows, blocks), mask))
    qs = load_masked(qs_ref, (rows, blocks, slice(None)), mask)
    qh = [load_masked(qh_ref, (rows, blocks, i), mask).astype(jnp.int32) for i in range(4)]
    shifts = jax.lax.broadcasted_iota(jnp.int32, (1, 1, 16), 2)
    parts = []
    for seg, (nib, h16) in enumerate(((qs & 0x0F, qh[0] | (qh[1] << 8)),
                                       (qs >> 4, qh[2] | (qh[3] << 8)))):
        hbit = (h16.reshape(h16.shape + (1,)) >> shifts) & 1         # bit j -> value j of the run
        q = int_to_f32(nib.astype(jnp.int32) | (hbit << 4), zero=16)
        parts.append(Part(seg, _run(q), _col(d), None))
    return parts


# --- 256-value super-block types ------------------------------------------------------------

def _q4_k_parts(refs, rows, blocks, mask):
    d_ref, dmin_ref, sc_ref, qs_ref = refs                          # qs viewed (N, nb, 4, 32)
    d = _f(load_masked(d_ref, (rows, blocks), mask))
    dmin = _f(load_masked(dmin_ref, (rows, blocks), mask))
    b = [load_byte(sc_ref, (rows, blocks), i, mask) for i in range(12)]

    def scale_min(s):   # ggml's get_scale_min_k4
        if s < 4:
            return b[s] & 63, b[s + 4] & 63
        return (b[s + 4] & 0x0F) | ((b[s - 4] >> 2) & 0x30), (b[s + 4] >> 4) | ((b[s] >> 2) & 0x30)

    parts = []
    for c in range(4):  # 32 quant bytes: low nibbles are run 2c, high nibbles run 2c + 1
        qs = load_bytes(qs_ref, (rows, blocks, c, slice(None)), mask)     # (BN, BKB, 32)
        for h, nib in enumerate((qs & 0x0F, qs >> 4)):
            sc, mn = scale_min(2 * c + h)
            parts.append(Part(2 * c + h, _run(int_to_f32(nib)),
                              _col(d * _f(sc)), _col(-(dmin * _f(mn)))))
    return parts


def _q4_k_chunks_parts(refs, rows, blocks, mask):
    """Q4_K in the Q4_KChunks layout: chunk c's scale word holds both of its runs' scales."""
    d_ref, dmin_ref, cs_ref, qs_ref = refs                          # qs viewed (N, nb, 4, 32)
    d = _f(load_masked(d_ref, (rows, blocks), mask))
    dmin = _f(load_masked(dmin_ref, (rows, blocks), mask))
    parts = []
    for c in range(4):
        cw = load_masked(cs_ref, (rows, blocks, c), mask)                  # (BN, BKB) int32
        qs = load_bytes(qs_ref, (rows, blocks, c, slice(None)), mask)     # (BN, BKB, 32)
        for h, nib in enumerate((qs & 0x0F, qs >> 4)):
            sc, mn = (cw >> (8 * h)) & 0xFF, (cw >> (16 + 8 * h)) & 0xFF
            parts.append(Part(2 * c + h, _run(int_to_f32(nib)),
                              _col(d * _f(sc)), _col(-(dmin * _f(mn)))))
    return parts


def _q6_k_parts(refs, rows, blocks, mask):
    ql_ref, qh_ref, sc_ref, d_ref = refs        # ql (N, nb, 8, 16), qh (N, nb, 4, 16)
    d = _f(load_masked(d_ref, (rows, blocks), mask))
    ql_cache, qh_cache = {}, {}
    parts = []
    # Value 128h + 32j + 16t + l: low 4 bits in ql byte 64h + 32(j%2) + 16t + l (nibble j//2),
    # high 2 bits in qh byte 32h + 16t + l (bits 2j, 2j+1), scale 8h + 2j + t.
    for h in range(2):
        for j in range(4):
            key = (h, j % 2)
            if key not in ql_cache:
                ql_cache[key] = load_bytes(ql_ref, (rows, blocks, pl.ds(4 * h + 2 * (j % 2), 2), slice(None)), mask)
            if h not in qh_cache:
                qh_cache[h] = load_bytes(qh_ref, (rows, blocks, pl.ds(2 * h, 2), slice(None)), mask)
            low = (ql_cache[key] >> (4 * (j // 2))) & 0x0F
            high = (qh_cache[h] >> (2 * j)) & 0x03
            q = int_to_f32(low | (high << 4), zero=32)
            if sc_ref.dtype == jnp.int32:  # scales 8h + 2j and the next: bytes 2(j % 2) and on of word 2h + j // 2
                word = load_masked(sc_ref, (rows, blocks, 2 * h + j // 2), mask)
                shift = 24 - 16 * (j % 2)
                sc = _f(jnp.stack([(word << shift) >> 24, (word << (shift - 8)) >> 24], axis=-1))
            else:
                sc = _f(load_masked(sc_ref, (rows, blocks, pl.ds(8 * h + 2 * j, 2)), mask))   # (BN, BKB, 2)
            parts.append(Part(4 * h + j, q, sc * _col(d), None))
    return parts


# --- bf16x2 dequantization ------------------------------------------------------------------
# The float path turns every quant into float32 and rounds the scaled value to bf16, about six
# instructions per weight; at M > 4 the tensor-core kernel is bound by them (notes). Here two
# nibbles at a time become bf16 values with packed instructions: a nibble OR-ed into the
# mantissa of 128.0 (bf16 0x4300, one lop3) is exactly 128 + q, one bf16x2 fma takes the 128
# off (exact) and one applies scale and bias (a single rounding). Scale and bias are rounded
# to bf16 first, so a weight is off by up to about two bf16 roundings, not one.
_BF16_128 = 0x4300          # bf16 bits of 128.0


def _nibbles_bf16x2_asm(shift: int) -> str:
    """PTX for four quant bytes ($2) -> bf16(nibble * s + b) for the nibbles at `shift` (0 or
    4), as two bf16 pairs ($0, $1); s and b come as bf16 pairs ($3, $4 and $5, $6), one value
    per quant: Triton's layout may put the four values of one call in different rows."""
    return f"""{{
.reg .b32 z, one, m128, t0, t1, h;
mov.b32 z, 0;
mov.b32 one, 0x3F803F80;
mov.b32 m128, 0xC300C300;
shr.u32 h, $2, {shift};
prmt.b32 t0, h, z, 0x4140;
prmt.b32 t1, h, z, 0x4342;
lop3.b32 t0, t0, 0x000F000F, 0x{_BF16_128:04X}{_BF16_128:04X}, 0xEA;
lop3.b32 t1, t1, 0x000F000F, 0x{_BF16_128:04X}{_BF16_128:04X}, 0xEA;
fma.rn.bf16x2 t0, t0, one, m128;
fma.rn.bf16x2 t1, t1, one, m128;
fma.rn.bf16x2 $0, t0, $3, $5;
fma.rn.bf16x2 $1, t1, $4, $6;
}}"""


def nibbles_bf16(q: jax.Array, s_lo, b_lo, s_hi, b_hi, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """Quant bytes q (..., L) uint8 -> (lo * s_lo + b_lo, hi * s_hi + b_hi) in bf16, each (..., L),
    lo and hi the low and high nibbles, s and b bf16 of shapes that broadcast to q's (one
    rounding, after the exact product and sum). On the GPU: packed bf16x2 PTX; in the
    interpreter the same arithmetic in jnp."""
    s_lo, b_lo, s_hi, b_hi = (jnp.broadcast_to(v, q.shape) for v in (s_lo, b_lo, s_hi, b_hi))
    if interpret:
        def value(nib, s, b):
            return (nib.astype(_F32) * s.astype(_F32) + b.astype(_F32)).astype(jnp.bfloat16)
        qi = q.astype(jnp.int32)
        return value(qi & 0x0F, s_lo, b_lo), value(qi >> 4, s_hi, b_hi)
    return tuple(plgpu.elementwise_inline_asm(
        _nibbles_bf16x2_asm(4 * h), args=[q, s, b], constraints="=r,=r,r,r,r,r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(q.shape, jnp.bfloat16)])[0]
        for h, (s, b) in enumerate(((s_lo, b_lo), (s_hi, b_hi))))


def _q4_k_chunks_bf16_tile(refs, rows, blocks, mask, interpret):
    """Q4_K (Q4_KChunks) super-blocks as two (BN, BKB, 4, 32) bf16 tiles: value 64c + 32h + j
    of a block at [..., c, j] of tile h (chunk c's low nibbles, h = 0, and high ones)."""
    d_ref, dmin_ref, cs_ref, qs_ref = refs                     # qs as bytes (N, nb, 4, 32)
    d = _f(load_masked(d_ref, (rows, blocks), mask))[..., None]
    neg_dmin = -_f(load_masked(dmin_ref, (rows, blocks), mask))[..., None]
    cw = load_masked(cs_ref, (rows, blocks, slice(None)), mask)                  # (BN, BKB, 4) int32
    qs = load_masked(qs_ref, (rows, blocks, slice(None), slice(None)), mask)     # (BN, BKB, 4, 32) uint8

    # Scales and biases rounded to bf16 per chunk, before they are broadcast over its values.
    s_lo, s_hi = ((d * int_to_f32((cw >> (8 * h)) & 0xFF)).astype(jnp.bfloat16)[..., None] for h in range(2))
    b_lo, b_hi = ((neg_dmin * int_to_f32((cw >> (16 + 8 * h)) & 0xFF)).astype(jnp.bfloat16)[..., None] for h in range(2))
    return nibbles_bf16(qs, s_lo, b_lo, s_hi, b_hi, interpret)


def _q4_0_1_bf16_tile(refs, rows, blocks, mask, interpret):
    """Q4_0 / Q4_1 blocks as two (BN, BKB, 16) bf16 tiles: the low nibbles (values 0..15) and
    the high ones (16..31). Q4_0's value (q - 8) d is q * d + (-8 d), exact in bf16 as d is."""
    d = _f(load_masked(refs[0], (rows, blocks), mask))
    bias = _f(load_masked(refs[1], (rows, blocks), mask)) if len(refs) == 3 else -8.0 * d
    qs = load_masked(refs[-1], (rows, blocks, slice(None)), mask)                # (BN, BKB, 16) uint8
    s, b = (v.astype(jnp.bfloat16)[..., None] for v in (d, bias))
    return nibbles_bf16(qs, s, b, s, b, interpret)


def _bytes_of(p):
    """A quant plane as bytes: word planes (gguf_blocks.words) viewed back, free in XLA."""
    return p if p.dtype != jnp.int32 else jax.lax.bitcast_convert_type(p, jnp.uint8).reshape(*p.shape[:-1], -1)


def _q4_0_1_bf16_views(p):
    return (*p[:-1], _bytes_of(p.qs))


def _q4_k_chunks_bf16_views(p):
    n, nb = p.d.shape
    return p.d, p.dmin, p.chunk_scales, _bytes_of(p.qs).reshape(n, nb, 4, 32)


def _same(p):
    return tuple(p)


def _q4_k_views(p):
    n, nb = p.d.shape
    return p.d, p.dmin, p.scales, bytes_view(p.qs, n, nb, 4, 32)


def _q4_k_chunks_views(p):
    n, nb = p.d.shape
    return p.d, p.dmin, p.chunk_scales, bytes_view(p.qs, n, nb, 4, 32)


def _q6_k_views(p):
    n, nb = p.d.shape
    return bytes_view(p.ql, n, nb, 8, 16), bytes_view(p.qh, n, nb, 4, 16), p.scales, p.d


FORMATS: dict[QType, TileFormat] = {
    QType.Q8_0: TileFormat(32, 1, 32, 1, _same, _q8_0_parts),
    QType.Q4_0: TileFormat(32, 2, 16, 1, _same, _q4_0_parts),
    QType.Q4_1: TileFormat(32, 2, 16, 1, _same, _q4_1_parts),
    QType.Q5_0: TileFormat(32, 2, 16, 1, _same, _q5_0_parts),
    QType.Q4_K: TileFormat(256, 8, 32, 1, _q4_k_views, _q4_k_parts),
    QType.Q6_K: TileFormat(256, 8, 32, 2, _q6_k_views, _q6_k_parts),
}
Q4_K_CHUNKS = TileFormat(256, 8, 32, 1, _q4_k_chunks_views, _q4_k_chunks_parts)
Q4_K_CHUNKS_BF16X2 = TileFormat(256, 4, 64, 2, _q4_k_chunks_bf16_views, None, tile=_q4_k_chunks_bf16_tile)
BF16X2 = {QType.Q4_0: TileFormat(32, 1, 32, 2, _q4_0_1_bf16_views, None, tile=_q4_0_1_bf16_tile),
          QType.Q4_1: TileFormat(32, 1, 32, 2, _q4_0_1_bf16_views, None, tile=_q4_0_1_bf16_tile)}


def supports_bf16x2(w: QTensor) -> bool:
    """Whether w's layout has a bf16x2-dequantized tile (Q4_K in the GPU layout, Q4_0, Q4_1)."""
    return isinstance(w.planes, Q4_KChunks) or w.qtype in BF16X2


def format_of(w: QTensor, dequant: str = "f32") -> TileFormat:
    """The tile format for w's type and plane layout (Q4_K comes in two, see formats.Q4_KChunks)
    and dequantization ("f32", or "bf16x2" where `supports_bf16x2`)."""
    if dequant == "bf16x2":
        if not supports_bf16x2(w):
            raise NotImplementedError(f"bf16x2 dequantization: no tile for {w.qtype.name} in "
                                      f"{type(w.planes).__name__} planes (have Q4_K in the GPU layout, Q4_0, Q4_1)")
        return Q4_K_CHUNKS_BF16X2 if isinstance(w.planes, Q4_KChunks) else BF16X2[w.qtype]
    return Q4_K_CHUNKS if isinstance(w.planes, Q4_KChunks) else FORMATS[w.qtype]


def split_k_launch(n_blocks: int, block_k: int, split_k: int, m: int, n: int, out_dtype, partials: bool):
    """(blocks per split, output shape) of a decode kernel splitting K `split_k` ways: the
    (m, n) result in `out_dtype`, or its (split_k, m, n) float32 partial sums where there is
    more than one split or the caller wants them (`partials`)."""
    blocks_per_split = pl.cdiv(pl.cdiv(n_blocks, split_k), block_k) * block_k
    if split_k == 1 and not partials:
        return blocks_per_split, jax.ShapeDtypeStruct((m, n), out_dtype)
    return blocks_per_split, jax.ShapeDtypeStruct((split_k, m, n), jnp.float32)
