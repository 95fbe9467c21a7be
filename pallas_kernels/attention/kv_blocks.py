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


def load_block(ref, table_ref, start, block_k: int, layout: CacheLayout, *, bounds_check: bool,
               half: int | None = None):
    """The [block_k, D] block of cache positions start .. start + block_k - 1 (start a multiple of block_k).

    bounds_check: mask rows at or past the capacity (needed only for a block that can cross it).
    half: a contiguous cache in the rotation-halves view [S, 2, D/2]: the block's half `half`,
    [block_k, D/2].
    """
    if not layout.paged:
        rows = pl.ds(start, block_k)
        idx = (rows, slice(None)) if half is None else (rows, jnp.int32(half), slice(None))
        if bounds_check and layout.num_keys % block_k:
            inside = (start + jnp.arange(block_k, dtype=jnp.int32)) < layout.num_keys
            return pltriton.load(ref.at[idx], mask=inside[:, None], other=0)
        return ref[idx]
    if half is not None:
        raise NotImplementedError("load_block: the halves view of a paged cache")

    ps, last_page = layout.page_size, layout.num_pages - 1
    max_pages = layout.num_keys // ps
    if ps >= block_k:
        # The block lies inside one page.
        slot = jnp.minimum(lax.div(start, jnp.int32(ps)), max_pages - 1)
        page = jnp.clip(table_ref[slot], 0, last_page)
        return ref[page, pl.ds(lax.rem(start, jnp.int32(ps)), block_k), :]
    # The block spans block_k // ps whole pages: gather row by row (row r of the block is position
    # start + r, on page table[(start + r) // ps] at offset r % ps), which yields the [block_k, D]
    # tile directly, with no reshape of a [pages, ps, D] tile in registers.
    first = lax.div(start, jnp.int32(ps))
    r = jnp.arange(block_k, dtype=jnp.int32)
    slots = first + lax.div(r, jnp.int32(ps))
    pages = pltriton.load(table_ref.at[jnp.minimum(slots, max_pages - 1)])
    pages = jnp.clip(pages, 0, last_page)
    return ref[pages, lax.rem(r, jnp.int32(ps)), :]


def load_scales(ref, table_ref, start, block_k: int, layout: CacheLayout, *, bounds_check: bool):
    """The [block_k] float32 per-entry scales of positions start .. start + block_k - 1, from a
    scale ref laid out as the cache without its head dim: [S] contiguous, [P, page_size] paged."""
    if not layout.paged:
        rows = pl.ds(start, block_k)
        if bounds_check and layout.num_keys % block_k:
            inside = (start + jnp.arange(block_k, dtype=jnp.int32)) < layout.num_keys
            return pltriton.load(ref.at[rows], mask=inside, other=0)
        return ref[rows]
    ps, last_page = layout.page_size, layout.num_pages - 1
    max_pages = layout.num_keys // ps
    if ps >= block_k:
        slot = jnp.minimum(lax.div(start, jnp.int32(ps)), max_pages - 1)
        page = jnp.clip(table_ref[slot], 0, last_page)
        return ref[page, pl.ds(lax.rem(start, jnp.int32(ps)), block_k)]
    first = lax.div(start, jnp.int32(ps))
    r = jnp.arange(block_k, dtype=jnp.int32)
    slots = first + lax.div(r, jnp.int32(ps))
    pages = pltriton.load(table_ref.at[jnp.minimum(slots, max_pages - 1)])
    pages = jnp.clip(pages, 0, last_page)
    return ref[pages, lax.rem(r, jnp.int32(ps))]


F16_MAX = 65504.0


def compute_dtype(q_dtype):
    """The dtype a quantized block is widened to for queries of `q_dtype`: float16 for 16-bit
    queries (it holds every int8 and e4m3 value exactly, has more mantissa than bfloat16 for the
    query and the probabilities, and the H100 converts e4m3 to it in one paired instruction, to
    bfloat16 only by way of float32), else q's own."""
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


def widen(x, dtype, interpret: bool):
    """A cache block (or a tuple of column pieces) in the compute dtype: int8 to float16 by
    `_I8_TO_F16X2_ASM` on the GPU (exact either way), anything else by a cast."""
    if isinstance(x, tuple):
        return tuple(widen(v, dtype, interpret) for v in x)
    if x.dtype == jnp.int8 and jnp.dtype(dtype) == jnp.dtype(jnp.float16) and not interpret:
        return pltriton.elementwise_inline_asm(
            _I8_TO_F16X2_ASM, args=[x], constraints="=r,=r,r", pack=4,
            result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float16)])[0]
    return x.astype(dtype)
