"""Skinny GEMM for Q4_K, Q8_0, Q6_K, Q4_0, Q4_1 and Q5_0 on Hopper's wgmma, through Pallas's
Mosaic GPU lowering: x (M = 1..64 rows, bf16) @ dequantize(w).T for a weight in the GPU layout
(Q4_K as Q4_KChunks; quants as words or bytes). Batched decode and short prefill chunks; one
row stays on the int8 GEMV (int8_gemv.py) or the float kernel, but for Q6_K below LM-head sizes
and Q5_0 (`gemv.WGMMA_MIN_M`).

The Triton kernel's tensor-core path (kernel.py) dequantizes a tile into registers in Triton's
layout, then moves it through shared memory into the MMA's operand layout, and Triton's
elementwise model repacks bytes around the inline PTX: about 5.6 instructions per weight, and
M=16 took twice the M=1 time (docs/kernels.md). Here:

- The weight is the wgmma's A operand, taken from registers: each thread loads the quant words
  that its own A fragment needs (the WGMMA layout: rows r and r + 8, column pairs 2j, 2j + 1
  of every 8), so no value moves between threads or through shared memory. The order of K
  within a 64-value chunk is chosen to match (`chunk_order`), and x is permuted the same way.
- Per register (two weights), Q4_K: prmt, lop3 (nibble | bf16 128.0 gives exactly 128 + q),
  sub (exact q), fma with the sub-block's bf16 scale and bias: about 2.1 instructions per
  weight. Q8_0: a signed byte v does not fit that trick (128 + v needs 9 bits of mantissa),
  so prmt, then two lop3 make bf16 128 + (v & 0x7f) and 128 + (v & 0x80) (128 or 256), whose
  difference is v exactly; mul by the block's bf16 scale: about 2.6 instructions per weight.
  Q6_K: prmt the low-nibble and the high-bit bytes, two lop3 merge them into bf16 128 + q,
  sub 160 gives q - 32, mul by d * the 16-value sub-block's scale: six instructions per two
  weights, plus shifts and the scale picks (each thread picks the sub-block's scale by its
  place in the quad, `_q6_k_scale`, once per 32-value group and row).
  Q4_K, Q8_0 and Q6_K put a 64-value chunk in the same K order (`chunk_order`), so x is
  permuted alike. The 32-value block types (Q4_0, Q4_1, Q5_0) have their own (`blocks32_order`):
  a thread's two words of a chunk lie in one block, chosen by its place in its quad, so each
  thread picks that block's scale (`_quad_pick_f16`, once per chunk and row) and the per-register
  PTX is prmt, lop3 (nibble | bf16 128), sub (136, 128 or 144), then mul by d (Q4_0, Q5_0) or
  fma with d and m (Q4_1): two instructions per weight. Q5_0 first ORs the fifth bit into bit 4
  (bfe, a multiply that puts two bits at bits 4 and 20, lop3: three more per two weights).
- x is B, (M, 256) per super-block in shared memory, read transposed; the output tile is
  (64 weight rows, M), so results come transposed: (splits, N, M) float32 partial sums.
- Quants and x stream through shared memory on the TMA engine (`stages` super-blocks in flight,
  `plgpu.emit_pipeline`); the scales (20 bytes per row and super-block, too narrow for TMA)
  are loaded into registers one super-block ahead; so are Q6_K's sixteen int8 ones (as four
  words) and d. The 32-value block types' per-block planes (Q8_0's and Q4_0's d, Q4_1's d and
  m, Q5_0's d and high-bit words) are loaded one super-block ahead as (64, 8) tiles in the
  WGMMA layout, where each thread holds two of its rows' eight values, and the dequantizer
  takes the others from the thread's quad by shuffles (`_quad_word`). Loading each value
  per row instead (eight or sixteen loads per super-block) was the bottleneck (docs/kernels.md,
  "The wgmma skinny GEMM").

Numerics: as the Triton kernel's bf16x2 path: scale and bias rounded to bf16, then one rounding
of q * s + b (Q8_0 and Q6_K: of v * s); float32 accumulation.

Mosaic GPU, not Triton: Triton cannot hand registers to the MMA in a layout of our choosing.
The kernel does not run in Mosaic GPU's interpreter (inline Mosaic code and wgmma operands from
registers), so on the CPU `reference_arithmetic` checks the same arithmetic and order, and the
H100 tests run the kernel (tests/kernels/test_quant_matmul.py).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as QType
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gguf_blocks.formats import Q4_KChunks
from gguf_blocks.qtensor import QTensor
from pallas_kernels.quant_matmul.wgmma_dequant import (ROWS, WG_ROWS, blocks32_dequant, blocks32_order, chunk_order,
                                                       dequant_q4_k, dequant_q6_k, dequant_q8_0)

MAX_M = 64
PROGRAMS = 256                               # split K until about this many programs


@dataclasses.dataclass(frozen=True)
class WgmmaConfig:
    blocks_per_split: int = 8     # Q4_K super-blocks (256 values) per program
    stages: int = 2               # super-blocks in flight through shared memory


@dataclasses.dataclass(frozen=True)
class _Format:
    """What the kernel needs to know of a weight type: the int32 words per super-block (256
    values) and row of each quant plane it streams through shared memory, the number of
    scale planes it reads from global memory (`_operands`), and how one super-block's scales
    and quant words become the A tile."""
    words: tuple[int, ...]
    n_scale_planes: int

    def order(self) -> np.ndarray:
        return chunk_order()

    def load_scales(self, refs, rows, sb):
        raise NotImplementedError

    def dequantize(self, words, scales):
        raise NotImplementedError


class _Q4_K(_Format):
    def load_scales(self, refs, rows, sb):
        d_ref, dmin_ref, cs_ref = refs
        return (_row_vec(d_ref.at[rows, sb]), _row_vec(dmin_ref.at[rows, sb]),
                tuple(_row_vec(cs_ref.at[rows, sb, c]) for c in range(4)))

    def dequantize(self, words, loaded):
        (words,) = words
        d, dmin, cs_all = loaded
        d, dmin = d.astype(jnp.float32), dmin.astype(jnp.float32)
        scales, biases = [], []
        for cs in cs_all:
            for h in range(2):
                scales.append(d * ((cs >> (8 * h)) & 0xFF).astype(jnp.float32))
                biases.append(-dmin * ((cs >> (16 + 8 * h)) & 0xFF).astype(jnp.float32))
        return dequant_q4_k(words, tuple(scales), tuple(biases))


def _block_tile(ref, rows, sb):
    """A per-block plane's (64, 8) tile of one super-block, in the WGMMA layout: two values per
    thread and row, shared in the quad by the dequantizer."""
    return plgpu.load(ref.at[rows, pl.ds(8 * sb, 8)], layout=plgpu.Layout.WGMMA, optimized=False)


class _Q8_0(_Format):
    def load_scales(self, refs, rows, sb):
        (d_ref,) = refs
        return _block_tile(d_ref, rows, sb)

    def dequantize(self, words, loaded):
        (words,) = words
        return dequant_q8_0(words, loaded)


class _Q6_K(_Format):
    def load_scales(self, refs, rows, sb):
        scales_ref, d_ref = refs
        return tuple(_row_vec(scales_ref.at[rows, 4 * sb + i]) for i in range(4)), _row_vec(d_ref.at[rows, sb])

    def dequantize(self, words, loaded):
        ql, qh = words
        scale_words, d = loaded
        return dequant_q6_k(ql, qh, scale_words, d.astype(jnp.float32))


class _Blocks32(_Format):
    """Q4_0 (d), Q4_1 (d, m) and Q5_0 (d, high-bit word): eight 32-value blocks per super-step,
    their per-block planes read from global memory one super-step ahead."""
    def __init__(self, kind: QType):
        super().__init__(words=(32,), n_scale_planes=1 if kind == QType.Q4_0 else 2)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "_dequant", blocks32_dequant(kind))

    def order(self) -> np.ndarray:
        return blocks32_order()

    def load_scales(self, refs, rows, sb):
        return tuple(_block_tile(ref, rows, sb) for ref in refs)

    def dequantize(self, words, loaded):
        (words,) = words
        return self._dequant(words, *loaded)


_FORMATS = {QType.Q4_K: _Q4_K(words=(32,), n_scale_planes=3), QType.Q8_0: _Q8_0(words=(64,), n_scale_planes=1),
            QType.Q6_K: _Q6_K(words=(32, 16), n_scale_planes=2),
            **{t: _Blocks32(t) for t in (QType.Q4_0, QType.Q4_1, QType.Q5_0)}}


def _row_vec(ref):
    return plgpu.load(ref, layout=WG_ROWS, optimized=False)


def _kernel(x_ref, *refs, fmt: _Format, bps: int, stages: int, m_tile: int):
    """One program: 64 weight rows, super-blocks [s * bps, (s + 1) * bps) of K."""
    nq, ns = len(fmt.words), fmt.n_scale_planes
    quant_refs, scale_refs, (o_ref, o_smem) = refs[:nq], refs[nq:nq + ns], refs[nq + ns:]
    n_idx = lax.axis_index("n")
    s_idx = lax.axis_index("s")
    rows = pl.ds(n_idx * ROWS, ROWS)

    def load_scales(i):
        return fmt.load_scales(scale_refs, rows, s_idx * bps + jnp.minimum(i, bps - 1))

    def body(idx, *args):
        (i,), quant_smem, x_smem, (acc, scales) = idx, args[:nq], args[nq], args[nq + 1]
        nxt = load_scales(i + 1)
        words = tuple(plgpu.load(q, layout=plgpu.Layout.WGMMA, optimized=False) for q in quant_smem)
        a = fmt.dequantize(words, scales)
        acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, a, x_smem.transpose((1, 0))))(plgpu.ACC.init(acc))
        return acc, nxt

    x_tf = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    pipeline = plgpu.emit_pipeline(
        body, grid=(bps,), max_concurrent_steps=stages,
        in_specs=[*(plgpu.BlockSpec((ROWS, w), lambda i: (0, s_idx * bps + i)) for w in fmt.words),
                  plgpu.BlockSpec((m_tile, 256), lambda i: (0, s_idx * bps + i), transforms=x_tf)],
        init_carry=(plgpu.layout_cast(jnp.zeros((ROWS, m_tile), jnp.float32), plgpu.Layout.WGMMA),
                    load_scales(0)))
    acc, _ = pipeline(*(q.at[rows] for q in quant_refs), x_ref)
    o_smem[...] = acc
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[s_idx, rows])
    plgpu.wait_smem_to_gmem(0)


def supports_shape(n: int, k: int) -> bool:
    """N a multiple of 64 (one wgmma tile), K of 256 (a super-block, or 8 blocks of 32)."""
    return n % ROWS == 0 and k % 256 == 0


def supports(w) -> bool:
    """Q4_K in the GPU layout (Q4_KChunks), Q8_0, Q6_K, Q4_0, Q4_1 or Q5_0, of a shape
    `supports_shape` takes."""
    return (isinstance(w, QTensor) and w.qtype in _FORMATS
            and (w.qtype != QType.Q4_K or isinstance(w.planes, Q4_KChunks)) and supports_shape(*w.shape))


def default_config(n: int, k: int) -> WgmmaConfig:
    """The most super-blocks per program (8, 4, 2, 1 dividing K's) that still give
    PROGRAMS programs, in 2 stages: the fastest measured at M=16 (docs/kernels.md, "The wgmma
    skinny GEMM")."""
    nb, tiles = k // 256, n // ROWS
    for bps in (8, 4, 2):
        if nb % bps == 0 and tiles * (nb // bps) >= PROGRAMS:
            return WgmmaConfig(blocks_per_split=bps)
    return WgmmaConfig(blocks_per_split=1)


def _m_tile(m: int) -> int:
    return max(16, pl.next_power_of_2(m))


def _words(plane, n: int, k: int):
    """A quant plane as (N, words per row) int32, whether it is in words already or bytes."""
    if plane.dtype == jnp.int32:
        return plane.reshape(n, -1)
    return lax.bitcast_convert_type(plane.reshape(n, -1, 4), jnp.int32)


def _operands(x, w: QTensor, m_tile: int):
    """x padded to m_tile rows and permuted into chunk_order; the quant planes as (N, words)
    int32; the scale planes per row."""
    n, k = w.shape
    m = x.shape[0]
    xp = jnp.pad(x, ((0, m_tile - m), (0, 0))) if m_tile != m else x
    xp = xp.reshape(m_tile, k // 64, 64)[:, :, _FORMATS[w.qtype].order()].reshape(m_tile, k)
    p = w.planes
    nb = k // 256
    if w.qtype == QType.Q4_0:
        return xp, _words(p.qs, n, k), p.d.reshape(n, k // 32)
    if w.qtype == QType.Q4_1:
        return xp, _words(p.qs, n, k), p.d.reshape(n, k // 32), p.m.reshape(n, k // 32)
    if w.qtype == QType.Q5_0:
        return xp, _words(p.qs, n, k), p.d.reshape(n, k // 32), _words(p.qh, n, k)
    if w.qtype == QType.Q8_0:
        return xp, _words(p.qs, n, k), p.d.reshape(n, k // 32)
    if w.qtype == QType.Q6_K:
        return xp, _words(p.ql, n, k), _words(p.qh, n, k), _words(p.scales, n, k), p.d.reshape(n, nb)
    return xp, _words(p.qs, n, k), p.d.reshape(n, nb), p.dmin.reshape(n, nb), p.chunk_scales.reshape(n, nb, 4)


def _check(x, w, cfg):
    if not supports(w):
        raise NotImplementedError(f"wgmma_matmul: no kernel for {getattr(w, 'qtype', None)} {getattr(w, 'shape', None)} "
                                  f"in layout {type(getattr(w, 'planes', None)).__name__} (Q4_K in the GPU layout, "
                                  f"Q8_0, Q6_K, Q4_0, Q4_1 or Q5_0, N a multiple of {ROWS}, K of 256)")
    n, k = w.shape
    if x.ndim != 2 or x.shape[1] != k or not 1 <= x.shape[0] <= MAX_M or x.dtype != jnp.bfloat16:
        raise ValueError(f"wgmma_matmul: x {x.dtype} {x.shape} for weight {w.shape}: bf16, 1..{MAX_M} rows")
    if (k // 256) % cfg.blocks_per_split:
        raise ValueError(f"wgmma_matmul: {k // 256} super-blocks do not split into {cfg.blocks_per_split}s")


@functools.partial(jax.jit, static_argnames=("cfg", "partials"))
def wgmma_matmul(x: jax.Array, w: QTensor, cfg: WgmmaConfig | None = None, partials: bool = False) -> jax.Array:
    """x (M, K) bf16 @ dequantize(w).T -> (M, N) bf16; with `partials` the split-K partial sums
    (splits, M, N) in float32, for the consumer to add (XLA fuses the sum and the transpose)."""
    cfg = cfg or default_config(*w.shape)
    _check(x, w, cfg)
    n, k = w.shape
    m, m_tile, bps = x.shape[0], _m_tile(x.shape[0]), cfg.blocks_per_split
    splits = k // 256 // bps
    fmt = _FORMATS[w.qtype]

    def kernel(*refs):
        _kernel(*refs, fmt=fmt, bps=bps, stages=cfg.stages, m_tile=m_tile)
    kernel.__name__ = f"wgmma_{w.qtype.name.lower()}_kernel"   # the name profiles show

    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, n, m_tile), jnp.float32),
        grid=(n // ROWS, splits),
        grid_names=("n", "s"),
        scratch_types=(plgpu.SMEM((ROWS, m_tile), jnp.float32),),
    )(*_operands(x, w, m_tile))
    out = out[:, :, :m].transpose(0, 2, 1)
    return out if partials else out.sum(axis=0).astype(x.dtype)


def _q6_k_natural_order(qs, n: int, k: int):
    """Q6_K's (N, K) quants (0..63) and scale indices per value, from the kernel's word
    operands (ql, qh, scale words), as ggml lays them out (`dequant_q6_k`)."""
    ql, qh, scales = (lax.bitcast_convert_type(q, jnp.uint8).reshape(n, k // 256, -1) for q in qs)
    v = np.arange(256)
    half, g, l = v // 128, (v % 128) // 32, v % 32
    low = (ql[..., 64 * half + 32 * (g & 1) + l].astype(jnp.int32) >> (4 * (g >> 1))) & 0xF
    high = (qh[..., 32 * half + l].astype(jnp.int32) >> (2 * g)) & 3
    sc = lax.bitcast_convert_type(scales, jnp.int8)[..., 8 * half + 2 * g + l // 16]
    return (low | (high << 4)).reshape(n, k), sc.reshape(n, k)


def _dequantized_in_tile_order(w: QTensor, operands) -> jax.Array:
    """The kernel's bf16 weight, (N, K) with every 64-value chunk in chunk_order."""
    n, k = w.shape
    nb = k // 256
    f32, bf16 = jnp.float32, jnp.bfloat16
    tile_order = lambda a: a.reshape(n, k // 64, 64)[:, :, _FORMATS[w.qtype].order()].reshape(n, k)
    if w.qtype in (QType.Q4_0, QType.Q4_1, QType.Q5_0):
        qs, d, *extra = operands
        byte = lax.bitcast_convert_type(qs, jnp.uint8).reshape(n, k // 32, 16).astype(jnp.int32)
        q = jnp.concatenate([byte & 0xF, byte >> 4], axis=-1)         # (n, blocks, 32), value order
        if w.qtype == QType.Q5_0:
            bits = (extra[0][..., None] >> jnp.arange(32)) & 1
            q = q | (bits << 4)
        s = d.astype(f32).astype(bf16).astype(f32)[..., None]
        if w.qtype == QType.Q4_1:
            mb = extra[0].astype(f32).astype(bf16).astype(f32)[..., None]
            v = q.astype(f32) * s + mb
        else:
            v = (q - (8 if w.qtype == QType.Q4_0 else 16)).astype(f32) * s
        return tile_order(v.astype(bf16).reshape(n, k))
    if w.qtype == QType.Q8_0:
        qs, d = operands
        v = lax.bitcast_convert_type(qs, jnp.int8).reshape(n, k)
        s = jnp.repeat(d.astype(f32).astype(bf16), 32, axis=1)
        return tile_order((v.astype(f32) * s.astype(f32)).astype(bf16))
    if w.qtype == QType.Q6_K:
        *qs, d = operands
        q, sc = _q6_k_natural_order(qs, n, k)
        s = (sc.astype(f32) * jnp.repeat(d.astype(f32), 256, axis=1)).astype(bf16)
        return tile_order(((q - 32).astype(f32) * s.astype(f32)).astype(bf16))
    qs, d, dmin, cs = operands
    col = np.arange(64)
    b, j, e = col // 8, (col % 8) // 2, col % 2
    word = 2 * j + (b >> 2)                       # of the chunk's 8
    shift = 8 * (2 * (b & 1) + e) + 4 * ((b >> 1) & 1)
    q = (qs.reshape(n, nb, 4, 8)[..., word] >> shift) & 0xF     # (n, nb, 4, 64) in tile order
    h = (b >> 1) & 1                              # sub-block 2c + h of each column
    sc = (cs[..., None] >> (8 * h)) & 0xFF        # (n, nb, 4, 64)
    mn = (cs[..., None] >> (16 + 8 * h)) & 0xFF
    s = (d[..., None, None].astype(f32) * sc.astype(f32)).astype(bf16)
    bias = (-dmin[..., None, None].astype(f32) * mn.astype(f32)).astype(bf16)
    return (q.astype(f32) * s.astype(f32) + bias.astype(f32)).astype(bf16).reshape(n, k)


def reference_arithmetic(x: jax.Array, w: QTensor, cfg: WgmmaConfig | None = None) -> jax.Array:
    """The kernel's arithmetic in jnp, step for step, for the CPU: x permuted into chunk_order,
    the weight unpacked from the same words in the same order, scales (and Q4_K's biases)
    rounded to bf16, each weight rounded once to bf16, float32 products summed per split.
    (splits, M, N) float32."""
    cfg = cfg or default_config(*w.shape)
    _check(x, w, cfg)
    n, k = w.shape
    m = x.shape[0]
    xp, *operands = _operands(x, w, m)
    wq = _dequantized_in_tile_order(w, operands)
    prods = xp.astype(jnp.float32).reshape(m, k // 256 // cfg.blocks_per_split, -1)
    wsplit = wq.astype(jnp.float32).reshape(n, prods.shape[1], -1)
    return jnp.einsum("msk,nsk->smn", prods, wsplit, precision=lax.Precision.HIGHEST)
