"""Prefill attention: many query tokens per sequence against the KV cache, as one Pallas kernel.

One program computes one tile of `block_q` query rows of one query head of one sequence. It reads
the KV head of its query head straight from the cache (grouped-query attention reads, never copies,
the shared K/V), walks only the key blocks that some row of the tile can see (causal upper triangle,
outside the window and beyond kv_len are skipped), and applies a mask only on the edge blocks.
Programs are launched heaviest first (last query tiles see the most keys) so the causal tail does
not leave the GPU idle.

Lowering: Pallas's Triton lowering. On Hopper the contiguous bf16/f16 prefill goes to the Mosaic
GPU kernel in prefill_mgpu.py instead, which measured level with cuDNN where this one trails it
(docs/kernels.md, "Prefill"). This kernel stays the general path: the paged cache (per-block page
gathers are plain pointer loads in Triton), float32 inputs, head dims or cache lengths the Mosaic
kernel does not tile, and other GPUs; it also runs under `interpret=True` on the CPU, which the
tests rely on. Triton emits Hopper wgmma for the 16-bit products. It is also the prefill of a
quantized cache (int8 per entry, fp8 per head; pallas_kernels/kv_quant.py): each block is cast in registers
(to kv_blocks.compute_dtype) and its scales multiply the scores and the probabilities that weight V.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import flash
from .kv_blocks import (CacheLayout, check_block_k, fit_block_k, load_block, load_scales, to_compute, walk_cache,
                        widen, widened_unit)
from .reference import check_shapes


def default_tiles(head_dim: int) -> dict:
    """Tile sizes and launch shape measured on the H100 (docs/kernels.md)."""
    if head_dim <= 64:
        return dict(block_q=128, block_k=64, num_warps=4, num_stages=3)
    if head_dim <= 128:
        return dict(block_q=128, block_k=64, num_warps=8, num_stages=3)
    # 64/64/4 warps/2 stages is the D=256 tile checked against the reference on the H100.
    # 128/64/8 warps/2 stages timed faster (docs/kernels.md, "Prefill") but has not been checked
    # there; 3 stages overflow shared memory.
    return dict(block_q=64, block_k=64, num_warps=4, num_stages=2)


def _kernel(kv_len_ref, q_pos_ref, q_ref, k_ref, v_ref, *rest, layout: CacheLayout, scale: float,
            window: int | None, block_q: int, block_k: int, num_q_tiles: int, num_queries: int,
            quant: str | None = None, interpret: bool = False):
    """rest: the K and V scales (quant "entry" or "head"), the page table (paged), the output."""
    scales = None
    if quant is not None:
        scales, rest = rest[:2], rest[2:]
    *table_ref, o_ref = rest
    table_ref = table_ref[0] if table_ref else None
    tile = num_q_tiles - 1 - pl.program_id(1)  # heaviest tiles first
    ragged = num_queries % block_q != 0
    if ragged:
        in_range = tile * block_q + jnp.arange(block_q, dtype=jnp.int32) < num_queries
        pos = pltriton.load(q_pos_ref, mask=in_range, other=-1)
        q = pltriton.load(q_ref, mask=in_range[:, None], other=0)
    else:
        pos = q_pos_ref[...]
        q = q_ref[...]
    kv_len = kv_len_ref[()]
    qk_scale = scale * flash.LOG2E
    head_scales = None
    if quant is not None:
        q = to_compute(q)
        if quant == "head":
            unit = widened_unit(k_ref.dtype, q.dtype, interpret)
            head_scales = (scales[0][()] / unit, scales[1][()] / unit)

    def step(block, state, masked, pages):
        start = block * block_k
        k = load_block(k_ref, table_ref, start, block_k, layout, bounds_check=masked, pages=pages)
        v = load_block(v_ref, table_ref, start, block_k, layout, bounds_check=masked, pages=pages)
        mask = flash.visibility(pos, start, block_k, kv_len, window) if masked else None
        if quant is None:
            return flash.attend_block(state, q, k, v, qk_scale=qk_scale, mask=mask)
        if head_scales is None:
            ks, vs = (load_scales(r, table_ref, start, block_k, layout, bounds_check=masked, pages=pages)
                      for r in scales)
        else:
            ks, vs = head_scales
        return flash.attend_block(state, q, widen(k, q.dtype, interpret), widen(v, q.dtype, interpret),
                                  qk_scale=qk_scale, mask=mask, k_scale=ks, v_scale=vs)

    ranges = flash.block_ranges(pos, kv_len, block_k, window)
    state = walk_cache(ranges, flash.init_state(block_q, q.shape[-1]), step, table_ref, block_k, layout)
    out = flash.finish(state, pos, kv_len, window).astype(o_ref.dtype)
    if ragged:
        pltriton.store(o_ref, out, mask=in_range[:, None])
    else:
        o_ref[...] = out


def _call(q, k, v, table, q_pos, kv_len, layout: CacheLayout, *, scale, window, block_q, block_k,
          num_warps, num_stages, interpret, k_scale=None, v_scale=None):
    B, T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    if D & (D - 1) or D < 16:
        raise ValueError(f"prefill_attention: head dim {D} must be a power of two >= 16")
    block_k = fit_block_k(layout, block_k)
    check_block_k(layout, block_k)
    if block_q < 16 or block_q & (block_q - 1):
        raise ValueError(f"prefill_attention: block_q={block_q} must be a power of two >= 16")
    block_q = min(block_q, max(16, pl.next_power_of_2(T)))
    num_q_tiles = pl.cdiv(T, block_q)
    kv_len = jnp.minimum(kv_len.astype(jnp.int32), layout.num_keys)  # never read past the cache

    q_map = lambda h, i, b: (b, num_q_tiles - 1 - i, h, 0)
    if layout.paged:
        kv_spec = pl.BlockSpec((k.shape[0], None, layout.page_size, D), lambda h, i, b: (0, h // G, 0, 0))
        extra_specs = [pl.BlockSpec((None, table.shape[1]), lambda h, i, b: (b, 0))]
        extra_args = [table.astype(jnp.int32)]
    else:
        kv_spec = pl.BlockSpec((None, None, k.shape[2], D), lambda h, i, b: (b, h // G, 0, 0))
        extra_specs, extra_args = [], []
    quant, scale_specs, scale_args = None, [], []
    if k_scale is not None:
        if k_scale.ndim == 1:
            quant, spec = "head", pl.BlockSpec((None,), lambda h, i, b: (h // G,))
        elif layout.paged:
            quant, spec = "entry", pl.BlockSpec((k_scale.shape[0], None, layout.page_size),
                                                lambda h, i, b: (0, h // G, 0))
        else:
            quant, spec = "entry", pl.BlockSpec((None, None, k_scale.shape[2]), lambda h, i, b: (b, h // G, 0))
        scale_specs, scale_args = [spec, spec], [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)]
    kernel = functools.partial(
        _kernel, layout=layout, scale=float(scale), window=window, block_q=block_q, block_k=block_k,
        num_q_tiles=num_q_tiles, num_queries=T, quant=quant, interpret=interpret)
    return pl.pallas_call(
        kernel,
        grid=(Hq, num_q_tiles, B),
        in_specs=[
            pl.BlockSpec((None,), lambda h, i, b: (b,)),
            pl.BlockSpec((None, block_q), lambda h, i, b: (b, num_q_tiles - 1 - i)),
            pl.BlockSpec((None, block_q, None, D), q_map),
            kv_spec,
            kv_spec,
            *scale_specs,
            *extra_specs,
        ],
        out_specs=pl.BlockSpec((None, block_q, None, D), q_map),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="rjax_prefill_attention",
    )(kv_len, q_pos.astype(jnp.int32), q, k, v, *scale_args, *extra_args)


def _tiles(D, block_q, block_k, num_warps, num_stages):
    t = default_tiles(D)
    given = dict(block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    t.update({name: val for name, val in given.items() if val is not None})
    return t


_STATIC = ("scale", "window", "block_q", "block_k", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def prefill_attention(q, k, v, q_pos, kv_len, *, scale: float, window: int | None = None,
                      block_q: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                      num_stages: int | None = None, interpret: bool = False, k_scale=None, v_scale=None):
    """Attention of q [B, T, Hq, D] over the contiguous cache k, v [B, Hkv, S, D] (see reference.py;
    int8 / fp8 with k_scale, v_scale: pallas_kernels/kv_quant.py)."""
    check_shapes(q, k, v, q_pos, kv_len, k_scale=k_scale, v_scale=v_scale)
    layout = CacheLayout(num_keys=k.shape[2])
    return _call(q, k, v, None, q_pos, kv_len, layout, scale=scale, window=window, interpret=interpret,
                 k_scale=k_scale, v_scale=v_scale, **_tiles(q.shape[-1], block_q, block_k, num_warps, num_stages))


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_prefill_attention(q, k_pages, v_pages, block_tables, q_pos, kv_len, *, scale: float,
                            window: int | None = None, block_q: int | None = None, block_k: int | None = None,
                            num_warps: int | None = None, num_stages: int | None = None,
                            interpret: bool = False, k_scale=None, v_scale=None):
    """Attention of q [B, T, Hq, D] over the paged cache k_pages, v_pages [P, Hkv, page_size, D]
    (int8 / fp8 with k_scale, v_scale [P, Hkv, page_size] or [Hkv]: pallas_kernels/kv_quant.py)."""
    check_shapes(q, k_pages, v_pages, q_pos, kv_len, k_name="k_pages", v_name="v_pages", k_scale=k_scale,
                 v_scale=v_scale)
    P, _, page_size, D = k_pages.shape
    if block_tables.ndim != 2 or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"paged_prefill_attention: block_tables must be [B={q.shape[0]}, max_pages], "
                         f"got {block_tables.shape}")
    layout = CacheLayout(num_keys=block_tables.shape[1] * page_size, page_size=page_size, num_pages=P)
    tiles = _tiles(D, block_q, block_k, num_warps, num_stages)
    return _call(q, k_pages, v_pages, block_tables, q_pos, kv_len, layout, scale=scale, window=window,
                 interpret=interpret, k_scale=k_scale, v_scale=v_scale, **tiles)
