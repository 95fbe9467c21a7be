"""Rotary embedding of a few tokens' queries and keys, and their K/V written into the cache, as one
Mosaic GPU kernel.

At decode, between the QKV product and attention XLA runs the sum of the split-K product's
partial sums, the bias, the split into q, k and v, the rotation of q and of k, and one in-place
update per cache (k, v): five or six fusions of a few kilobytes each, every one a launch that
costs more than its bytes. This kernel does all of it in one launch. One program (one
warpgroup) per (token, KV head) sums the partials (and bias) of the G query rows of that KV
head's group and of its key and value row, rounds them to the compute dtype (as the product
would have been), applies a model's per-head q and k RMS norms (Gemma's) where given, rotates
them in float32 with angles computed from the position, writes the rotated queries, and stores
the key and value at the token's place in the caches, which are aliased to the outputs (XLA
updates the donated cache in place). A negative place (an inactive slot, padding) writes
nothing to the caches. An int8 or fp8 cache is written quantized, as pallas_kernels/kv_quant.py
defines it, from the values a float cache would hold: an int8 row's scale is its largest
magnitude / 127, stored beside it.

The head dim is split into its two rotation halves through a reshaped view of every array
([..., 2, D/2] for "halves", [..., D/2, 2] for "pairs"), so each half is one (strided) load
and no register shuffle is needed. A half of D/2 values lies one value per lane across a warp
(D/2 / 32 values a lane, or lanes replicated below 32), and the four warps of the warpgroup
hold copies of it: a row is a few hundred bytes, its cost the chain of dependent loads, not
the lanes that run it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kv_quant import FP8_MAX, INT8_MAX, check_scales, kind_of

_F32 = jnp.float32


def _half_layout(n: int):
    """The layout of one rotation half [n] (n a power of two): value i on lane i % 32 (lanes
    replicated where n < 32), every warp a copy."""
    lanes = min(n, 32)
    lane_dims = (-2,) if lanes == 32 else (-2, plgpu.Replicated(32 // lanes))
    return plgpu.Layout.TILED(plgpu.Tiling(((lanes,), (1,))), warp_dims=(plgpu.Replicated(4),),
                              lane_dims=lane_dims, vector_dim=-1)


def split_view(x: jax.Array, pairing: str) -> jax.Array:
    """x [..., D] as [..., 2, D/2] ("halves") or [..., D/2, 2] ("pairs"): each rotation half one index."""
    d = x.shape[-1]
    return x.reshape(*x.shape[:-1], *((2, d // 2) if pairing == "halves" else (d // 2, 2)))


class _Halves:
    """Loads and stores of rotation halves in the split view, in one layout."""

    def __init__(self, d: int, pairing: str):
        self.layout, self.pairing = _half_layout(d // 2), pairing

    def at(self, ref, idx: tuple, j: int):
        return ref.at[(*idx, j, slice(None)) if self.pairing == "halves" else (*idx, slice(None), j)]

    def load(self, ref, idx: tuple, j: int):
        return plgpu.load(self.at(ref, idx, j), layout=self.layout, optimized=False).astype(_F32)

    def store(self, ref, idx: tuple, j: int, value):
        self.at(ref, idx, j)[...] = value.astype(ref.dtype)


def _kernel(pos_ref, at_ref, row_ref, inv_ref, parts_ref, *refs, n_heads: int, n_kv: int, group: int,
            n_parts: int, d: int, pairing: str, has_bias: bool, has_norm: bool, eps: float, kind: str | None,
            dtype):
    # refs: the bias, the q and k norm weights, an fp8 cache's head scales (each where given),
    # the caches (int8: and their scales) written in place, then the rotated queries.
    n_caches = 4 if kind == "int8" else 2
    before, (k_ref, v_ref, *scale_refs), q_ref = refs[:-n_caches - 1], refs[-n_caches - 1:-1], refs[-1]
    bias_ref = before[0] if has_bias else None
    q_norm, k_norm = before[int(has_bias):int(has_bias) + 2] if has_norm else (None, None)
    b, h = jax.lax.axis_index("token"), jax.lax.axis_index("kv_head")
    halves = _Halves(d, pairing)
    # Every scalar first: loads issued together, none waiting behind the rotation's arithmetic.
    pos, at, row = pos_ref[b], at_ref[b], row_ref[b]
    head_scales = (before[-2][h], before[-1][h]) if kind == "fp8" else (None, None)
    angles = pos.astype(_F32) * plgpu.load(inv_ref, layout=halves.layout, optimized=False)
    cos, sin = jnp.cos(angles), jnp.sin(angles)

    def product(head, j):
        """Half j of head `head`'s row of the product: partial sums and bias, rounded to the dtype."""
        x = halves.load(parts_ref, (0, b, head), j)
        for s in range(1, n_parts):
            x = x + halves.load(parts_ref, (s, b, head), j)
        if bias_ref is not None:
            x = x + halves.load(bias_ref, (head,), j)
        return x.astype(dtype).astype(_F32)

    def rotated(head, w_ref):
        x1, x2 = product(head, 0), product(head, 1)
        if w_ref is not None:  # the per-head RMS norm, rounded as the reference's rms_norm returns it
            r = jax.lax.rsqrt((jnp.sum(x1 * x1) + jnp.sum(x2 * x2)) / d + eps)
            x1, x2 = ((x * r * halves.load(w_ref, (), j)).astype(dtype).astype(_F32) for j, x in enumerate((x1, x2)))
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    for g in range(group):
        head = h * group + g
        for j, val in enumerate(rotated(head, q_norm)):
            halves.store(q_ref, (b, head), j, val)

    key = rotated(n_heads + h, k_norm)
    value = [product(n_heads + n_kv + h, j) for j in range(2)]

    @pl.when(at >= 0)
    def _():
        for i, (ref, vals) in enumerate(((k_ref, key), (v_ref, value))):
            vals = [x.astype(dtype).astype(_F32) for x in vals]  # the value a float cache holds
            if kind == "int8":
                amax = jnp.maximum(jnp.max(jnp.abs(vals[0])), jnp.max(jnp.abs(vals[1])))
                scale = amax / INT8_MAX
                safe = jnp.where(scale > 0, scale, 1.0)
                vals = [jnp.clip(jnp.round(x / safe), -INT8_MAX, INT8_MAX).astype(jnp.int32) for x in vals]
                scale_refs[i][row, h, at] = scale
            elif kind == "fp8":
                vals = [jnp.clip(x / head_scales[i], -FP8_MAX, FP8_MAX) for x in vals]
            for j, x in enumerate(vals):
                halves.store(ref, (row, h, at), j, x)


@functools.partial(jax.jit, static_argnames=("n_heads", "pairing", "dtype", "interpret", "eps"))
def rope_append_kernel(parts, bias, pos, k_cache, v_cache, inv_freq, rows, *, n_heads: int, pairing: str,
                       dtype, interpret: bool = False, k_scale=None, v_scale=None, qk_norm=None, eps: float = 0.0,
                       at=None):
    """parts [S, B, (Hq + 2 Hkv) D]: the QKV product of B tokens as S partial sums; bias
    [(Hq + 2 Hkv) D] or None; pos [B] the tokens' positions, which rotate them; rows [B] each
    token's cache row, and at [B] the index in that row it is written at (None: its position;
    -1: write nothing). A paged cache passes its pool as the rows (a token's page) and the
    offsets in the page as `at`. Caches [n_slots, Hkv, S, D], float, or int8 / fp8 with their
    scales k_scale, v_scale (int8: [n_slots, Hkv, S], written here; fp8: [Hkv], read); qk_norm:
    None, or the weights (q [D], k [D]) of an RMS norm (epsilon `eps`) of every query and key
    head before the rotation.
    -> (q [B, Hq, D] rotated, in `dtype`; k_cache; v_cache; k_scale; v_scale)."""
    n_slots, n_kv, _, d = k_cache.shape
    n_parts, B, n = parts.shape
    if d % 2 or (d // 2) & (d // 2 - 1):
        raise ValueError(f"rope_append: head dim {d} must be twice a power of two")
    if n != (n_heads + 2 * n_kv) * d:
        raise ValueError(f"rope_append: a product of {n} columns is not q, k, v of {n_heads} + 2 x {n_kv} heads "
                         f"of dim {d}")
    if qk_norm is not None and any(w.shape != (d,) for w in qk_norm):
        raise ValueError(f"rope_append: the q and k norm weights must be [{d}], got "
                         f"{[tuple(w.shape) for w in qk_norm]}")
    kind = kind_of(k_cache.dtype)
    for x, scale, name in ((k_cache, k_scale, "k"), (v_cache, v_scale, "v")):
        check_scales(x, scale, name)
    dtype = jnp.dtype(dtype)
    view = functools.partial(split_view, pairing=pairing)
    heads = lambda x: x.reshape(*x.shape[:-1], n_heads + 2 * n_kv, d)  # noqa: E731
    before = [] if bias is None else [view(heads(bias.astype(_F32)))]
    if qk_norm is not None:
        before += [view(w.astype(_F32)) for w in qk_norm]
    if kind == "fp8":
        before += [k_scale.astype(_F32), v_scale.astype(_F32)]
    caches = [view(k_cache), view(v_cache)] + ([k_scale, v_scale] if kind == "int8" else [])
    args = [pos.astype(jnp.int32), (pos if at is None else at).astype(jnp.int32), rows.astype(jnp.int32),
            inv_freq.astype(_F32), view(heads(parts.astype(_F32))), *before]
    kernel = functools.partial(_kernel, n_heads=n_heads, n_kv=n_kv, group=n_heads // n_kv, n_parts=n_parts, d=d,
                               pairing=pairing, has_bias=bias is not None, has_norm=qk_norm is not None,
                               eps=float(eps), kind=kind, dtype=dtype)
    # The caches go in as refs that the kernel writes: XLA aliases them to its outputs, and
    # updates a donated cache in place.
    refs = [jax.new_ref(c) for c in caches]
    q = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((B, n_heads, *view(k_cache).shape[-2:]), dtype),
        grid=(B, n_kv), grid_names=("token", "kv_head"),
        # Nothing the kernel writes is read back, so no barrier need order a store after a load.
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*args, *refs)
    outs = [q, *(jax.ref.freeze(r) for r in refs)]
    q, k_out, v_out = outs[0].reshape(B, n_heads, d), outs[1].reshape(k_cache.shape), outs[2].reshape(v_cache.shape)
    if kind == "int8":
        k_scale, v_scale = outs[3], outs[4]
    return q, k_out, v_out, k_scale, v_scale
