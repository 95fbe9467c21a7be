"""The wgmma skinny GEMM's dequantizers (wgmma_skinny.py): one super-block of a weight's quant
words and scales, held in registers in the WGMMA layout, into the (64, 256) bf16 A tile, by a
few PTX instructions per register; and the K order of a 64-value chunk that the words' places
in the layout give (x is permuted to match)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as QType
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import llvm, vector
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu


ROWS = 64                                   # weight rows per program: one wgmma tile's M
WG_ROWS = plgpu.Layout.WGMMA.reduce(1)      # a per-row vector of a [64, n] wgmma tile


def chunk_order() -> np.ndarray:
    """The K order of a 64-value chunk in the dequantized A tile: column col of the tile holds
    the chunk's value chunk_order()[col]. Thread j of a row's four holds columns 8b + 2j + e
    (the WGMMA layout) and loaded the words it needs, so one byte pair of one word fills a
    register and no data moves between threads:
    - Q4_K (32 bytes, low nibbles values 0-31, high ones 32-63): words 2j and 2j + 1; column
      block b takes word 2j + (b >> 2), nibble (b >> 1) & 1, bytes 2 (b & 1) + e.
    - Q8_0 (two 32-value blocks of 8 words): words 2j and 2j + 1 of each block; column block b
      takes block (b >> 1) & 1, its word 2j + (b >> 2), bytes 2 (b & 1) + e: the same order.
    - Q6_K (32-value groups g of 128-value halves): see `dequant_q6_k`; again the same order.
    x is permuted the same way."""
    col = np.arange(64)
    b, j, e = col // 8, (col % 8) // 2, col % 2
    return 32 * ((b >> 1) & 1) + 8 * j + 4 * (b >> 2) + 2 * (b & 1) + e


_PAIR_SELECT = (0x4140, 0x4342)   # prmt: bytes 2p, 2p + 1 into the low bytes of two 16-bit lanes


def _q4_k_asm(shifted, byte_pair: int, s, b):
    """bf16x2 of (nibbles of bytes 2p and 2p + 1 of `shifted`) * s + b: `shifted` is the word or
    the word >> 4 (high nibbles). prmt puts the two bytes in the low bytes of two 16-bit lanes,
    lop3 keeps the nibble and ORs in bf16 128.0 (the lane is exactly 128 + q), sub takes the
    128 off exactly, fma applies scale and bias with one rounding."""
    i32 = ir.IntegerType.get_signless(32)
    return llvm.inline_asm(
        i32, [shifted, s, b],
        f"""{{
        .reg .b32 t, sb, bb, magic;
        mov.b32 magic, 0x43004300;
        prmt.b32 t, $1, 0, {_PAIR_SELECT[byte_pair]:#x};
        lop3.b32 t, t, 0x000F000F, magic, 0xEA;
        sub.bf16x2 t, t, magic;
        cvt.rn.bf16x2.f32 sb, $2, $2;
        cvt.rn.bf16x2.f32 bb, $3, $3;
        fma.rn.bf16x2 $0, t, sb, bb;
        }}""",
        "=r,r,f,f")


def _q8_0_asm(word, byte_pair: int, s):
    """bf16x2 of (signed bytes 2p and 2p + 1 of `word`) * s (bf16x2). After prmt, one lop3
    makes the lane bf16 128 + (v & 0x7f), the other 128 + (v & 0x80), i.e. 128 or 256 (bit 7
    lands on the exponent's lowest bit): their difference is v, exact; mul applies the scale
    with one rounding."""
    i32 = ir.IntegerType.get_signless(32)
    return llvm.inline_asm(
        i32, [word, s],
        f"""{{
        .reg .b32 t, lo, hi, magic;
        mov.b32 magic, 0x43004300;
        prmt.b32 t, $1, 0, {_PAIR_SELECT[byte_pair]:#x};
        lop3.b32 lo, t, 0x007F007F, magic, 0xEA;
        lop3.b32 hi, t, 0x00800080, magic, 0xEA;
        sub.bf16x2 t, lo, hi;
        mul.rn.bf16x2 $0, t, $2;
        }}""",
        "=r,r,r")


_QUAD_SOURCE = """
        mov.u32 l, %laneid;
        and.b32 src, l, 0xFFFFFFFC;
        or.b32 src, src, {c};"""


def _quad_word(word, c: int):
    """`word` of thread c of this thread's quad (same rows in the WGMMA layout)."""
    return llvm.inline_asm(
        ir.IntegerType.get_signless(32), [word],
        f"""{{
        .reg .b32 l, src;{_QUAD_SOURCE.format(c=c)}
        shfl.sync.idx.b32 $0, $1, src, 0x1f, 0xffffffff;
        }}""",
        "=r,r")


def _f16_half_bf16x2(word, half: int):
    """bf16x2 of f16 `half` (0: low 16 bits) of `word`, in both lanes."""
    return llvm.inline_asm(
        ir.IntegerType.get_signless(32), [word],
        f"""{{
        .reg .b16 lo, hi;
        .reg .f32 f;
        mov.b32 {{lo, hi}}, $1;
        cvt.f32.f16 f, {('lo', 'hi')[half]};
        cvt.rn.bf16x2.f32 $0, f, f;
        }}""",
        "=r,r")


_BF16_SUPERBLOCK = plgpu.ShapeDtypeStruct((ROWS, 256), jnp.bfloat16, layout=plgpu.Layout.WGMMA)


def _fragment(regs) -> mgpu.FragmentedArray:
    return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)


def _empty_tile():
    return np.empty(mgpu.WGMMA_LAYOUT.registers_shape((ROWS, 256)), dtype=object)


def _row_scalar(vec: mgpu.FragmentedArray, r: int):
    """Row r (0: the thread's row, 1: that row + 8) of a per-row vector, as a scalar."""
    return vector.extract(vec.registers.flat[r], [], [0])


def _set(regs, col_block: int, r: int, reg):
    pair_ty = ir.VectorType.get((2,), ir.BF16Type.get())
    regs[0, col_block, 0, 0, r, 0, 0, 0, 0] = mgpu.utils.bitcast(reg, pair_ty)


@plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, (WG_ROWS,) * 8, (WG_ROWS,) * 8), return_type=_BF16_SUPERBLOCK)
def dequant_q4_k(ctx, words, scales, biases):
    """(64, 32) int32 words of one Q4_K super-block per row (chunk c = words 8c..8c+7), the
    row's scale and bias per sub-block -> the (64, 256) bf16 A tile, chunk c in columns
    64c..64c+63 in chunk_order()."""
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    regs = _empty_tile()
    for r in range(2):
        for c in range(4):
            wv = words.registers[0, c, 0, 0, r, 0, 0, 0, 0]
            sb = [(_row_scalar(scales[2 * c + h], r), _row_scalar(biases[2 * c + h], r)) for h in range(2)]
            for w in range(2):
                word = vector.extract(wv, [], [w])
                shifted = (word, mgpu.utils.arith.shrui(word, mgpu.utils.c(4, i32)))
                for b in range(4 * w, 4 * w + 4):
                    h = (b >> 1) & 1
                    _set(regs, 8 * c + b, r, _q4_k_asm(shifted[h], b & 1, *sb[h]))
    return _fragment(regs)


@plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA), return_type=_BF16_SUPERBLOCK)
def dequant_q8_0(ctx, words, scales):
    """(64, 64) int32 words of eight Q8_0 blocks per row (block g = words 8g..8g+7) and the
    (64, 8) f16 tile of their scales -> the (64, 256) bf16 A tile, chunk c (blocks 2c, 2c + 1) in
    columns 64c..64c+63 in chunk_order(). In the WGMMA layout thread j holds scales 2j, 2j + 1
    of its rows; it takes the others from its quad by shuffles (`_quad_word`)."""
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    regs = _empty_tile()
    for r in range(2):
        pairs = [_quad_word(mgpu.utils.bitcast(scales.registers.flat[r], i32), c) for c in range(4)]
        for g in range(8):
            s = _f16_half_bf16x2(pairs[g >> 1], g & 1)
            wv = words.registers[0, g, 0, 0, r, 0, 0, 0, 0]
            c, h = g >> 1, g & 1
            for t in range(2):
                word = vector.extract(wv, [], [t])
                for p in range(2):
                    _set(regs, 8 * c + 4 * t + 2 * h + p, r, _q8_0_asm(word, p, s))
    return _fragment(regs)


def _q6_k_scale(word, d, byte_base: int):
    """bf16x2 of d * the sub-block scale this thread's values take: signed byte
    byte_base + (j >> 1) of `word`, j the thread's place in its quad (lane % 4), since the
    thread's 32-value groups span two 16-value sub-blocks by j (`dequant_q6_k`)."""
    i32 = ir.IntegerType.get_signless(32)
    return llvm.inline_asm(
        i32, [word, d],
        f"""{{
        .reg .b32 k, sel, v;
        .reg .f32 f;
        mov.u32 k, %laneid;
        bfe.u32 k, k, 1, 1;
        add.u32 k, k, {byte_base};
        or.b32 sel, k, 8;
        mul.lo.u32 sel, sel, 0x1110;
        or.b32 sel, sel, k;
        prmt.b32 v, $1, 0, sel;
        cvt.rn.f32.s32 f, v;
        mul.f32 f, f, $2;
        cvt.rn.bf16x2.f32 $0, f, f;
        }}""",
        "=r,r,f")


def _q6_k_asm(low, high, byte_pair: int, s):
    """bf16x2 of (6-bit quants of bytes 2p, 2p + 1 - 32) * s: `low` holds the 4 low bits in each
    byte's low nibble, `high` the 2 high bits at bits 4-5. prmt both into two lanes, the lane
    becomes bf16 128 + q exactly, sub 160 gives q - 32, mul applies the scale."""
    i32 = ir.IntegerType.get_signless(32)
    sel = _PAIR_SELECT[byte_pair]
    return llvm.inline_asm(
        i32, [low, high, s],
        f"""{{
        .reg .b32 t, h, magic, q160;
        mov.b32 magic, 0x43004300;
        mov.b32 q160, 0x43204320;
        prmt.b32 t, $1, 0, {sel:#x};
        prmt.b32 h, $2, 0, {sel:#x};
        lop3.b32 h, h, 0x00300030, magic, 0xEA;
        lop3.b32 t, t, 0x000F000F, h, 0xEA;
        sub.bf16x2 t, t, q160;
        mul.rn.bf16x2 $0, t, $3;
        }}""",
        "=r,r,r,r")


@plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA, (WG_ROWS,) * 4, WG_ROWS),
                   return_type=_BF16_SUPERBLOCK)
def dequant_q6_k(ctx, ql, qh, scale_words, d):
    """(64, 32) int32 words of a Q6_K super-block's low bits per row, (64, 16) of its high
    bits, its 16 int8 scales as 4 words and d (float32) -> the (64, 256) bf16 A tile.

    ggml's Q6_K: value 128n + 32g + l (half n, group g, l < 32) takes the low nibble (g < 2)
    or high nibble (g >= 2) of ql byte 64n + 32 (g & 1) + l, bits 2g, 2g + 1 of qh byte
    32n + l, scale 8n + 2g + l // 16. Thread j holds ql words 16n + 8 (g & 1) + 2j + t and qh
    words 8n + 2j + t (t < 2), i.e. l = 8j + 4t + 2p + e: column block
    8 (2n + (g >> 1)) + 4t + 2 (g & 1) + p then holds chunk_order's values, as Q4_K and Q8_0."""
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    shift = lambda w, op, n: op(w, mgpu.utils.c(n, i32))
    shl, shr = mgpu.utils.arith.shli, mgpu.utils.arith.shrui
    regs = _empty_tile()
    for r in range(2):
        dr = _row_scalar(d, r)
        for n in range(2):
            # the thread's scale of each group (the same for both words t): picked once
            scales = [_q6_k_scale(_row_scalar(scale_words[2 * n + (g >> 1)], r), dr, 2 * (g & 1)) for g in range(4)]
            for t in range(2):
                qh_w = vector.extract(qh.registers[0, n, 0, 0, r, 0, 0, 0, 0], [], [t])
                highs = (shift(qh_w, shl, 4), shift(qh_w, shl, 2), qh_w, shift(qh_w, shr, 2))
                for g in range(4):
                    ql_w = vector.extract(ql.registers[0, 2 * n + (g & 1), 0, 0, r, 0, 0, 0, 0], [], [t])
                    low = ql_w if g < 2 else shift(ql_w, shr, 4)
                    s = scales[g]
                    for p in range(2):
                        col_block = 8 * (2 * n + (g >> 1)) + 4 * t + 2 * (g & 1) + p
                        _set(regs, col_block, r, _q6_k_asm(low, highs[g], p, s))
    return _fragment(regs)


def blocks32_order() -> np.ndarray:
    """The K order of a 64-value chunk (two 32-value blocks) for Q4_0, Q4_1 and Q5_0, whose byte
    i of a block holds value i in its low nibble and i + 16 in its high one. Thread j's words
    2j, 2j + 1 of the chunk's eight are words 2 (j & 1) + t of block j >> 1; column block b takes
    word t = b >> 2, nibble (b >> 1) & 1, bytes 2 (b & 1) + e. So the block, and with it the
    scale, depends on the thread (`_quad_pick_f16`), not on the column block."""
    col = np.arange(64)
    b, j, e = col // 8, (col % 8) // 2, col % 2
    return 32 * (j >> 1) + 16 * ((b >> 1) & 1) + 8 * (j & 1) + 4 * (b >> 2) + 2 * (b & 1) + e


def _quad_pick_f16(pair, c: int):
    """bf16x2 of the f16 of block 2c + (j >> 1) of the thread's row: thread c of the quad holds
    blocks 2c, 2c + 1 as one word (`pair`, the WGMMA layout of a (64, 8) f16 tile); one shuffle
    fetches it, the thread's place picks the half."""
    i32 = ir.IntegerType.get_signless(32)
    return llvm.inline_asm(
        i32, [pair],
        f"""{{
        .reg .b32 l, src, v, sh;
        .reg .b16 h;
        .reg .f32 f;{_QUAD_SOURCE.format(c=c)}
        shfl.sync.idx.b32 v, $1, src, 0x1f, 0xffffffff;
        and.b32 sh, l, 2;
        shl.b32 sh, sh, 3;
        shr.u32 v, v, sh;
        cvt.u16.u32 h, v;
        cvt.f32.f16 f, h;
        cvt.rn.bf16x2.f32 $0, f, f;
        }}""",
        "=r,r")


def _quad_pick_high_bits(w0, w1, c: int):
    """Q5_0's high-bit word (bit i: value i's fifth bit) of block 2c + (j >> 1), shifted right by
    8 (j & 1): bit 16 n + 4 t + 2 p + e is then that of the value in nibble n, word t, byte pair
    p, lane e (`blocks32_order`). Thread c of the quad holds blocks 2c (w0) and 2c + 1 (w1) in
    the WGMMA layout of the (64, 8) int32 tile; two shuffles fetch both."""
    i32 = ir.IntegerType.get_signless(32)
    return llvm.inline_asm(
        i32, [w0, w1],
        f"""{{
        .reg .b32 l, src, a, b, s, v;
        .reg .pred p;{_QUAD_SOURCE.format(c=c)}
        shfl.sync.idx.b32 a, $1, src, 0x1f, 0xffffffff;
        shfl.sync.idx.b32 b, $2, src, 0x1f, 0xffffffff;
        and.b32 s, l, 2;
        setp.ne.u32 p, s, 0;
        selp.b32 v, b, a, p;
        and.b32 s, l, 1;
        shl.b32 s, s, 3;
        shr.u32 $0, v, s;
        }}""",
        "=r,r,r")


# Per 32-value block type: the bf16x2 subtracted from 128 + q (136: q - 8; 128: q; 144: q - 16)
# and the final op on (value, d[, m]).
_NIBBLE_TAIL = {QType.Q4_0: ("0x43084308", "mul.rn.bf16x2 $0, t, $2;"),
                QType.Q4_1: ("0x43004300", "fma.rn.bf16x2 $0, t, $2, $3;"),
                QType.Q5_0: ("0x43104310", "mul.rn.bf16x2 $0, t, $2;")}


def _nibble_asm(shifted, byte_pair: int, kind: QType, s, extra=None, high_bit: int = 0):
    """bf16x2 of the two values in the low nibbles of bytes 2p, 2p + 1 of `shifted` (the word,
    or the word >> 4), for a 32-value block type: prmt and lop3 make the lane bf16 128 + q
    exactly (Q5_0 first ORs in the fifth bit at bit 4, from bits high_bit, high_bit + 1 of the
    `extra` word), then
    - Q4_0: sub 136 (exact q - 8), mul by d;
    - Q4_1: sub 128 (exact q), fma with d and m (`extra`), one rounding;
    - Q5_0: sub 144 (exact q - 16), mul by d.
    s and Q4_1's m are bf16x2."""
    i32 = ir.IntegerType.get_signless(32)
    offset, tail = _NIBBLE_TAIL[kind]
    if kind == QType.Q5_0:
        # bits high_bit, high_bit + 1 -> bits 4 and 20 (times 2^4 + 2^19, masked), OR bf16 128
        merge = (f"bfe.u32 h, $3, {high_bit}, 2; mul.lo.u32 h, h, 0x00080010; "
                 "lop3.b32 h, h, 0x00100010, magic, 0xEA;")
    else:
        merge = "mov.b32 h, magic;"
    args = [shifted, s] + ([extra] if extra is not None else [])
    return llvm.inline_asm(
        i32, args,
        f"""{{
        .reg .b32 t, h, magic, off;
        mov.b32 magic, 0x43004300;
        mov.b32 off, {offset};
        prmt.b32 t, $1, 0, {_PAIR_SELECT[byte_pair]:#x};
        {merge}
        lop3.b32 t, t, 0x000F000F, h, 0xEA;
        sub.bf16x2 t, t, off;
        {tail}
        }}""",
        "=r" + ",r" * len(args))


def blocks32_dequant(kind: QType):
    """The A-tile dequantizer of a 32-value block type: (64, 32) int32 quant words of a
    super-step (eight blocks) per row, the (64, 8) tile of d (f16) and of Q4_1's m (f16) or
    Q5_0's high-bit words (int32), each in the WGMMA layout (thread j holds blocks 2j, 2j + 1 of
    its rows; `_block_tile`) -> the (64, 256) bf16 A tile, chunk c (blocks 2c, 2c + 1) in columns
    64c..64c+63 in blocks32_order()."""
    arg_types = (plgpu.Layout.WGMMA,) * (2 if kind == QType.Q4_0 else 3)

    def dequant(ctx, words, d, *extra_vecs):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        regs = _empty_tile()
        for r in range(2):
            for c in range(4):
                wv = words.registers[0, c, 0, 0, r, 0, 0, 0, 0]
                extra = None
                word = lambda t: mgpu.utils.bitcast(t.registers.flat[r], i32)
                s = _quad_pick_f16(word(d), c)
                if kind == QType.Q4_1:
                    extra = _quad_pick_f16(word(extra_vecs[0]), c)
                elif kind == QType.Q5_0:
                    qh = extra_vecs[0].registers.flat[r]
                    extra = _quad_pick_high_bits(vector.extract(qh, [], [0]), vector.extract(qh, [], [1]), c)
                for t in range(2):
                    word = vector.extract(wv, [], [t])
                    shifted = (word, mgpu.utils.arith.shrui(word, mgpu.utils.c(4, i32)))
                    for nib in range(2):
                        for p in range(2):
                            reg = _nibble_asm(shifted[nib], p, kind, s, extra, high_bit=16 * nib + 4 * t + 2 * p)
                            _set(regs, 8 * c + 4 * t + 2 * nib + p, r, reg)
        return _fragment(regs)

    dequant.__name__ = f"_dequant_{kind.name.lower()}"
    return plgpu.inline_mgpu(arg_types=arg_types, return_type=_BF16_SUPERBLOCK)(dequant)
