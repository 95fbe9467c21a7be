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
from pallas_kernels.int8_activations import kernel as q8
from pallas_kernels.kv_append.kernel import ProductRows, quantize_row, split_view
from pallas_kernels.kv_quant import check_scales, kind_of

from . import flash
from .kv_blocks import (CacheLayout, check_block_k, fit_block_k, load_block, load_scales, to_compute, walk_cache,
                        widen, widened_unit)
from .reference import check_shapes

NUM_SMS_H100 = 132
MAX_MERGED_SPLITS = 16  # see merged_split_limit


def default_tiles(head_dim: int, kind: str | None = None, paged_programs: int | None = None) -> dict:
    """Block size and launch shape measured best on the H100 (docs/kernels.md): 128 keys (64
    past head dim 128) in 3 stages; a quantized block (kind "int8" or "fp8"), half a 16-bit
    block's bytes, in 4. paged_programs: a paged cache's sequences x KV heads, else None.

    A quantized cache at head dim 128 takes 64-key blocks: the program's shared memory halves,
    so at batch 1 twice the splits run (`merged_split_limit`), two programs to an SM, one
    overlapping its arithmetic (casts, scales) with the other's loads.

    A paged cache (16-position pages; its pages looked up a block ahead, `kv_blocks.walk_cache`)
    takes 3 stages when quantized, and 128-key blocks except fp8 where 16 splits fill at most
    one wave (batch 1 of 8 KV heads). int8 gathers per-entry scales from the pages besides, so
    fewer, larger blocks win there; fp8 gains from the 64-key blocks' extra splits. Measurements:
    docs/kernels.md, "Quantized KV caches"."""
    quantized = kind is not None
    if paged_programs is None:
        small = quantized and head_dim == 128
    else:
        small = kind == "fp8" and head_dim == 128 and paged_programs * MAX_MERGED_SPLITS <= NUM_SMS_H100
    block_k = 64 if small or head_dim > 128 else 128
    return dict(block_k=block_k, num_warps=4, num_stages=_stages(quantized, paged_programs is not None))


def _stages(quantized: bool, paged: bool) -> int:
    return 4 if quantized and not paged else 3


def stages_for(blocks_per_split: int, head_dim: int, quantized: bool, num_splits: int = 1,
               paged: bool = False) -> int:
    """Pipeline stages: `default_tiles`' where a split walks several blocks; two where it walks
    one (a sliding window, or a short cache spread over many splits), where deeper stages only
    hold shared memory. Three for a quantized cache's batch-1 launch of more than 16 splits, where
    two programs share an SM (at batch 16, 2 splits, 4 stages stay faster). A paged cache:
    `default_tiles`. Measurements: docs/kernels.md, "One-token decode" (Stages) and "Quantized KV
    caches"."""
    if blocks_per_split <= 1:
        return 2
    if quantized and num_splits > MAX_MERGED_SPLITS:
        return 3
    return _stages(quantized, paged)


def merged_split_limit(quantized: bool, group: int, head_dim: int, block_k: int) -> int:
    """The most splits the in-kernel merge takes: 16, or 32 for a quantized cache's 64-key
    blocks at head dim 128 (`default_tiles`) with up to 4 query heads per KV head. The last
    program holds every split's partial rows (the group's, padded to a power of two) in
    registers: 32 x 4 x 128 floats, as 16 splits hold at head dim 256. A 16-bit cache was slower
    with 32 splits, and so were 32 splits of 128-key blocks (docs/kernels.md, "Quantized KV
    caches")."""
    if quantized and head_dim == 128 and block_k == 64 and pl.next_power_of_2(group) <= 4:
        return 2 * MAX_MERGED_SPLITS
    return MAX_MERGED_SPLITS


def default_num_splits(batch: int, kv_heads: int, num_keys: int, block_k: int, merged_in_kernel: bool,
                       quantized: bool = False, limit: int = MAX_MERGED_SPLITS) -> int:
    """Merged in the kernel (one query token): up to one wave of programs, down to one key block
    per split. At batch 1 the time is the latency of a program's chain of blocks, which more,
    shorter splits cut. Beyond one wave the extra programs and partials cost more than they save.

    Merged by XLA: about two waves, and at least 4 blocks per split: there the extra partials
    cost two more launches, and one block per split decoded slower end to end.

    A quantized cache, merged in the kernel: up to two waves. Its programs spend more of each
    block on arithmetic (casts, scales) per byte, and two of them per SM overlap one's
    arithmetic with the other's loads. Measurements: docs/kernels.md, "One-token decode"."""
    programs = batch * kv_heads
    if merged_in_kernel:
        waves = 2 if quantized else 1
        return max(1, min(waves * NUM_SMS_H100 // programs, num_keys // block_k, limit))
    return max(1, min(pl.cdiv(2 * NUM_SMS_H100, programs), num_keys // (4 * block_k)))


def _n_outputs(merged: bool, num_splits: int, quantized: bool = False) -> int:
    """The attention outputs of a program: the output alone (one split); the output (or its
    four QuantizedX planes), the partials and the arrival count (one token, merged in the
    kernel); or the partials (several tokens over several splits, merged by XLA)."""
    if num_splits == 1:
        return 1
    return (8 if quantized else 5) if merged else 3


def merges_in_kernel(batch: int, kv_heads: int, visible_keys: int, block_k: int,
                     limit: int = MAX_MERGED_SPLITS) -> bool:
    """Whether one query token's splits are merged in the kernel rather than by an XLA step.

    The in-kernel merge takes at most `limit` splits (`merged_split_limit`). Where the batch's
    (sequence, KV head) programs at that many splits fill under half the GPU and each would walk a
    long run of blocks, the kernel leaves its partials to XLA's combine instead, which takes any
    number of splits (gemma3-1b's one KV head over a long cache). Over a short window, and for
    llama-8b's eight KV heads, the in-kernel merge stays faster (docs/kernels.md, "One-token
    decode")."""
    few = 2 * batch * kv_heads * limit < NUM_SMS_H100
    return not (few and visible_keys > 4 * limit * block_k)


def visible_keys(num_keys: int, window: int | None, block_k: int) -> int:
    """The most cache positions one query row reads: the cache, or its sliding window (which
    can straddle one more block)."""
    return num_keys if window is None else min(num_keys, window + block_k)


def _kernel(kv_len_ref, row_pos_ref, q_ref, k_ref, v_ref, *rest, layout: CacheLayout, scale: float,
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
        rows, r = _group_rows(group)
        pos = jnp.where(r < group, row_pos_ref[()], -1)
        q = pltriton.load(q_ref.at[pl.ds(pl.program_id(1) * group, rows), :], mask=(r < group)[:, None], other=0)
    _attend(kv_len_ref[()], pos, q, k_ref, v_ref, table_ref, rest[-_n_outputs(merged, num_splits, quantize_out):],
            layout=layout, scale=scale, window=window, block_k=block_k, num_splits=num_splits, group=group,
            interpret=interpret, quantize_out=quantize_out, scales=scales, tokens=tokens)


def _rope_append_kernel(kv_len_ref, pos_ref, inv_ref, parts_ref, *refs, has_bias: bool, has_norm: bool, eps: float,
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
    out_refs = refs[-n_caches - _n_outputs(merged, num_splits, quantize_out):-n_caches]
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
    rows, r = _group_rows(group)
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


def token_rows(T: int, G: int) -> tuple[int, int]:
    """(Tp, Gp): several query tokens' rows form a [Tp, Gp] grid, row t * Gp + g for token t
    and head g of the group, padded to powers of two and to at least 16 rows (the matrix tile),
    so the kernel reads the queries in their own [T, G, D] layout, with no transpose or pad."""
    Gp = pl.next_power_of_2(G)
    return max(pl.next_power_of_2(T), pl.cdiv(16, Gp)), Gp


def _group_rows(group: int):
    rows = max(16, pl.next_power_of_2(group))
    return rows, jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)


def _attend(kv_len, pos, q, k_ref, v_ref, table_ref, out_refs, *, layout: CacheLayout, scale: float,
            window: int | None, block_k: int, num_splits: int, group: int | None, interpret: bool,
            new_key=None, quantize_out: bool = False, scales=None, tokens: tuple[int, int] | None = None):
    """The program's attention over its split of the cache, written to `out_refs` (see _kernel).

    pos [R]: the query rows' positions (-1: padding); q [R, D], or its two rotation halves with
    k_ref in the halves view (see _rope_append_kernel). new_key: (fold, k, v), a key and value at
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


def _merge_slots(group: int, num_splits: int) -> int:
    """Packed partial rows per KV head for the in-kernel merge: room for every split's slot (the
    last one stored as a whole masked [rows] tile) and for the merge's power-of-two load."""
    rows, _ = _group_rows(group)
    gp = pl.next_power_of_2(group)
    return max(pl.next_power_of_2(num_splits) * gp, (num_splits - 1) * gp + rows)


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
        # Several tokens: each program reads its KV head's [T, G, D] queries in place (see _kernel).
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
        k_arg = split_view(k, "halves")  # a bitcast; see _rope_append_kernel
        if layout.paged:
            k_spec = pl.BlockSpec((k.shape[0], None, layout.page_size, 2, D // 2), lambda s, h, b: (0, h, 0, 0, 0))
        else:
            k_spec = pl.BlockSpec((None, None, k.shape[2], 2, D // 2), lambda s, h, b: (b, h, 0, 0, 0))
    attend_kw = dict(layout=layout, scale=float(scale), window=window, block_k=block_k, num_splits=num_splits,
                     group=group, interpret=interpret, quantize_out=quantize_out, merged=merged)
    quant, scale_specs = _scale_specs(k_scale, layout)
    scale_args = [] if quant is None else [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)]
    if rope is None:
        kernel = functools.partial(_kernel, **attend_kw, quant=quant, tokens=(T, G))
    else:
        kernel = functools.partial(_rope_append_kernel, has_bias=rope.bias is not None,
                                   has_norm=rope.qk_norm is not None, eps=float(rope.eps), n_heads=Hq,
                                   n_parts=rope.parts.shape[0], pairing=rope.pairing, q_dtype=q.dtype, quant=quant,
                                   **attend_kw)
    n_out = _n_outputs(merged, num_splits, quantize_out)
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
        slots = _merge_slots(group, num_splits)
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
