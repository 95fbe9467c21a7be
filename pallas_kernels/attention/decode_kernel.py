"""The decode attention kernel's body (Pallas, lowered by Triton): one program's walk over its
split of the cache, its query rows, and the merge of the splits' partials; and the fused
prologue that rotates and appends the token first (decode.py describes the design and launches
the programs)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.int8_activations import kernel as q8
from pallas_kernels.kv_quant import kind_of

from . import flash
from .decode_prologue import ProductRows, quantize_row
from .decode_tiling import group_rows, n_outputs, token_rows
from .kv_blocks import CacheLayout, load_block, load_scales, to_compute, walk_cache, widen, widened_unit


def attend_kernel(kv_len_ref, row_pos_ref, q_ref, k_ref, v_ref, *rest, layout: CacheLayout, scale: float,
            window: int | None, block_k: int, num_splits: int, group: int | None, interpret: bool,
            quantize_out: bool = False, quant: str | None = None, tokens: tuple[int, int] | None = None,
            merged: bool = False):
    """group: None, q_ref holds the program's KV head's queries [T, G, D] and row_pos_ref the
    tokens' positions [T] (tokens: (T, G)); they are read as the rows of a [Tp, Gp] grid
    (`token_rows`), padding masked. Else (one query token) q_ref is the token's [Hq, D] heads,
    of which this KV head's `group` rows are read (rows past them masked), and row_pos_ref the
    token's position.
    rest: the K and V scales (quant: "entry" or "head"), the page table (paged layout), the
    arrival counts' input (merged), then the outputs."""
    scales = None
    if quant is not None:
        scales, rest = (rest[0], rest[1], quant), rest[2:]
    table_ref = rest[0] if layout.paged else None
    if group is None:
        T, G = tokens
        Tp, Gp = token_rows(T, G)
        t = jax.lax.broadcasted_iota(jnp.int32, (Tp,), 0)
        g = jax.lax.broadcasted_iota(jnp.int32, (Gp,), 0)
        real = (t < T)[:, None] & (g < G)[None, :]
        token_pos = pltriton.load(row_pos_ref.at[pl.ds(0, Tp)], mask=t < T, other=-1)
        pos = jnp.where(real, token_pos[:, None], -1).reshape(Tp * Gp)
        q = pltriton.load(q_ref.at[pl.ds(0, Tp), pl.ds(0, Gp), :], mask=real[:, :, None], other=0)
        q = q.reshape(Tp * Gp, q.shape[-1])
    else:
        rows, r = group_rows(group)
        pos = jnp.where(r < group, row_pos_ref[()], -1)
        q = pltriton.load(q_ref.at[pl.ds(pl.program_id(1) * group, rows), :], mask=(r < group)[:, None], other=0)
    _attend(kv_len_ref[()], pos, q, k_ref, v_ref, table_ref, rest[-n_outputs(merged, num_splits, quantize_out):],
            layout=layout, scale=scale, window=window, block_k=block_k, num_splits=num_splits, group=group,
            interpret=interpret, quantize_out=quantize_out, scales=scales, tokens=tokens)


def rope_attend_kernel(kv_len_ref, pos_ref, inv_ref, parts_ref, *refs, has_bias: bool, has_norm: bool, eps: float,
                        n_heads: int, n_parts: int, pairing: str, q_dtype, interpret: bool, layout: CacheLayout,
                        scale: float, window: int | None, block_k: int, num_splits: int, group: int,
                        quantize_out: bool = False, merged: bool = True, quant: str | None = None):
    """One decode token per sequence: `kv_append`'s pass, then the attention, in one program.

    The program of (split, KV head h, sequence b) builds its group's rotated query rows from the
    QKV product's partial sums in registers (every split builds the same), attends over the
    cached keys before the token's position, and the last split also folds in the token's own
    key and value from registers and writes them into the cache (k_ref, v_ref: the outputs
    aliased to the donated caches). No program reads what this call writes, so the cache loads
    wait on nothing but the position. With "halves" pairing the key cache is in the halves view
    [S, 2, D/2] and the scores are the sum of the two halves' products, so no rotated row is
    reassembled; with "pairs" the query halves are interleaved into [R, D] in registers.
    A quantized cache (quant "entry": int8, its per-entry scales written beside the values;
    "head": fp8 with per-head scales) gets the token's key and value quantized as kv_append
    writes them, and the fold takes the values the cache then holds. A paged cache (the KV
    head's pool [P, page_size, ...] and the sequence's block table) takes the token on the page
    its table names for the position, at the position's offset there; a position whose page
    the sequence does not own (table entry < 0) is not written."""
    bias_ref = refs[0] if has_bias else None
    refs = refs[1:] if has_bias else refs
    norm_refs = tuple(refs[:2]) if has_norm else None  # the q and k norm weights
    refs = refs[2:] if has_norm else refs
    # refs: the caches, their scales (quantized), the block table (paged) and (merged) the
    # arrival counts as inputs (aliased where written), the attention's outputs, then the
    # caches and an int8 cache's scales as outputs.
    n_caches = 4 if quant == "entry" else 2
    out_refs = refs[-n_caches - n_outputs(merged, num_splits, quantize_out):-n_caches]
    k_ref, v_ref = refs[-n_caches:][:2]
    scales = None
    if quant == "entry":
        scales = (*refs[-2:], quant)
    elif quant == "head":
        scales = (refs[2], refs[3], quant)
    table_ref = refs[2 + 2 * (quant is not None)] if layout.paged else None
    split, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    pos, kv_len = pos_ref[()], kv_len_ref[()]
    product = ProductRows(parts_ref, bias_ref, inv_ref, b, pos, n_parts=n_parts, pairing=pairing, dtype=q_dtype,
                          norm_refs=norm_refs, eps=eps)
    rows, r = group_rows(group)
    q1, q2 = product.rotated_rows(h * group, rows, r < group)
    halves = pairing == "halves"
    q = (q1.astype(q_dtype), q2.astype(q_dtype)) if halves else _interleave(q1, q2).astype(q_dtype)

    n_kv = pl.num_programs(1)
    k_halves = list(product.rotated(n_heads + h, key=True))
    v_halves = [product.half(n_heads + n_kv + h, j) for j in range(2)]
    owner = (split == num_splits - 1) & (pos >= 0) & (pos < layout.num_keys)  # past the cache: write nothing
    at = jnp.maximum(pos, 0)
    if layout.paged:
        ps = layout.page_size
        page = table_ref[jnp.minimum(at // ps, layout.num_keys // ps - 1)]
        owner &= page >= 0
        where = (jnp.maximum(page, 0), at % ps)
    else:
        where = (at,)
    if scales is None:
        k_halves = [x.astype(k_ref.dtype) for x in k_halves]
        v_halves = [x.astype(v_ref.dtype) for x in v_halves]
        k_fold, v_fold = k_halves, v_halves
    else:
        head = (scales[0][()], scales[1][()]) if quant == "head" else (None, None)
        k_halves, k_scale, k_fold = quantize_row(k_halves, kind_of(k_ref.dtype), head[0], q_dtype)
        v_halves, v_scale, v_fold = quantize_row(v_halves, kind_of(v_ref.dtype), head[1], q_dtype)
        if quant == "entry":
            one, entry = jnp.broadcast_to(owner, (1,)), (*where[:-1], pl.ds(where[-1], 1))
            pltriton.store(scales[0].at[entry], jnp.broadcast_to(k_scale, (1,)), mask=one)
            pltriton.store(scales[1].at[entry], jnp.broadcast_to(v_scale, (1,)), mask=one)
    write = jnp.broadcast_to(owner, k_halves[0].shape)
    if halves:
        for j, half in enumerate(k_halves):
            pltriton.store(k_ref.at[(*where, jnp.int32(j), slice(None))], half.astype(k_ref.dtype), mask=write)
        k_new = tuple(k_fold)
    else:
        k_row = product.row(k_halves).astype(k_ref.dtype)
        pltriton.store(k_ref.at[(*where, slice(None))], k_row, mask=jnp.broadcast_to(owner, k_row.shape))
        k_new = product.row(k_fold)
    v_row = product.row(v_halves).astype(v_ref.dtype)
    pltriton.store(v_ref.at[(*where, slice(None))], v_row, mask=jnp.broadcast_to(owner, v_row.shape))
    cached = jnp.minimum(kv_len, at)  # the keys before the token's position
    _attend(cached, jnp.where(r < group, pos, -1), q, k_ref, v_ref, table_ref, out_refs, layout=layout, scale=scale,
            window=window, block_k=block_k, num_splits=num_splits, group=group, interpret=interpret,
            quantize_out=quantize_out, scales=scales, new_key=(owner, k_new, product.row(v_fold)))


def _interleave(a, b):
    """[R, n] pieces a, b -> [R, 2n] with a in the even and b in the odd columns (a Triton join)."""
    return jnp.stack([a, b], axis=-1).reshape(a.shape[0], 2 * a.shape[1])


def _split_range(pos, kv_len, block_k: int, window: int | None, num_splits: int, split):
    """(block ranges, first block, blocks per split) of split `split` for query rows `pos`."""
    ranges = flash.block_ranges(pos, kv_len, block_k, window)
    per_split = flash.idiv(ranges.hi - ranges.lo + (num_splits - 1), num_splits)
    return ranges, ranges.lo + split * per_split, per_split


def _attend(kv_len, pos, q, k_ref, v_ref, table_ref, out_refs, *, layout: CacheLayout, scale: float,
            window: int | None, block_k: int, num_splits: int, group: int | None, interpret: bool,
            new_key=None, quantize_out: bool = False, scales=None, tokens: tuple[int, int] | None = None):
    """The program's attention over its split of the cache, written to `out_refs` (see attend_kernel).

    pos [R]: the query rows' positions (-1: padding); q [R, D], or its two rotation halves with
    k_ref in the halves view (see rope_attend_kernel). new_key: (fold, k, v), a key and value at
    the rows' position that the cache does not hold yet, folded in where `fold` is true.
    scales: (k scale ref, v scale ref, "entry" | "head") for a quantized cache, else None."""
    split, kv_head = pl.program_id(0), pl.program_id(1)
    halves = isinstance(q, tuple)
    rows = (q[0] if halves else q).shape[0]
    qk_scale = scale * flash.LOG2E
    head_scales = None
    if scales is not None:
        q = to_compute(q)
        if scales[2] == "head":
            unit = widened_unit(k_ref.dtype, (q[0] if halves else q).dtype, interpret)
            head_scales = (scales[0][()] / unit, scales[1][()] / unit)

    def step(block, state, masked, pages):
        start = block * block_k
        if halves:
            k = tuple(load_block(k_ref, table_ref, start, block_k, layout, bounds_check=masked, half=j, pages=pages)
                      for j in range(2))
        else:
            k = load_block(k_ref, table_ref, start, block_k, layout, bounds_check=masked, pages=pages)
        v = load_block(v_ref, table_ref, start, block_k, layout, bounds_check=masked, pages=pages)
        mask = flash.visibility(pos, start, block_k, kv_len, window) if masked else None
        if scales is None:
            return flash.attend_block(state, q, k, v, qk_scale=qk_scale, mask=mask)
        if head_scales is None:
            ks, vs = (load_scales(r, table_ref, start, block_k, layout, bounds_check=masked, pages=pages)
                      for r in scales[:2])
        else:
            ks, vs = head_scales
        dt = (q[0] if halves else q).dtype
        return flash.attend_block(state, q, widen(k, dt, interpret), widen(v, dt, interpret), qk_scale=qk_scale,
                                  mask=mask, k_scale=ks, v_scale=vs)

    ranges, first, per_split = _split_range(pos, kv_len, block_k, window, num_splits, split)
    state = flash.init_state(rows, v_ref.shape[-1])
    state = walk_cache(ranges, state, step, table_ref, block_k, layout, within=(first, first + per_split))
    if new_key is not None:
        fold, k_new, v_new = new_key
        state = flash.attend_key(state, q, k_new, v_new, qk_scale=qk_scale, rows=(pos >= 0) & fold)
    acc, m, l = state
    if group is not None:
        r = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
        first_row = pl.ds(kv_head * group, rows)
    if len(out_refs) == 1:
        # One split: the normalized rows go straight to the output, [Hq, D] for one token and
        # [T, Hq, D] for several (a row that sees no key has l == 0 and gets zeros), so no
        # combine step runs.
        (o_ref,) = out_refs
        if group is None:
            # A padding token's rows (pos -1 among real ones) walked the blocks unmasked: zeroed.
            out = flash.finish(state, pos, kv_len, window)
            T, G = tokens
            Tp, Gp = token_rows(T, G)
            t = jax.lax.broadcasted_iota(jnp.int32, (Tp, Gp, 1), 0)
            g = jax.lax.broadcasted_iota(jnp.int32, (Tp, Gp, 1), 1)
            pltriton.store(o_ref.at[pl.ds(0, Tp), pl.ds(kv_head * G, Gp), :],
                           out.reshape(Tp, Gp, -1).astype(o_ref.dtype), mask=(t < T) & (g < G))
            return
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        pltriton.store(o_ref.at[first_row, :], out.astype(o_ref.dtype), mask=(r < group)[:, None])
        return
    if len(out_refs) == 3:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l
        return
    # One token over several splits: every program leaves its partial in this head's slots, and
    # the one that arrives last merges them into the output. The barrier puts all of the
    # program's partial stores before the count's increment, whose release/acquire (at GPU
    # scope) makes the other programs' partials visible to the last one.
    # A program keeps only its group's rows (padded to a power of two, not to the matrix
    # tile's 16), packed split after split, so the last program reads every partial with one
    # load of a few KB instead of a chain of one load per split.
    *o_refs, acc_ref, m_ref, l_ref, count_ref = out_refs
    gp = pl.next_power_of_2(group)
    slot, keep = pl.ds(split * gp, rows), r < gp
    pltriton.store(acc_ref.at[slot, :], acc, mask=keep[:, None])
    pltriton.store(m_ref.at[slot], m, mask=keep)
    pltriton.store(l_ref.at[slot], l, mask=keep)
    if not interpret:
        pltriton.debug_barrier()
    arrived = pltriton.atomic_add(count_ref, (jnp.int32(0),), jnp.int32(1))

    @pl.when(arrived == num_splits - 1)
    def _merge():
        n = pl.next_power_of_2(num_splits)
        real = jax.lax.broadcasted_iota(jnp.int32, (n * gp,), 0) < num_splits * gp
        load = functools.partial(pltriton.load, volatile=True)  # past L1, which other SMs do not update
        packed = pl.ds(0, n * gp)
        ms = load(m_ref.at[packed], mask=real, other=-jnp.inf).reshape(n, gp)
        ls = load(l_ref.at[packed], mask=real, other=0.0).reshape(n, gp)
        accs = load(acc_ref.at[packed, :], mask=real[:, None], other=0.0).reshape(n, gp, acc.shape[-1])
        m_max = jnp.max(ms, axis=0)
        m_max = jnp.where(m_max > -jnp.inf, m_max, 0.0)  # no split saw a key
        weights = jnp.where(ms > -jnp.inf, jnp.exp2(ms - m_max[None, :]), 0.0)
        den = jnp.sum(weights * ls, axis=0)
        den = jnp.where(den > 0, den, 1.0)[:, None]
        out = jnp.sum(weights[:, :, None] * accs, axis=0) / den
        g = jax.lax.broadcasted_iota(jnp.int32, (gp,), 0)
        out_rows = pl.ds(kv_head * group, gp)
        if quantize_out:  # the rows rounded to int8 per 32 values, for the output projection
            q8.store_quantized_rows(out, o_refs, out_rows, g < group, interpret)
        else:
            (o_ref,) = o_refs
            pltriton.store(o_ref.at[out_rows, :], out.astype(o_ref.dtype), mask=(g < group)[:, None])
        count_ref[0] = jnp.int32(0)  # every program has arrived: the count is free for the next call
