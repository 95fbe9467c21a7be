"""Decode attention: a few query tokens per sequence (1, or up to 8 when verifying drafts) over the cache.

Decoding reads the whole visible cache for very little arithmetic, so the kernel is built to stream
K/V at memory bandwidth:
- One program serves all G query heads of one KV head for all T query tokens: the G*T query rows
  (padded to a power of two >= 16 for the matrix units) form one tile against each K/V block, so
  each cache block is read once, not G times.
- Split-K ("flash decoding"): the visible key range of each sequence is cut into `num_splits` equal
  runs of blocks handled by separate programs, so a small batch still fills the GPU; each program
  writes an unnormalized partial (acc, running max, running sum) and a small XLA step combines them.
- Key blocks no row can see (beyond kv_len, outside the window) are skipped; masks are applied only
  on edge blocks.
- `decode_rope_attention` runs kv_append's pass (the QKV product's partial sums summed, q and k
  rotated, k and v written into the cache) as the prologue of the same programs, so a decode
  step spends one launch per layer on both: each program builds its group's query rows, the
  program whose split holds the new position writes the key and value, and a block barrier
  orders those writes before the program's own reads.

Lowering: Pallas's Triton lowering (not Mosaic GPU). It runs under `interpret=True` on the CPU,
which the tests rely on; a paged cache needs per-block gathers of pages, which are plain pointer
loads in Triton; and a G*T tile of 16-64 rows is below the 64-row warpgroup tile of Hopper's
wgmma that Mosaic GPU builds on, while this kernel is bound by memory, not by the matrix units.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.kv_append.kernel import ProductRows, split_view

from . import flash
from .kv_blocks import CacheLayout, check_block_k, fit_block_k, load_block
from .reference import check_shapes

NUM_SMS_H100 = 132


def default_tiles(head_dim: int) -> dict:
    """Block size and launch shape measured best on the H100 (benchmarks/NOTES-attention.md)."""
    if head_dim <= 128:
        return dict(block_k=128, num_warps=4, num_stages=3)
    return dict(block_k=64, num_warps=4, num_stages=3)


def default_num_splits(batch: int, kv_heads: int, num_keys: int, block_k: int) -> int:
    """Enough programs for about two waves on the GPU, but at least 4 key blocks per split.

    Down to one block per split, batch-1 decode of smollm2 (3 KV heads, ~600 keys) spent less
    kernel time in attention (4.6 vs 7.5 us per layer) but decoded 8% slower end to end (761
    vs 840 tokens/s): the extra partials cost more in the combine and launches than they saved."""
    programs = batch * kv_heads
    want = pl.cdiv(2 * NUM_SMS_H100, programs)
    return max(1, min(want, num_keys // (4 * block_k)))


def _kernel(kv_len_ref, row_pos_ref, q_ref, k_ref, v_ref, *rest, layout: CacheLayout, scale: float,
            window: int | None, block_k: int, num_splits: int, group: int | None):
    """group: None, q_ref holds the padded query rows of this program and row_pos_ref their
    positions; else (one query token) q_ref is the token's [Hq, D] heads, of which this KV head's
    `group` rows are read (rows past them masked), and row_pos_ref the token's position."""
    n_out = 1 if group is not None and num_splits == 1 else 3
    table_ref = rest[0] if len(rest) > n_out else None
    _attend(kv_len_ref[()], row_pos_ref, q_ref, k_ref, v_ref, table_ref, rest[-n_out:], layout=layout, scale=scale,
            window=window, block_k=block_k, num_splits=num_splits, group=group)


def _rope_append_kernel(kv_len_ref, pos_ref, inv_ref, parts_ref, *refs, has_bias: bool, n_heads: int, n_parts: int,
                        pairing: str, interpret: bool, layout: CacheLayout, scale: float, window: int | None,
                        block_k: int, num_splits: int, group: int):
    """One decode token per sequence: `kv_append`'s pass, then the attention, in one program.

    The program of (split, KV head h, sequence b) rotates its group's query rows from the QKV
    product's partial sums into `q_ref` (every split writes the same values), and the program
    whose split holds the token's position writes the key and value into the cache there
    (k_ref, v_ref are the outputs aliased to the donated caches, so they are read as well). A
    block barrier makes those writes visible to the program's own threads before it attends
    (the interpreter runs programs one at a time and needs none)."""
    bias_ref = refs[0] if has_bias else None
    refs = refs[1:] if has_bias else refs
    out_refs, (k_ref, v_ref, q_ref) = refs[2:-3], refs[-3:]    # refs[:2]: the caches as inputs (aliased)
    split, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    pos, kv_len = pos_ref[()], kv_len_ref[()]
    product = ProductRows(parts_ref, bias_ref, inv_ref, b, pos, n_parts=n_parts, pairing=pairing, dtype=q_ref.dtype)
    for g in range(group):
        head = h * group + g
        pltriton.store(q_ref.at[head, :], product.row(product.rotated(head)).astype(q_ref.dtype))

    rows, r = _group_rows(group)
    _, first, per_split = _split_range(jnp.where(r < group, pos, -1), kv_len, block_k, window, num_splits, split)
    block = flash.idiv(jnp.maximum(pos, 0), block_k)
    owner = (pos >= 0) & (block >= first) & (block < first + per_split)
    at = jnp.maximum(pos, 0)
    n_kv = pl.num_programs(1)
    k_row = product.row(product.rotated(n_heads + h))
    v_row = product.row((product.half(n_heads + n_kv + h, 0), product.half(n_heads + n_kv + h, 1)))
    write = jnp.broadcast_to(owner, k_row.shape)
    pltriton.store(k_ref.at[at, :], k_row.astype(k_ref.dtype), mask=write)
    pltriton.store(v_ref.at[at, :], v_row.astype(v_ref.dtype), mask=write)
    if not interpret:
        pltriton.debug_barrier()
    _attend(kv_len, pos_ref, q_ref, k_ref, v_ref, None, out_refs, layout=layout, scale=scale, window=window,
            block_k=block_k, num_splits=num_splits, group=group)


def _split_range(pos, kv_len, block_k: int, window: int | None, num_splits: int, split):
    """(block ranges, first block, blocks per split) of split `split` for query rows `pos`."""
    ranges = flash.block_ranges(pos, kv_len, block_k, window)
    per_split = flash.idiv(ranges.hi - ranges.lo + (num_splits - 1), num_splits)
    return ranges, ranges.lo + split * per_split, per_split


def _group_rows(group: int):
    rows = max(16, pl.next_power_of_2(group))
    return rows, jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)


def _attend(kv_len, row_pos_ref, q_ref, k_ref, v_ref, table_ref, out_refs, *, layout: CacheLayout, scale: float,
            window: int | None, block_k: int, num_splits: int, group: int | None):
    """The program's attention over its split of the cache, written to `out_refs` (see _kernel)."""
    split, kv_head = pl.program_id(0), pl.program_id(1)
    if group is None:
        pos = row_pos_ref[...]
        q = q_ref[...]
        rows = q.shape[0]
    else:
        rows, r = _group_rows(group)
        first_row = pl.ds(kv_head * group, rows)
        pos = jnp.where(r < group, row_pos_ref[()], -1)
        q = pltriton.load(q_ref.at[first_row, :], mask=(r < group)[:, None], other=0)
    qk_scale = scale * flash.LOG2E

    def step(block, state, masked):
        start = block * block_k
        k = load_block(k_ref, table_ref, start, block_k, layout, bounds_check=masked)
        v = load_block(v_ref, table_ref, start, block_k, layout, bounds_check=masked)
        mask = flash.visibility(pos, start, block_k, kv_len, window) if masked else None
        return flash.attend_block(state, q, k, v, qk_scale=qk_scale, mask=mask)

    ranges, first, per_split = _split_range(pos, kv_len, block_k, window, num_splits, split)
    state = flash.init_state(q.shape[0], q.shape[1])
    acc, m, l = flash.walk_blocks(ranges, state, step, within=(first, first + per_split))
    if len(out_refs) == 1:
        # One split and one token: the normalized rows go straight to the [Hq, D] output
        # (a row that sees no key has l == 0 and gets zeros), so no combine step runs.
        (o_ref,) = out_refs
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        pltriton.store(o_ref.at[first_row, :], out.astype(o_ref.dtype), mask=(r < group)[:, None])
        return
    acc_ref, m_ref, l_ref = out_refs
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _combine(acc, m, l, row_pos, kv_len, window):
    """Merge split partials acc [B, Hkv, n, R, D], m, l [B, Hkv, n, R] into normalized [B, Hkv, R, D]."""
    m_max = jnp.max(m, axis=2, keepdims=True)
    m_max = jnp.where(jnp.isfinite(m_max), m_max, 0.0)
    w = jnp.where(jnp.isfinite(m), jnp.exp2(m - m_max), 0.0)
    num = jnp.sum(w[..., None] * acc, axis=2)
    den = jnp.sum(w * l, axis=2)
    out = num / jnp.where(den > 0, den, 1.0)[..., None]
    sees = flash.row_sees_a_key(row_pos, kv_len[:, None], window)  # [B, R]
    return jnp.where(sees[:, None, :, None], out, 0.0)


class RopeAppend(NamedTuple):
    """What the fused kernel builds the queries, keys and values from (see kv_append)."""

    parts: jax.Array          # [S, B, (Hq + 2 Hkv) D] float32 partial sums of the QKV product
    bias: jax.Array | None    # [(Hq + 2 Hkv) D]
    inv_freq: jax.Array       # [D / 2]
    pairing: str


def _call(q, k, v, table, q_pos, kv_len, layout: CacheLayout, *, scale, window, block_k, num_splits,
          num_warps, num_stages, interpret, rope: RopeAppend | None = None):
    """q: the queries [B, T, Hq, D], or with `rope` their shape and dtype (a ShapeDtypeStruct)."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    if D & (D - 1) or D < 16:
        raise ValueError(f"decode_attention: head dim {D} must be a power of two >= 16")
    block_k = fit_block_k(layout, block_k)
    check_block_k(layout, block_k)
    if num_splits is None:
        num_splits = default_num_splits(B, Hkv, layout.num_keys, block_k)
    rows = max(16, pl.next_power_of_2(T * G))
    kv_len = jnp.minimum(kv_len.astype(jnp.int32), layout.num_keys)  # never read past the cache

    # Query rows of one KV head, token-major: row t*G + g is token t of query head kv_head*G + g.
    row_pos = jnp.repeat(q_pos.astype(jnp.int32), G, axis=1)
    row_pos = jnp.pad(row_pos, ((0, 0), (0, rows - T * G)), constant_values=-1)
    q_spec = pl.BlockSpec((None, Hq, D), lambda s, h, b: (b, 0, 0))
    if rope is not None:
        # The queries are built in the kernel (into a scratch output), from the product's parts.
        group = G
        heads = rope.parts.reshape(*rope.parts.shape[:2], -1, D)
        views = [rope.inv_freq.astype(jnp.float32), split_view(heads, rope.pairing)]
        if rope.bias is not None:
            views.append(split_view(rope.bias.reshape(-1, D), rope.pairing))
        whole = lambda x: pl.BlockSpec(x.shape, lambda s, h, b, n=x.ndim: (0,) * n)  # noqa: E731
        q_args = [q_pos[:, 0].astype(jnp.int32), *views]
        q_specs = [pl.BlockSpec((None,), lambda s, h, b: (b,)), *map(whole, views)]
    elif T == 1:
        # One token: the kernel reads its heads [Hq, D] in place and, with one split, writes
        # the normalized output in the same layout: no padding, transposes or combine step.
        group = G
        q_args = [q_pos[:, 0].astype(jnp.int32), q[:, 0]]
        q_specs = [pl.BlockSpec((None,), lambda s, h, b: (b,)), q_spec]
    else:
        group = None
        q_rows = q.reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, T * G, D)
        q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - T * G), (0, 0)))
        q_args = [row_pos, q_rows]
        q_specs = [pl.BlockSpec((None, rows), lambda s, h, b: (b, 0)),
                   pl.BlockSpec((None, None, rows, D), lambda s, h, b: (b, h, 0, 0))]

    if layout.paged:
        kv_spec = pl.BlockSpec((k.shape[0], None, layout.page_size, D), lambda s, h, b: (0, h, 0, 0))
        extra_specs = [pl.BlockSpec((None, table.shape[1]), lambda s, h, b: (b, 0))]
        extra_args = [table.astype(jnp.int32)]
    else:
        kv_spec = pl.BlockSpec((None, None, k.shape[2], D), lambda s, h, b: (b, h, 0, 0))
        extra_specs, extra_args = [], []
    attend_kw = dict(layout=layout, scale=float(scale), window=window, block_k=block_k, num_splits=num_splits,
                     group=group)
    if rope is None:
        kernel = functools.partial(_kernel, **attend_kw)
    else:
        kernel = functools.partial(_rope_append_kernel, has_bias=rope.bias is not None, n_heads=Hq,
                                   n_parts=rope.parts.shape[0], pairing=rope.pairing, interpret=interpret, **attend_kw)
    direct = group is not None and num_splits == 1
    part = (B, Hkv, num_splits, rows)
    if direct:
        out_specs = [pl.BlockSpec((None, Hq, D), lambda s, h, b: (b, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct((B, Hq, D), q.dtype)]
    else:
        out_specs = [
            pl.BlockSpec((None, None, None, rows, D), lambda s, h, b: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda s, h, b: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, rows), lambda s, h, b: (b, h, s, 0)),
        ]
        out_shape = [jax.ShapeDtypeStruct(part + (D,), jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32)]
    aliases = {}
    if rope is not None:
        # The caches come back as outputs aliased to them (updated in place), then the queries.
        n_in, n_out = 1 + len(q_args), len(out_shape)
        aliases = {n_in: n_out, n_in + 1: n_out + 1}
        out_specs = [*out_specs, kv_spec, kv_spec, q_spec]
        out_shape = [*out_shape, jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
                     jax.ShapeDtypeStruct((B, Hq, D), q.dtype)]
    outs = pl.pallas_call(
        kernel,
        grid=(num_splits, Hkv, B),
        in_specs=[pl.BlockSpec((None,), lambda s, h, b: (b,)), *q_specs, kv_spec, kv_spec, *extra_specs],
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="rjax_decode_attention" if rope is None else "rjax_decode_rope_attention",
    )(kv_len, *q_args, k, v, *extra_args)
    caches = ()
    if rope is not None:
        caches, outs = tuple(outs[-3:-1]), outs[:-3]
    if direct:
        out = outs[0][:, None]
    else:
        out = _combine(*outs, row_pos, kv_len, window)[:, :, : T * G]
        out = out.reshape(B, Hkv, T, G, D).transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, D).astype(q.dtype)
    return (out, *caches) if rope is not None else out


def _tiles(D, block_k, num_warps, num_stages):
    t = default_tiles(D)
    given = dict(block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    t.update({name: val for name, val in given.items() if val is not None})
    return t


_STATIC = ("scale", "window", "block_k", "num_splits", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def decode_attention(q, k, v, q_pos, kv_len, *, scale: float, window: int | None = None,
                     block_k: int | None = None, num_splits: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, interpret: bool = False):
    """Attention of q [B, T, Hq, D] (T small) over the contiguous cache k, v [B, Hkv, S, D]."""
    check_shapes(q, k, v, q_pos, kv_len)
    layout = CacheLayout(num_keys=k.shape[2])
    return _call(q, k, v, None, q_pos, kv_len, layout, scale=scale, window=window, num_splits=num_splits,
                 interpret=interpret, **_tiles(q.shape[-1], block_k, num_warps, num_stages))


@functools.partial(jax.jit, static_argnames=_STATIC + ("n_heads", "pairing", "dtype"))
def decode_rope_attention(parts, bias, pos, k_cache, v_cache, inv_freq, *, n_heads: int, pairing: str, dtype,
                          scale: float, window: int | None = None, block_k: int | None = None,
                          num_splits: int | None = None, num_warps: int | None = None,
                          num_stages: int | None = None, interpret: bool = False):
    """One decode token per sequence, from its QKV product to its attention output in one kernel:
    the rotation of q and k and the append of k, v at `pos` [B] (-1: an inactive sequence, nothing
    written) into the contiguous caches [B, Hkv, S, D] (row b is sequence b), as
    `kv_append.rope_append`, then `decode_attention` over positions 0..pos. parts [S, B, (Hq + 2
    Hkv) D] are the product's float32 partial sums, bias [(Hq + 2 Hkv) D] or None, and `dtype` the
    compute dtype they are rounded to. -> (out [B, 1, Hq, D] in `dtype`, k_cache, v_cache)."""
    n_parts, B, n = parts.shape
    n_slots, n_kv, _, D = k_cache.shape
    if n_slots != B or n != (n_heads + 2 * n_kv) * D or n_heads % n_kv or D % 2:
        raise ValueError(f"decode_rope_attention: a product of {n} columns for {B} sequences does not match "
                         f"{n_heads} query heads and a cache of {k_cache.shape}")
    layout = CacheLayout(num_keys=k_cache.shape[2])
    pos = pos.astype(jnp.int32)
    q = jax.ShapeDtypeStruct((B, 1, n_heads, D), jnp.dtype(dtype))
    return _call(q, k_cache, v_cache, None, pos[:, None], pos + 1, layout, scale=scale, window=window,
                 num_splits=num_splits, interpret=interpret, rope=RopeAppend(parts, bias, inv_freq, pairing),
                 **_tiles(D, block_k, num_warps, num_stages))


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_decode_attention(q, k_pages, v_pages, block_tables, q_pos, kv_len, *, scale: float,
                           window: int | None = None, block_k: int | None = None, num_splits: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = None,
                           interpret: bool = False):
    """Attention of q [B, T, Hq, D] (T small) over the paged cache k_pages, v_pages [P, Hkv, page_size, D]."""
    check_shapes(q, k_pages, v_pages, q_pos, kv_len, k_name="k_pages", v_name="v_pages")
    P, _, page_size, D = k_pages.shape
    if block_tables.ndim != 2 or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"paged_decode_attention: block_tables must be [B={q.shape[0]}, max_pages], "
                         f"got {block_tables.shape}")
    layout = CacheLayout(num_keys=block_tables.shape[1] * page_size, page_size=page_size, num_pages=P)
    tiles = _tiles(D, block_k, num_warps, num_stages)
    if block_k is None and 64 <= page_size < tiles["block_k"]:
        # One page per block reads a plain slice instead of gathering rows from several pages:
        # 103 us vs 109 us at B=8, ctx 8k, page_size 64 on the H100.
        tiles["block_k"] = page_size
    return _call(q, k_pages, v_pages, block_tables, q_pos, kv_len, layout, scale=scale, window=window,
                 num_splits=num_splits, interpret=interpret, **tiles)
