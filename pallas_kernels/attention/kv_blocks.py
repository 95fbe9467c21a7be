"""How a kernel reads one block of consecutive cache positions, from a contiguous or a paged cache.

Inside a kernel program for one (sequence, KV head), the cache ref is either
- contiguous: [S, D], position j at row j; or
- paged: [P, page_size, D] (the page pool of this KV head) with the sequence's block table
  [max_pages], position j at page table[j // page_size], row j % page_size.
Both kernels (prefill and decode) walk the cache in blocks of `block_k` positions through
`load_block`, so the masking and softmax code never sees which layout it reads. A quantized block
(pallas_kernels/kv_quant.py) is cast in registers to `compute_dtype`, the dtype the products run in.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import flash


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Static description of the cache a kernel reads (hashable, part of the kernel's compile key)."""

    num_keys: int  # logical capacity: S, or max_pages * page_size
    page_size: int | None = None  # None: contiguous
    num_pages: int | None = None  # pool size P (paged only)

    @property
    def paged(self) -> bool:
        return self.page_size is not None


def fit_block_k(layout: CacheLayout, block_k: int) -> int:
    """block_k, shrunk for a contiguous cache shorter than one block (never below 16)."""
    if layout.paged or layout.num_keys >= block_k:
        return block_k
    return max(16, 1 << (layout.num_keys.bit_length() - 1))


def check_block_k(layout: CacheLayout, block_k: int) -> None:
    """Raise ValueError unless block_k and the page size can be tiled by the Triton lowering."""
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"attention kernel: block_k={block_k} must be a power of two >= 16")
    if layout.paged:
        ps = layout.page_size
        if ps & (ps - 1):
            raise ValueError(f"paged attention kernel: page_size={ps} must be a power of two")
        if ps < block_k and block_k % ps:
            raise ValueError(f"paged attention kernel: block_k={block_k} is not a multiple of page_size={ps}")


def block_pages(table_ref, start, block_k: int, layout: CacheLayout):
    """The pages of a paged cache's block at positions start .. start + block_k - 1: the page
    holding it (one scalar) where a page holds the block, else the page of each of its rows
    [block_k]. A walk can look them up a block ahead (`load_block`'s `pages`), so the block's
    loads wait on no table load of their own."""
    ps, last_page = layout.page_size, layout.num_pages - 1
    max_pages = layout.num_keys // ps
    if ps >= block_k:
        slot = jnp.minimum(lax.div(start, jnp.int32(ps)), max_pages - 1)
        return jnp.clip(table_ref[slot], 0, last_page)
    first = lax.div(start, jnp.int32(ps))
    r = jnp.arange(block_k, dtype=jnp.int32)
    slots = first + lax.div(r, jnp.int32(ps))
    return jnp.clip(pltriton.load(table_ref.at[jnp.minimum(slots, max_pages - 1)]), 0, last_page)


def walk_cache(ranges, state, step, table_ref, block_k: int, layout: CacheLayout, *, within=None):
    """`flash.walk_blocks` over the cache with step(block, state, masked, pages): `pages` is None
    for a contiguous cache; a paged cache's walk looks each block's pages up one block ahead and
    carries them, so a block's K/V loads wait on no table load of their own (which Triton's
    pipeline does not hide). Two or three blocks ahead, the carry a tuple of page vectors, were
    slower (docs/kernels.md, "Quantized KV caches")."""
    if not layout.paged:
        return flash.walk_blocks(ranges, state, lambda b, st, masked: step(b, st, masked, None), within=within)

    def paged_step(block, carry, masked):
        inner, pages = carry
        ahead = block_pages(table_ref, (block + 1) * block_k, block_k, layout)
        return step(block, inner, masked, pages), ahead

    lo = ranges.lo if within is None else jnp.maximum(ranges.lo, within[0])  # the walk's first block
    state, _ = flash.walk_blocks(ranges, (state, block_pages(table_ref, lo * block_k, block_k, layout)),
                                 paged_step, within=within)
    return state


def load_block(ref, table_ref, start, block_k: int, layout: CacheLayout, *, bounds_check: bool,
               half: int | None = None, pages=None):
    """The [block_k, D] block of cache positions start .. start + block_k - 1 (start a multiple of block_k).

    bounds_check: mask rows at or past the capacity (needed only for a block that can cross it).
    half: a cache in the rotation-halves view ([S, 2, D/2], or pages [P, page_size, 2, D/2]):
    the block's half `half`, [block_k, D/2]. pages: a paged cache's `block_pages` for this
    block, if already looked up.
    """
    if not layout.paged:
        rows = pl.ds(start, block_k)
        idx = (rows, slice(None)) if half is None else (rows, jnp.int32(half), slice(None))
        if bounds_check and layout.num_keys % block_k:
            inside = (start + jnp.arange(block_k, dtype=jnp.int32)) < layout.num_keys
            return pltriton.load(ref.at[idx], mask=inside[:, None], other=0)
        return ref[idx]
    if pages is None:
        pages = block_pages(table_ref, start, block_k, layout)
    ps = layout.page_size
    cols = (slice(None),) if half is None else (jnp.int32(half), slice(None))
    if ps >= block_k:  # the block lies inside one page
        return ref[(pages, pl.ds(lax.rem(start, jnp.int32(ps)), block_k), *cols)]
    # The block spans block_k // ps whole pages: gather row by row (row r of the block is position
    # start + r, on page table[(start + r) // ps] at offset r % ps), which yields the [block_k, D]
    # tile directly, with no reshape of a [pages, ps, D] tile in registers.
    return ref[(pages, lax.rem(jnp.arange(block_k, dtype=jnp.int32), jnp.int32(ps)), *cols)]


def load_scales(ref, table_ref, start, block_k: int, layout: CacheLayout, *, bounds_check: bool, pages=None):
    """The [block_k] float32 per-entry scales of positions start .. start + block_k - 1, from a
    scale ref laid out as the cache without its head dim: [S] contiguous, [P, page_size] paged."""
    if not layout.paged:
        rows = pl.ds(start, block_k)
        if bounds_check and layout.num_keys % block_k:
            inside = (start + jnp.arange(block_k, dtype=jnp.int32)) < layout.num_keys
            return pltriton.load(ref.at[rows], mask=inside, other=0)
        return ref[rows]
    if pages is None:
        pages = block_pages(table_ref, start, block_k, layout)
    ps = layout.page_size
    if ps >= block_k:
        return ref[pages, pl.ds(lax.rem(start, jnp.int32(ps)), block_k)]
    return ref[pages, lax.rem(jnp.arange(block_k, dtype=jnp.int32), jnp.int32(ps))]


F16_MAX = 65504.0


def compute_dtype(q_dtype):
    """The dtype a quantized block is widened to for queries of `q_dtype`: float16 for 16-bit
    queries (it holds every int8 and e4m3 value exactly, has more mantissa than bfloat16 for the
    query and the probabilities, and e4m3 maps onto it by moving bits, see `widen`), else q's own."""
    q_dtype = jnp.dtype(q_dtype)
    return jnp.dtype(jnp.float16) if q_dtype.itemsize == 2 else q_dtype


def to_compute(q):
    """Queries (an array or a tuple of column pieces) in `compute_dtype`; a 16-bit query is
    saturated at float16's largest value rather than overflowing to inf."""
    if isinstance(q, tuple):
        return tuple(map(to_compute, q))
    dtype = compute_dtype(q.dtype)
    if dtype == q.dtype:
        return q
    return jnp.clip(q.astype(jnp.float32), -F16_MAX, F16_MAX).astype(dtype)


# int8 -> float16 four values at a time: each byte with its sign bit flipped (x + 128, unsigned)
# becomes the low byte of a float16 whose high byte is 0x64, i.e. exactly 1024 + 128 + x, and
# one paired subtraction of 1152 (0x6480) leaves x. Two byte permutes and two paired
# subtractions per four values, where a plain cast is one integer-to-float conversion per value
# at a quarter of the FMA rate; the conversions bounded the int8 decode kernel at batch 1.
_I8_TO_F16X2_ASM = """{
.reg .b32 u, magic, bias, t0, t1;
mov.b32 magic, 0x64646464;
mov.b32 bias, 0x64806480;
xor.b32 u, $2, 0x80808080;
prmt.b32 t0, u, magic, 0x5140;
prmt.b32 t1, u, magic, 0x5342;
sub.f16x2 $0, t0, bias;
sub.f16x2 $1, t1, bias;
}"""


# e4m3 -> float16 four values at a time, also without the conversion unit: a byte permute puts
# two bytes in two 16-bit lanes, each sign-extended (prmt's sign mode); a shift by 7 moves the
# sign to bit 15 and the 7 exponent and mantissa bits to bits 7-13; a mask clears bit 14 and the
# sign bits the shift carried over from the lower lane. Each lane is then the float16 of the value
# times 2**-8 (e4m3's exponent bias is 7, float16's 15), subnormals included, so it is exact and the
# 2**8 goes into the per-head scale (`widened_unit`). Six integer instructions for four values
# instead of two paired conversions, which held the fp8 decode kernel under int8's speed at
# long contexts (docs/kernels.md, "Quantized KV caches").
_E4M3_TO_F16X2_ASM = """{
.reg .b32 t0, t1;
prmt.b32 t0, $2, 0, 0x9180;
prmt.b32 t1, $2, 0, 0xB3A2;
shl.b32 t0, t0, 7;
shl.b32 t1, t1, 7;
and.b32 $0, t0, 0xBF80BF80;
and.b32 $1, t1, 0xBF80BF80;
}"""
_E4M3_UNIT = 2.0 ** -8


def _by_asm(cache_dtype, dtype, interpret: bool) -> str | None:
    """Which packed conversion widens a block of `cache_dtype` to `dtype` on the GPU, if any."""
    if interpret or jnp.dtype(dtype) != jnp.dtype(jnp.float16):
        return None
    return {jnp.dtype(jnp.int8): _I8_TO_F16X2_ASM,
            jnp.dtype(jnp.float8_e4m3fn): _E4M3_TO_F16X2_ASM}.get(jnp.dtype(cache_dtype))


def widened_unit(cache_dtype, dtype, interpret: bool) -> float:
    """What `widen` multiplies the values of a `cache_dtype` block by (2**-8 for e4m3 on the GPU,
    else 1): a kernel divides the block's scale by it."""
    return _E4M3_UNIT if _by_asm(cache_dtype, dtype, interpret) == _E4M3_TO_F16X2_ASM else 1.0


def widen(x, dtype, interpret: bool):
    """A cache block (or a tuple of column pieces) in the compute dtype, times
    `widened_unit(x.dtype, dtype, interpret)`: int8 and e4m3 to float16 by the packed integer
    conversions above on the GPU (exact either way), anything else by a cast."""
    if isinstance(x, tuple):
        return tuple(widen(v, dtype, interpret) for v in x)
    asm = _by_asm(x.dtype, dtype, interpret)
    if asm is not None:
        return pltriton.elementwise_inline_asm(
            asm, args=[x], constraints="=r,=r,r", pack=4,
            result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float16)])[0]
    return x.astype(dtype)
