"""Prefill attention for Hopper (H100) through Pallas's Mosaic GPU lowering: TMA copies and wgmma.

Same contract as `prefill.prefill_attention` (see reference.py) for the contiguous cache, with
16-bit inputs (bf16 / f16), head dim a multiple of 64 up to 256 and a cache length S that is a
multiple of block_kv; `supports` says whether a call qualifies.

Structure of one program (CTA), which owns two tiles of `block_q` query rows of one query head:
- three warpgroups: two compute warpgroups, one per query tile, and one copy warpgroup that streams
  K/V blocks of the head's KV head (grouped-query attention reads the shared K/V, never copies it)
  through a ring of `stages` shared-memory slots with the TMA engine;
- each compute warpgroup runs Q @ K^T and P @ V on the tensor cores (wgmma, accumulators in
  registers) with the online softmax in between, and releases a slot through a barrier once both
  warpgroups are done with it;
- the key blocks each tile can see (causal, kv_len, window: `flash.block_ranges`) are computed in
  XLA before the launch; the copy warpgroup streams the union of the two tiles' ranges, each
  compute warpgroup masks only its edge blocks and steps over blocks outside its own range while
  still taking part in the barrier protocol;
- programs of the last query tiles (most keys) are launched first;
- the two compute warpgroups take turns (`ping_pong`), so one's softmax overlaps the other's
  matrix products.

Lowering: Mosaic GPU, chosen over the Triton-lowered kernel because it measured level with cuDNN
where that one trails it (docs/kernels.md, "Prefill"). On the CPU it runs in
the Mosaic GPU interpreter (`interpret=True`), where the P @ V product is staged through shared
memory because the interpreter takes wgmma operands from shared memory and fresh accumulators only.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import flash
from .reference import check_shapes

_COMPUTE_WGS = 2
_WG_ROWS = plgpu.Layout.WGMMA.reduce(1)  # layout of a per-row vector of a [rows, cols] wgmma tile


def default_tiles(head_dim: int) -> dict:
    """block_kv and ring depth that fit the 227 KB of shared memory per SM. Ping-pong measured no
    gain at head dim 256 (docs/kernels.md, "Prefill") and was only checked on the GPU up to 128:
    off there."""
    if head_dim <= 128:
        return dict(block_q=64, block_kv=128, stages=2, ping_pong=True)
    return dict(block_q=64, block_kv=64, stages=2, ping_pong=False)


def supports(q, k, *, block_kv: int | None = None) -> bool:
    """Whether this kernel handles the call (else use the Triton-lowered `prefill.prefill_attention`)."""
    return supports_shapes(q.dtype, k.dtype, q.shape[-1], k.shape[2], block_kv=block_kv)


def supports_shapes(dtype, cache_dtype, head_dim: int, cache_len: int, *, block_kv: int | None = None) -> bool:
    """`supports` from the shapes alone: queries in `dtype` over a cache of `cache_len` positions
    stored in `cache_dtype`."""
    block_kv = block_kv or default_tiles(head_dim)["block_kv"]
    return (jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and jnp.dtype(cache_dtype) == jnp.dtype(dtype)
            and head_dim % 64 == 0 and head_dim <= 256 and cache_len % block_kv == 0)


def tile_ranges(q_pos, kv_len, *, block_q: int, block_kv: int, window: int | None):
    """[B, num_programs, 10] int32 per program: the union [lo, hi) of its two tiles' visible blocks,
    then (lo, full_lo, full_hi, hi) of each tile, clamped into that union."""
    B, T = q_pos.shape
    tiles = q_pos.reshape(B, T // block_q, block_q)
    per_tile = jax.vmap(jax.vmap(lambda p, n: flash.block_ranges(p, n, block_kv, window), (0, None)), (0, 0))
    lo, full_lo, full_hi, hi = per_tile(tiles, kv_len)  # each [B, tiles]
    pair = lambda x: x.reshape(B, -1, _COMPUTE_WGS)
    lo, full_lo, full_hi, hi = map(pair, (lo, full_lo, full_hi, hi))
    nonempty = hi > lo
    union_hi = jnp.max(jnp.where(nonempty, hi, 0), axis=-1, keepdims=True)
    union_lo = jnp.minimum(jnp.min(jnp.where(nonempty, lo, 2**30), axis=-1, keepdims=True), union_hi)
    clamp = lambda x: jnp.clip(x, union_lo, union_hi)
    per_wg = jnp.stack([clamp(lo), clamp(full_lo), clamp(full_hi), clamp(hi)], axis=-1)  # [B, n, 2, 4]
    per_wg = per_wg.reshape(B, -1, 4 * _COMPUTE_WGS)
    return jnp.concatenate([union_lo, union_hi, per_wg], axis=-1).astype(jnp.int32)


def _kernel(kv_len_ref, ranges_ref, q_pos_ref, q_ref, k_ref, v_ref, o_ref, scoped, *, scale: float,
            window: int | None, block_q: int, block_kv: int, stages: int, num_programs: int, group: int,
            interpret: bool, ping_pong: bool):
    (q_smem, pos_smem, k_smem, v_smem, *p_smem), (q_ready, pos_ready, k_ready, v_ready), (k_free, v_free), \
        turn = scoped
    seq = lax.axis_index("seq")
    head = lax.axis_index("head")
    program = num_programs - 1 - lax.axis_index("tile")  # last tiles (most keys) first
    wg = lax.axis_index("wg")
    union_lo = ranges_ref[seq, program, 0]
    union_hi = ranges_ref[seq, program, 1]
    slot_of = lambda block: lax.rem(block - union_lo, jnp.int32(stages))

    @pl.when(wg < _COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        row0 = (program * _COMPUTE_WGS + wg) * block_q
        plgpu.copy_gmem_to_smem(q_ref.at[seq, pl.ds(row0, block_q), head], q_smem.at[wg], q_ready.at[wg])
        plgpu.copy_gmem_to_smem(q_pos_ref.at[seq, pl.ds(row0, block_q)], pos_smem.at[wg], pos_ready.at[wg])
        kv_len = kv_len_ref[seq]
        lo, full_lo, full_hi, hi = (ranges_ref[seq, program, 2 + 4 * wg + i] for i in range(4))
        plgpu.barrier_wait(pos_ready.at[wg])
        pos = plgpu.load(pos_smem.at[wg], layout=_WG_ROWS)
        plgpu.barrier_wait(q_ready.at[wg])
        qk_scale = scale * flash.LOG2E
        rows = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])

        def meet():  # both compute warpgroups reach this point (see `ping_pong`)
            if ping_pong:
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(turn)

        def softmax_done_then_wait_v(slot):
            if ping_pong:
                plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(v_ready.at[slot])
            if ping_pong:
                plgpu.barrier_wait(turn)

        def step_over(block, carry):  # same barrier traffic as `attend`, no arithmetic
            slot = slot_of(block)
            plgpu.barrier_wait(k_ready.at[slot])
            meet()
            plgpu.barrier_arrive(k_free.at[slot])
            softmax_done_then_wait_v(slot)
            plgpu.barrier_arrive(v_free.at[slot])
            return carry

        def attend(block, carry, masked):
            acc, m, l = carry
            slot = slot_of(block)
            plgpu.barrier_wait(k_ready.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[slot].transpose((1, 0)))
                meet()
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            if masked:
                key = block * block_kv + plgpu.broadcasted_iota(
                    jnp.int32, (block_q, block_kv), 1, layout=plgpu.Layout.WGMMA)
                p_row = rows(pos, s.shape)
                visible = (key <= p_row) & (key < kv_len)
                if window is not None:
                    visible = visible & (p_row - key < window)
                # Scale before masking (see flash.attend_block).
                s = jnp.where(visible, s * qk_scale, flash.MASK_SCORE)
                m_new = jnp.maximum(m, s.max(axis=1))
                p = jnp.exp2(s - rows(m_new, s.shape))
            else:
                m_new = jnp.maximum(m, s.max(axis=1) * qk_scale)
                p = jnp.exp2(s * qk_scale - rows(m_new, s.shape))
            alpha = jnp.exp2(m - m_new)
            l = l * alpha + p.sum(axis=1)
            acc = acc * rows(alpha, acc.shape)
            p16 = p.astype(q_smem.dtype)
            softmax_done_then_wait_v(slot)
            if interpret:
                # The GPU interpreter takes wgmma operands from shared memory and fresh accumulators only.
                p_smem[0].at[wg][...] = p16
                plgpu.commit_smem()

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem[0].at[wg], v_smem.at[slot])
                    return acc_ref[...]

                acc = acc + pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
            else:  # P from registers, accumulating in place
                acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p16, v_smem.at[slot]))(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        head_dim = q_smem.shape[-1]
        acc = plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32), plgpu.Layout.WGMMA)
        m = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), _WG_ROWS)
        l = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), _WG_ROWS)
        carry = (acc, m, l)
        masked = functools.partial(attend, masked=True)
        unmasked = functools.partial(attend, masked=False)
        pl.when(wg == 1)(meet)  # start half a step apart
        carry = lax.fori_loop(union_lo, lo, step_over, carry)
        carry = lax.fori_loop(lo, full_lo, masked, carry)
        carry = lax.fori_loop(full_lo, full_hi, unmasked, carry)
        carry = lax.fori_loop(full_hi, hi, masked, carry)
        acc, m, l = lax.fori_loop(hi, union_hi, step_over, carry)
        pl.when(wg == 0)(meet)  # balance the extra meeting of warpgroup 1

        sees = (pos >= 0) & (kv_len > 0) & (l > 0)
        if window is not None:
            sees = sees & (pos - jnp.minimum(pos, kv_len - 1) < window)
        inv = jnp.where(sees, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
        q_smem.at[wg][...] = (acc * rows(inv, acc.shape)).astype(q_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem.at[wg], o_ref.at[seq, pl.ds(row0, block_q), head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _COMPUTE_WGS)
    def _copy():
        plgpu.set_max_registers(40, action="decrease")
        kv_head = lax.div(head, jnp.int32(group))

        def issue(block, slot):
            rows = pl.ds(block * block_kv, block_kv)
            plgpu.copy_gmem_to_smem(k_ref.at[seq, kv_head, rows], k_smem.at[slot], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[seq, kv_head, rows], v_smem.at[slot], v_ready.at[slot])

        for i in range(stages):
            pl.when(union_lo + i < union_hi)(functools.partial(issue, union_lo + i, i))

        @pl.loop(union_lo + stages, jnp.maximum(union_hi, union_lo + stages))
        def _refill(block):
            slot = slot_of(block)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            issue(block, slot)

        # Observe the release of the last slots too, so every barrier phase is consumed before exit.
        @pl.loop(jnp.maximum(union_lo, union_hi - stages), union_hi)
        def _drain(block):
            plgpu.barrier_wait(k_free.at[slot_of(block)])
            plgpu.barrier_wait(v_free.at[slot_of(block)])


def _pad_queries(q, q_pos, multiple):
    T = q.shape[1]
    extra = -T % multiple
    if extra:
        q = jnp.pad(q, ((0, 0), (0, extra), (0, 0), (0, 0)))
        q_pos = jnp.pad(q_pos, ((0, 0), (0, extra)), constant_values=-1)
    return q, q_pos


@functools.partial(jax.jit, static_argnames=("scale", "window", "block_q", "block_kv", "stages", "ping_pong",
                                             "interpret"))
def mgpu_prefill_attention(q, k, v, q_pos, kv_len, *, scale: float, window: int | None = None,
                           block_q: int | None = None, block_kv: int | None = None, stages: int | None = None,
                           ping_pong: bool | None = None, interpret: bool = False):
    """Attention of q [B, T, Hq, D] over the contiguous cache k, v [B, Hkv, S, D] (see reference.py).

    ping_pong: the two compute warpgroups take turns (a shared barrier met twice per key block, the
    second warpgroup starting half a step late), so one's softmax overlaps the other's matrix products
    instead of both contending for the tensor cores at once.
    """
    B, T, Hq, Hkv, D = check_shapes(q, k, v, q_pos, kv_len)
    tiles = default_tiles(D)
    block_q = block_q or tiles["block_q"]
    block_kv = block_kv or tiles["block_kv"]
    stages = stages or tiles["stages"]
    ping_pong = tiles["ping_pong"] if ping_pong is None else ping_pong
    if not supports(q, k, block_kv=block_kv):
        raise ValueError(f"mgpu_prefill_attention: needs bf16/f16 q and k, head dim a multiple of 64 up to 256 "
                         f"and cache length a multiple of block_kv={block_kv}; got q {q.dtype} {q.shape}, "
                         f"k {k.dtype} {k.shape}")
    if block_q != 64:
        raise ValueError(f"mgpu_prefill_attention: block_q={block_q}: one warpgroup's wgmma tile is 64 rows")
    S = k.shape[2]
    kv_len = jnp.minimum(kv_len.astype(jnp.int32), S)
    q_pad, pos_pad = _pad_queries(q, q_pos.astype(jnp.int32), _COMPUTE_WGS * block_q)
    num_programs = q_pad.shape[1] // (_COMPUTE_WGS * block_q)
    ranges = tile_ranges(pos_pad, kv_len, block_q=block_q, block_kv=block_kv, window=window)

    # 128-byte swizzled tiles: what TMA writes and wgmma reads without bank conflicts.
    swizzle = plgpu.SwizzleTransform(128)
    tiled = (plgpu.TilingTransform((8, 128 // q.dtype.itemsize)), swizzle)
    scratch = (
        (plgpu.SMEM((_COMPUTE_WGS, block_q, D), q.dtype, transforms=tiled),
         plgpu.SMEM((_COMPUTE_WGS, block_q), jnp.int32),
         plgpu.SMEM((stages, block_kv, D), q.dtype, transforms=tiled),
         plgpu.SMEM((stages, block_kv, D), q.dtype, transforms=tiled),
         *([plgpu.SMEM((_COMPUTE_WGS, block_q, block_kv), q.dtype, transforms=tiled)] if interpret else [])),
        (plgpu.Barrier(num_barriers=_COMPUTE_WGS), plgpu.Barrier(num_barriers=_COMPUTE_WGS),
         plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)),
        (plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),
         plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages)),
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
    )
    body = functools.partial(_kernel, scale=float(scale), window=window, block_q=block_q, block_kv=block_kv,
                             stages=stages, num_programs=num_programs, group=Hq // Hkv,
                             interpret=interpret, ping_pong=ping_pong)

    def entry(*refs):
        pl.run_scoped(lambda *scoped: body(*refs, scoped), *scratch, collective_axes="wg")

    out = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(q_pad.shape, q.dtype),
        grid=(Hq, num_programs, B),
        grid_names=("head", "tile", "seq"),
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(kv_len, ranges, pos_pad, q_pad, k, v)
    return out[:, :T] if out.shape[1] != T else out
