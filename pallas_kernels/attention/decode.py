"""Decode attention: a few query tokens per sequence (1, or up to 16 when verifying drafts) over the cache.

Decoding reads the whole visible cache for very little arithmetic, so the kernel is built to stream
K/V at memory bandwidth:
- One program serves all G query heads of one KV head for all T query tokens: the query rows
  (one token: its G heads padded to >= 16 rows for the matrix units; several: a [T, G] grid with
  each side padded to a power of two, read from the queries' own layout) form one tile against
  each K/V block, so each cache block is read once, not G times.
- Split-K ("flash decoding"): the visible key range of each sequence is cut into `num_splits` equal
  runs of blocks handled by separate programs, so a small batch still fills the GPU; each program
  writes an unnormalized partial (acc, running max, running sum). With one query token, the last
  program of a KV head to finish (an atomic count per head says which) merges the partials and
  writes the output, so the step is one launch; with several tokens, or too few KV heads to fill
  the GPU at the in-kernel merge's split limit (`merges_in_kernel`), a small XLA step merges them.
- Key blocks no row can see (beyond kv_len, outside the window) are skipped; masks are applied only
  on edge blocks.
- A quantized cache (int8 per entry, fp8 per head; pallas_kernels/kv_quant.py) is read as it is stored: each
  block is cast in registers (to float16 for 16-bit queries: kv_blocks.compute_dtype) and its
  scales multiply the scores and the probabilities that weight V, so the step reads 1 byte per
  cached value plus the scales.
- `decode_rope_attention` runs kv_append's pass (the QKV product's partial sums summed, q and k
  normed per head where the model does so and rotated, k and v written into the cache, quantized
  for an int8 or fp8 one) as the prologue of the same programs, so a decode
  step spends one launch per layer on both: each program builds its group's rotated query rows
  in registers and attends over the keys before the token's position; the last split folds the
  token's own key and value in from registers and writes them into the cache.

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

from pallas_kernels.int8_activations import QuantizedX
from pallas_kernels.kv_append import split_view
from pallas_kernels.kv_quant import check_scales, kind_of

from . import flash
from .decode_kernel import attend_kernel, rope_attend_kernel
from .decode_tiling import (default_num_splits, default_tiles, merge_slots, merged_split_limit, merges_in_kernel,
                            n_outputs, stages_for, token_rows, visible_keys)
from .kv_blocks import CacheLayout, check_block_k, fit_block_k
from .reference import check_shapes


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
    qk_norm: tuple | None = None  # RMS norm weights (q [D], k [D]) applied before the rotation
    eps: float = 0.0


def _scale_specs(k_scale, layout: CacheLayout):
    """(quant kind, block specs) of a quantized cache's scales for the (split, KV head, sequence)
    grid: per entry, the program's row (contiguous [B, Hkv, S]) or its head's pages (paged
    [P, Hkv, page_size]); per head [Hkv], the program's scalar."""
    if k_scale is None:
        return None, []
    if k_scale.ndim == 1:
        spec = pl.BlockSpec((None,), lambda s, h, b: (h,))
        return "head", [spec, spec]
    if layout.paged:
        spec = pl.BlockSpec((k_scale.shape[0], None, layout.page_size), lambda s, h, b: (0, h, 0))
    else:
        spec = pl.BlockSpec((None, None, k_scale.shape[2]), lambda s, h, b: (b, h, 0))
    return "entry", [spec, spec]


def _call(q, k, v, table, q_pos, kv_len, layout: CacheLayout, *, scale, window, block_k, num_splits,
          num_warps, num_stages, interpret, rope: RopeAppend | None = None, arrivals=None, quantize_out=False,
          k_scale=None, v_scale=None):
    """q: the queries [B, T, Hq, D], or with `rope` their shape and dtype (a ShapeDtypeStruct).
    k_scale, v_scale: a quantized cache's scales (pallas_kernels/kv_quant.py), else None.
    arrivals: None or [B', Hkv] int32 zeros (B' >= B; rows past B unused) for the in-kernel
    merge (see below); with `rope`, returned after the caches (zeros again; as given when no
    merge ran). quantize_out: where the splits are merged in the kernel (`merges_in_kernel`),
    the output comes as a QuantizedX [B, 1] of the rows (Hq D) rounded to int8 per 32 values
    (D a multiple of 32)."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    if D & (D - 1) or D < 16:
        raise ValueError(f"decode_attention: head dim {D} must be a power of two >= 16")
    block_k = fit_block_k(layout, block_k)
    check_block_k(layout, block_k)
    visible = visible_keys(layout.num_keys, window, block_k)
    limit = merged_split_limit(k_scale is not None, G, D, block_k)
    merged = T == 1 and merges_in_kernel(B, Hkv, visible, block_k, limit)
    if num_splits is None:
        num_splits = default_num_splits(B, Hkv, visible, block_k, merged_in_kernel=merged,
                                        quantized=k_scale is not None, limit=limit)
    quantize_out = quantize_out and merged and num_splits > 1
    if num_stages is None:
        num_stages = stages_for(pl.cdiv(pl.cdiv(visible, block_k), num_splits), D, k_scale is not None, num_splits,
                                layout.paged)
    if quantize_out and D % 32:
        raise ValueError(f"decode_attention: quantize_out needs a head dim that is a multiple of 32, got {D}")
    Tp, Gp = token_rows(T, G)
    rows = Tp * Gp
    kv_len = jnp.minimum(kv_len.astype(jnp.int32), layout.num_keys)  # never read past the cache
    q_spec = pl.BlockSpec((None, Hq, D), lambda s, h, b: (b, 0, 0))
    if rope is not None:
        # The queries are built in the kernel's registers, from the product's parts.
        group = G
        heads = rope.parts.reshape(*rope.parts.shape[:2], -1, D)
        views = [rope.inv_freq.astype(jnp.float32), split_view(heads, rope.pairing)]
        if rope.bias is not None:
            views.append(split_view(rope.bias.reshape(-1, D), rope.pairing))
        if rope.qk_norm is not None:
            views += [split_view(w.astype(jnp.float32), rope.pairing) for w in rope.qk_norm]
        whole = lambda x: pl.BlockSpec(x.shape, lambda s, h, b, n=x.ndim: (0,) * n)  # noqa: E731
        q_args = [q_pos[:, 0].astype(jnp.int32), *views]
        q_specs = [pl.BlockSpec((None,), lambda s, h, b: (b,)), *map(whole, views)]
    elif merged:
        # One token: the kernel reads its heads [Hq, D] in place and, with one split, writes
        # the normalized output in the same layout: no padding, transposes or combine step.
        group = G
        q_args = [q_pos[:, 0].astype(jnp.int32), q[:, 0]]
        q_specs = [pl.BlockSpec((None,), lambda s, h, b: (b,)), q_spec]
    else:
        # Several tokens: each program reads its KV head's [T, G, D] queries in place (see attend_kernel).
        group = None
        q_args = [q_pos.astype(jnp.int32), q.reshape(B, T, Hkv, G, D)]
        q_specs = [pl.BlockSpec((None, T), lambda s, h, b: (b, 0)),
                   pl.BlockSpec((None, T, None, G, D), lambda s, h, b: (b, 0, h, 0, 0))]

    if layout.paged:
        kv_spec = pl.BlockSpec((k.shape[0], None, layout.page_size, D), lambda s, h, b: (0, h, 0, 0))
        extra_specs = [pl.BlockSpec((None, table.shape[1]), lambda s, h, b: (b, 0))]
        extra_args = [table.astype(jnp.int32)]
    else:
        kv_spec = pl.BlockSpec((None, None, k.shape[2], D), lambda s, h, b: (b, h, 0, 0))
        extra_specs, extra_args = [], []
    k_spec, k_arg = kv_spec, k
    if rope is not None and rope.pairing == "halves":
        k_arg = split_view(k, "halves")  # a bitcast; see rope_attend_kernel
        if layout.paged:
            k_spec = pl.BlockSpec((k.shape[0], None, layout.page_size, 2, D // 2), lambda s, h, b: (0, h, 0, 0, 0))
        else:
            k_spec = pl.BlockSpec((None, None, k.shape[2], 2, D // 2), lambda s, h, b: (b, h, 0, 0, 0))
    attend_kw = dict(layout=layout, scale=float(scale), window=window, block_k=block_k, num_splits=num_splits,
                     group=group, interpret=interpret, quantize_out=quantize_out, merged=merged)
    quant, scale_specs = _scale_specs(k_scale, layout)
    scale_args = [] if quant is None else [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)]
    if rope is None:
        kernel = functools.partial(attend_kernel, **attend_kw, quant=quant, tokens=(T, G))
    else:
        kernel = functools.partial(rope_attend_kernel, has_bias=rope.bias is not None,
                                   has_norm=rope.qk_norm is not None, eps=float(rope.eps), n_heads=Hq,
                                   n_parts=rope.parts.shape[0], pairing=rope.pairing, q_dtype=q.dtype, quant=quant,
                                   **attend_kw)
    n_out = n_outputs(merged, num_splits, quantize_out)
    o_spec = pl.BlockSpec((None, Hq, D), lambda s, h, b: (b, 0, 0))
    o_shape = jax.ShapeDtypeStruct((B, Hq, D), q.dtype)
    if group is None:  # several tokens: [B, T, Hq, D], written whole where one split runs
        o_spec = pl.BlockSpec((None, T, Hq, D), lambda s, h, b: (b, 0, 0, 0))
        o_shape = jax.ShapeDtypeStruct((B, T, Hq, D), q.dtype)
    aliases = {}
    if n_out == 1:
        out_specs, out_shape = [o_spec], [o_shape]
    elif n_out == 3:
        out_specs = [
            pl.BlockSpec((None, None, None, rows, D), lambda s, h, b: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda s, h, b: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, rows), lambda s, h, b: (b, h, s, 0)),
        ]
        part = (B, Hkv, num_splits, rows)
        out_shape = [jax.ShapeDtypeStruct(part + (D,), jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32),
                     jax.ShapeDtypeStruct(part, jnp.float32)]
    else:
        # Each program sees all of its head's partial slots (the last one reads them all), and
        # the head's arrival count, aliased in place: zero on entry, and reset to zero by the
        # last program. A caller that keeps `arrivals` across calls (the KV cache does) spares
        # XLA a copy of fresh zeros at every call.
        count_spec = pl.BlockSpec((None, 1), lambda s, h, b: (b, h))
        slots = merge_slots(group, num_splits)
        acc_spec = pl.BlockSpec((None, None, slots, D), lambda s, h, b: (b, h, 0, 0))
        o_specs, o_shapes = [o_spec], [o_shape]
        if quantize_out:
            # QuantizedX planes per head row: words [Hq, D/4], d and dsum32 [Hq, D/32], dsum16
            # [Hq, D/16].
            o_shapes = [jax.ShapeDtypeStruct((B, Hq, D // c), dt) for c, dt in
                        ((4, jnp.int32), (32, jnp.float32), (32, jnp.float32), (16, jnp.float32))]
            o_specs = [pl.BlockSpec((None, Hq, x.shape[-1]), lambda s, h, b: (b, 0, 0)) for x in o_shapes]
        out_specs = [
            *o_specs,
            acc_spec,
            pl.BlockSpec((None, None, slots), lambda s, h, b: (b, h, 0)),
            pl.BlockSpec((None, None, slots), lambda s, h, b: (b, h, 0)),
            count_spec,
        ]
        packed = (B, Hkv, slots)
        # The counts as given: a paged cache keeps one row per slot, of which a call runs the first B.
        counts = (B, Hkv) if arrivals is None else arrivals.shape
        out_shape = [*o_shapes, jax.ShapeDtypeStruct(packed + (D,), jnp.float32),
                     jax.ShapeDtypeStruct(packed, jnp.float32), jax.ShapeDtypeStruct(packed, jnp.float32),
                     jax.ShapeDtypeStruct(counts, jnp.int32)]
        extra_specs = [*extra_specs, count_spec]
        extra_args = [*extra_args, jnp.zeros((B, Hkv), jnp.int32) if arrivals is None else arrivals]
        aliases[1 + len(q_args) + 2 + len(scale_args) + len(extra_args) - 1] = n_out - 1
    if rope is not None:
        # The caches (and an int8 cache's scales, which the call writes) come back as outputs
        # aliased to them (updated in place).
        n_in = 1 + len(q_args)
        aliases.update({n_in: n_out, n_in + 1: n_out + 1})
        out_specs = [*out_specs, k_spec, kv_spec]
        out_shape = [*out_shape, jax.ShapeDtypeStruct(k_arg.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
        if quant == "entry":
            aliases.update({n_in + 2: n_out + 2, n_in + 3: n_out + 3})
            out_specs = [*out_specs, *scale_specs]
            out_shape = [*out_shape, *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in scale_args)]
    outs = pl.pallas_call(
        kernel,
        grid=(num_splits, Hkv, B),
        in_specs=[pl.BlockSpec((None,), lambda s, h, b: (b,)), *q_specs, k_spec, kv_spec, *scale_specs,
                  *extra_specs],
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="rjax_decode_attention" if rope is None else "rjax_decode_rope_attention",
    )(kv_len, *q_args, k_arg, v, *scale_args, *extra_args)
    caches = ()
    if rope is not None:
        written_scales = (outs[-2], outs[-1]) if quant == "entry" else (k_scale, v_scale)
        outs = outs[:-2] if quant == "entry" else outs
        caches = (outs[-2].reshape(k.shape), outs[-1], outs[n_out - 1] if n_out >= 5 else arrivals, *written_scales)
        outs = outs[:-2]
    if quantize_out:
        words, d, dsum32, dsum16 = (x.reshape(B, 1, -1) for x in outs[:4])
        out = QuantizedX(words, d, dsum32, dsum16, jnp.dtype(q.dtype))
    elif n_out != 3:
        out = outs[0] if group is None else outs[0][:, None]
    else:
        row_pos = jnp.broadcast_to(jnp.pad(q_pos.astype(jnp.int32), ((0, 0), (0, Tp - T)), constant_values=-1)[:, :, None],
                                   (B, Tp, Gp)).reshape(B, rows)
        out = _combine(*outs, row_pos, kv_len, window).reshape(B, Hkv, Tp, Gp, D)[:, :, :T, :G]
        out = out.transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, D).astype(q.dtype)
    return (out, *caches) if rope is not None else out


def _tiles(D, block_k, num_warps, num_stages, kind=None, paged_programs=None):
    """The launch shape: the given values over the defaults, except the stages, which `_call`
    picks when not given (they depend on the blocks a split walks)."""
    t = default_tiles(D, kind, paged_programs)
    given = dict(block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    t.update({name: val for name, val in given.items() if val is not None})
    t["num_stages"] = num_stages
    return t


_STATIC = ("scale", "window", "block_k", "num_splits", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def decode_attention(q, k, v, q_pos, kv_len, *, scale: float, window: int | None = None,
                     block_k: int | None = None, num_splits: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, interpret: bool = False, k_scale=None, v_scale=None):
    """Attention of q [B, T, Hq, D] (T small) over the contiguous cache k, v [B, Hkv, S, D]
    (float, or int8 / fp8 with k_scale, v_scale: see pallas_kernels/kv_quant.py)."""
    check_shapes(q, k, v, q_pos, kv_len, k_scale=k_scale, v_scale=v_scale)
    layout = CacheLayout(num_keys=k.shape[2])
    return _call(q, k, v, None, q_pos, kv_len, layout, scale=scale, window=window, num_splits=num_splits,
                 interpret=interpret, k_scale=k_scale, v_scale=v_scale,
                 **_tiles(q.shape[-1], block_k, num_warps, num_stages, kind_of(k.dtype)))


@functools.partial(jax.jit, static_argnames=_STATIC + ("n_heads", "pairing", "dtype", "quantize_out", "eps"))
def decode_rope_attention(parts, bias, pos, k_cache, v_cache, inv_freq, *, n_heads: int, pairing: str, dtype,
                          scale: float, window: int | None = None, block_k: int | None = None,
                          num_splits: int | None = None, num_warps: int | None = None,
                          num_stages: int | None = None, interpret: bool = False, arrivals=None,
                          quantize_out: bool = False, qk_norm=None, eps: float = 0.0, k_scale=None, v_scale=None):
    """One decode token per sequence, from its QKV product to its attention output in one kernel:
    the rotation of q and k and the append of k, v at `pos` [B] (-1: an inactive sequence, nothing
    written) into the contiguous caches [B, Hkv, S, D] (row b is sequence b), as
    `kv_append.rope_append`, then `decode_attention` over positions 0..pos. parts [S, B, (Hq + 2
    Hkv) D] are the product's float32 partial sums, bias [(Hq + 2 Hkv) D] or None, and `dtype` the
    compute dtype they are rounded to; qk_norm: None, or the weights (q [D], k [D]) of an RMS norm
    (epsilon `eps`) of every query and key head before the rotation. arrivals: None, or [B, Hkv] int32 zeros that the split
    merge counts in and leaves zero (kept by the caller across calls, it saves a copy per call).
    quantize_out: hand the output over rounded to int8 (a QuantizedX [B, 1] of Hq D values, for an
    int8 output projection) where the kernel merges its splits; else as an array. A quantized
    cache (int8 or fp8, pallas_kernels/kv_quant.py) comes with its scales k_scale, v_scale, and
    the token's key and value are written quantized as kv_append writes them (an int8 cache's
    scales written beside them).
    -> (out [B, 1, Hq, D] in `dtype` or QuantizedX, k_cache, v_cache, arrivals, k_scale, v_scale)."""
    n_parts, B, n = parts.shape
    n_slots, n_kv, _, D = k_cache.shape
    if n_slots != B or n != (n_heads + 2 * n_kv) * D or n_heads % n_kv or D % 2:
        raise ValueError(f"decode_rope_attention: a product of {n} columns for {B} sequences does not match "
                         f"{n_heads} query heads and a cache of {k_cache.shape}")
    q = jax.ShapeDtypeStruct((B, 1, n_heads, D), jnp.dtype(dtype))
    check_scales(k_cache, k_scale, "k_cache")
    check_scales(v_cache, v_scale, "v_cache")
    layout = CacheLayout(num_keys=k_cache.shape[2])
    pos = pos.astype(jnp.int32)
    return _call(q, k_cache, v_cache, None, pos[:, None], pos + 1, layout, scale=scale, window=window,
                 num_splits=num_splits, interpret=interpret, rope=RopeAppend(parts, bias, inv_freq, pairing, qk_norm, eps),
                 arrivals=arrivals, quantize_out=quantize_out, k_scale=k_scale, v_scale=v_scale,
                 **_tiles(D, block_k, num_warps, num_stages, kind_of(k_cache.dtype)))


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_decode_attention(q, k_pages, v_pages, block_tables, q_pos, kv_len, *, scale: float,
                           window: int | None = None, block_k: int | None = None, num_splits: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = None,
                           interpret: bool = False, k_scale=None, v_scale=None):
    """Attention of q [B, T, Hq, D] (T small) over the paged cache k_pages, v_pages [P, Hkv, page_size, D]
    (float, or int8 / fp8 with k_scale, v_scale [P, Hkv, page_size] or [Hkv]: see pallas_kernels/kv_quant.py)."""
    check_shapes(q, k_pages, v_pages, q_pos, kv_len, k_name="k_pages", v_name="v_pages", k_scale=k_scale,
                 v_scale=v_scale)
    P, _, page_size, D = k_pages.shape
    if block_tables.ndim != 2 or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"paged_decode_attention: block_tables must be [B={q.shape[0]}, max_pages], "
                         f"got {block_tables.shape}")
    layout = CacheLayout(num_keys=block_tables.shape[1] * page_size, page_size=page_size, num_pages=P)
    tiles = _paged_tiles(D, block_k, num_warps, num_stages, kind_of(k_pages.dtype), q.shape[0] * k_pages.shape[1],
                         page_size)
    return _call(q, k_pages, v_pages, block_tables, q_pos, kv_len, layout, scale=scale, window=window,
                 num_splits=num_splits, interpret=interpret, k_scale=k_scale, v_scale=v_scale, **tiles)


def _paged_tiles(D, block_k, num_warps, num_stages, kind, programs: int, page_size: int) -> dict:
    tiles = _tiles(D, block_k, num_warps, num_stages, kind, programs)
    if block_k is None and 64 <= page_size < tiles["block_k"]:
        # One page per block reads a plain slice instead of gathering rows from several pages
        # (docs/kernels.md, "Decode").
        tiles["block_k"] = page_size
    return tiles


@functools.partial(jax.jit, static_argnames=_STATIC + ("n_heads", "pairing", "dtype", "quantize_out", "eps"))
def paged_decode_rope_attention(parts, bias, pos, k_pages, v_pages, block_tables, inv_freq, *, n_heads: int,
                                pairing: str, dtype, scale: float, window: int | None = None,
                                block_k: int | None = None, num_splits: int | None = None,
                                num_warps: int | None = None, num_stages: int | None = None,
                                interpret: bool = False, arrivals=None, quantize_out: bool = False, qk_norm=None,
                                eps: float = 0.0, k_scale=None, v_scale=None):
    """`decode_rope_attention` over a paged cache: the page pool k_pages, v_pages [P, Hkv,
    page_size, D] (float, or int8 / fp8 with k_scale, v_scale [P, Hkv, page_size] or [Hkv]) and
    block_tables [B, max_pages] (sequence b's positions i * page_size .. on page
    block_tables[b, i]; < 0 where it owns none). The token at pos [B] is written on the page its
    table names, at offset pos % page_size, unless the sequence owns no page there. arrivals:
    None, or [B', Hkv] int32 zeros with B' >= B (see decode_rope_attention).
    -> (out [B, 1, Hq, D] in `dtype` or QuantizedX, k_pages, v_pages, arrivals, k_scale, v_scale)."""
    n_parts, B, n = parts.shape
    P, n_kv, page_size, D = k_pages.shape
    if n != (n_heads + 2 * n_kv) * D or n_heads % n_kv or D % 2:
        raise ValueError(f"paged_decode_rope_attention: a product of {n} columns does not match {n_heads} query "
                         f"heads and pages of {k_pages.shape}")
    if block_tables.ndim != 2 or block_tables.shape[0] != B:
        raise ValueError(f"paged_decode_rope_attention: block_tables must be [B={B}, max_pages], "
                         f"got {block_tables.shape}")
    if arrivals is not None and (arrivals.shape[0] < B or arrivals.shape[1:] != (n_kv,)):
        raise ValueError(f"paged_decode_rope_attention: arrivals must be [>= {B}, {n_kv}], got {arrivals.shape}")
    check_scales(k_pages, k_scale, "k_pages")
    check_scales(v_pages, v_scale, "v_pages")
    q = jax.ShapeDtypeStruct((B, 1, n_heads, D), jnp.dtype(dtype))
    layout = CacheLayout(num_keys=block_tables.shape[1] * page_size, page_size=page_size, num_pages=P)
    pos = pos.astype(jnp.int32)
    tiles = _paged_tiles(D, block_k, num_warps, num_stages, kind_of(k_pages.dtype), B * n_kv, page_size)
    return _call(q, k_pages, v_pages, block_tables, pos[:, None], pos + 1, layout, scale=scale, window=window,
                 num_splits=num_splits, interpret=interpret,
                 rope=RopeAppend(parts, bias, inv_freq, pairing, qk_norm, eps), arrivals=arrivals,
                 quantize_out=quantize_out, k_scale=k_scale, v_scale=v_scale, **tiles)
