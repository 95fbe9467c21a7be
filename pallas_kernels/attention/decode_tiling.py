"""The decode attention kernel's launch shape: key block size, pipeline stages, how many splits
the cache is cut into and whether the kernel merges them itself, and the query rows a program
takes. Pure functions of the shapes (the measurements behind them: docs/kernels.md)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


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


def n_outputs(merged: bool, num_splits: int, quantized: bool = False) -> int:
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


def token_rows(T: int, G: int) -> tuple[int, int]:
    """(Tp, Gp): several query tokens' rows form a [Tp, Gp] grid, row t * Gp + g for token t
    and head g of the group, padded to powers of two and to at least 16 rows (the matrix tile),
    so the kernel reads the queries in their own [T, G, D] layout, with no transpose or pad."""
    Gp = pl.next_power_of_2(G)
    return max(pl.next_power_of_2(T), pl.cdiv(16, Gp)), Gp


def group_rows(group: int):
    rows = max(16, pl.next_power_of_2(group))
    return rows, jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)


def merge_slots(group: int, num_splits: int) -> int:
    """Packed partial rows per KV head for the in-kernel merge: room for every split's slot (the
    last one stored as a whole masked [rows] tile) and for the merge's power-of-two load."""
    rows, _ = group_rows(group)
    gp = pl.next_power_of_2(group)
    return max(pl.next_power_of_2(num_splits) * gp, (num_splits - 1) * gp + rows)
