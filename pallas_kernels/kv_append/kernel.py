"""Rotary embedding of a few tokens' queries and keys, and their K/V written into the cache, as one kernel.

At decode, between the QKV product and attention XLA runs the sum of the split-K product's
partial sums, the bias, the split into q, k and v, the rotation of q and of k, and one in-place
update per cache (k, v): five or six fusions of a few kilobytes each, every one a launch that costs
more than its bytes. This kernel does all of it in one launch. One program per (sequence, KV head) sums
the partials (and bias) of the G query rows of that KV head's group and of its key and value
row, rounds them to the compute dtype (as the product would have been), applies a model's
per-head q and k RMS norms (Gemma's) where given, rotates them in float32 with angles computed
from the position,
writes the rotated queries, and stores the key and value at the sequence's position in the
caches, which are aliased to the outputs (XLA updates the donated cache in place). A negative
position (an inactive slot) writes nothing to the caches. An int8 or fp8 cache is written
quantized, as pallas_kernels/kv_quant.py defines it, from the values a float cache would hold:
an int8 row's scale is its largest magnitude / 127, stored beside it.

The head dim is split into its two rotation halves through a reshaped view of every array
([..., 2, D/2] for "halves", [..., D/2, 2] for "pairs"), so each half is one strided load and
no register shuffle is needed.

Lowering: Pallas' Triton backend (gathers and scattered stores of a few rows; no matrix work
for Mosaic GPU's warpgroup model).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_quant import FP8, FP8_MAX, INT8_MAX, check_scales, kind_of

_F32 = jnp.float32


def _half(ref, idx: tuple, j: int, pairing: str):
    """The view of rotation half j (0 or 1) of the rows ref[idx] (ref in the split view)."""
    j = jnp.int32(j)  # the interpreter cannot discharge plain int indices
    return ref.at[(*idx, j, slice(None)) if pairing == "halves" else (*idx, slice(None), j)]


class ProductRows:
    """Rows (heads) of sequence b's QKV product inside a kernel program, from its split-K partial
    sums in the split view (`split_view`): summed with the bias, rounded to `dtype` (as the
    product would have been), in float32; RMS-normed per head where a norm weight is given
    (Gemma's q and k norms, `norm_refs`: the q and k weights [D] in the split view, or None),
    rounded again; and rotated for position `pos`. Shared with the decode attention kernel that
    runs this pass as its prologue (pallas_kernels.attention)."""

    def __init__(self, parts_ref, bias_ref, inv_ref, b, pos, *, n_parts: int, pairing: str, dtype,
                 norm_refs=None, eps: float = 0.0):
        self.parts_ref, self.bias_ref, self.b = parts_ref, bias_ref, b
        self.n_parts, self.pairing, self.dtype = n_parts, pairing, dtype
        self.q_norm, self.k_norm = norm_refs if norm_refs is not None else (None, None)
        self.eps = eps
        angles = pos.astype(_F32) * inv_ref[...].astype(_F32)
        self.cos, self.sin = jnp.cos(angles), jnp.sin(angles)

    def _normed(self, x1, x2, w_ref):
        """Halves x1, x2 [..., D/2] of rows, each row divided by its RMS over D and weighted by
        w_ref, in float32, rounded to the dtype (as the reference's rms_norm returns it)."""
        if w_ref is None:
            return x1, x2
        ms = (jnp.sum(x1 * x1, axis=-1, keepdims=True) + jnp.sum(x2 * x2, axis=-1, keepdims=True)) / (2 * x1.shape[-1])
        r = jax.lax.rsqrt(ms + self.eps)
        w = [plgpu.load(_half(w_ref, (), j, self.pairing)).astype(_F32) for j in range(2)]
        return tuple((x * r * wj).astype(self.dtype).astype(_F32) for x, wj in zip((x1, x2), w))

    def half(self, head, j):
        """Half j of row `head`: its partial sums and bias, rounded to the dtype."""
        x = plgpu.load(_half(self.parts_ref, (jnp.int32(0), self.b, head), j, self.pairing)).astype(_F32)
        for s in range(1, self.n_parts):
            x = x + plgpu.load(_half(self.parts_ref, (jnp.int32(s), self.b, head), j, self.pairing)).astype(_F32)
        if self.bias_ref is not None:
            x = x + plgpu.load(_half(self.bias_ref, (head,), j, self.pairing)).astype(_F32)
        return x.astype(self.dtype).astype(_F32)

    def rotated(self, head, key: bool):
        """(first, second) rotation half of row `head` (a key's, else a query's), normed as
        its kind is, rotated."""
        x1, x2 = self._normed(self.half(head, 0), self.half(head, 1), self.k_norm if key else self.q_norm)
        return x1 * self.cos - x2 * self.sin, x2 * self.cos + x1 * self.sin

    def rotated_rows(self, first_head, n: int, valid):
        """(first, second) rotation half, normed and rotated, of the n query rows (heads) from
        `first_head`, each [n, D/2]; rows where `valid` [n] is false read nothing and hold zeros."""
        heads, mask = pl.ds(first_head, n), valid[:, None]

        def half(j):
            at = lambda ref, *idx: _half(ref, idx, j, self.pairing)  # noqa: E731
            x = sum(plgpu.load(at(self.parts_ref, jnp.int32(s), self.b, heads), mask=mask, other=0).astype(_F32)
                    for s in range(self.n_parts))
            if self.bias_ref is not None:
                x = x + plgpu.load(at(self.bias_ref, heads), mask=mask, other=0).astype(_F32)
            return x.astype(self.dtype).astype(_F32)

        x1, x2 = self._normed(half(0), half(1), self.q_norm)
        cos, sin = self.cos[None, :], self.sin[None, :]
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    def row(self, halves):
        """The two halves as one [D] row in the natural order of the head dim."""
        pairs = jnp.stack(halves, axis=-1)  # [D/2, 2]: the one join Triton lowers
        return (pairs.T if self.pairing == "halves" else pairs).reshape(2 * halves[0].shape[-1])


def _rne(x):
    """x rounded to the nearest integer, ties to even, as jnp.round does (|x| < 2^31). Pallas'
    Triton backend lowers no round; floor, an int cast and a compare it does."""
    f = jnp.floor(x)
    d = x - f
    odd = (f.astype(jnp.int32) & 1) == 1
    return f + jnp.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)


def quantize_row(halves, kind: str, head_scale, dtype):
    """One row's two rotation halves (float32) as a `kind` cache stores them, quantized from the
    value a float cache would hold (rounded to `dtype`; pallas_kernels/kv_quant.py): (the halves
    in the cache's value domain, to be cast to its dtype; an int8 row's scale max|row| / 127, else
    None; the values the cache then holds, dequantized, in float32)."""
    halves = [x.astype(dtype).astype(_F32) for x in halves]
    if kind == "int8":
        amax = jnp.maximum(jnp.max(jnp.abs(halves[0])), jnp.max(jnp.abs(halves[1])))
        scale = amax / INT8_MAX
        safe = jnp.where(scale > 0, scale, 1.0)
        codes = [jnp.clip(_rne(x / safe), -INT8_MAX, INT8_MAX) for x in halves]
        return codes, scale, [c * scale for c in codes]
    values = [jnp.clip(x / head_scale, -FP8_MAX, FP8_MAX) for x in halves]
    return values, None, [x.astype(FP8).astype(_F32) * head_scale for x in values]


def _store_row(ref, scale_ref, head_scale, halves, idx: tuple, valid, *, kind: str | None, pairing: str, dtype):
    """Store one row (two rotation halves in float32) at ref[idx], as the cache stores it: cast
    to the cache dtype, or quantized (`quantize_row`; an int8 row's scale stored at
    scale_ref[idx]). Nothing is stored unless `valid`."""
    write = jnp.broadcast_to(valid, halves[0].shape)
    if kind is not None:
        halves, scale, _ = quantize_row(halves, kind, head_scale, dtype)
        if scale is not None:
            plgpu.store(scale_ref.at[(*idx[:-1], pl.ds(idx[-1], 1))], jnp.broadcast_to(scale, (1,)),
                        mask=jnp.broadcast_to(valid, (1,)))
    for j, val in enumerate(halves):
        plgpu.store(_half(ref, idx, j, pairing), val.astype(ref.dtype), mask=write)


def _kernel(pos_ref, at_ref, row_ref, inv_ref, parts_ref, *refs, n_heads: int, group: int, n_parts: int,
            pairing: str, has_bias: bool, has_norm: bool, eps: float, kind: str | None):
    # refs: the bias, the q and k norm weights, an fp8 cache's head scales (each where given),
    # the caches (aliased), then the outputs.
    bias_ref = refs[0] if has_bias else None
    norm_refs = tuple(refs[int(has_bias):int(has_bias) + 2]) if has_norm else None
    n_before = int(has_bias) + 2 * int(has_norm)
    if kind == "int8":  # outputs q, k, v and the per-entry scales (aliased to the inputs)
        q_ref, k_ref, v_ref, ks_ref, vs_ref = refs[-5:]
    else:
        q_ref, k_ref, v_ref = refs[-3:]
        ks_ref = vs_ref = None
    b, h = pl.program_id(0), pl.program_id(1)
    pos = pos_ref[b]
    product = ProductRows(parts_ref, bias_ref, inv_ref, b, pos, n_parts=n_parts, pairing=pairing, dtype=q_ref.dtype,
                          norm_refs=norm_refs, eps=eps)
    load, rotate = product.half, product.rotated

    for g in range(group):  # G loads of D/2 values: no gathers or masks for any G
        head = h * group + g
        for j, val in enumerate(rotate(head, key=False)):
            plgpu.store(_half(q_ref, (b, head), j, pairing), val.astype(q_ref.dtype))

    n_kv = pl.num_programs(1)
    k_head = v_head = None
    if kind == "fp8":  # the per-head scales: inputs after the bias and norms
        k_head, v_head = refs[n_before][h], refs[n_before + 1][h]
    at = at_ref[b]
    idx = (row_ref[b], h, jnp.maximum(at, 0))
    store = functools.partial(_store_row, idx=idx, valid=at >= 0, kind=kind, pairing=pairing, dtype=q_ref.dtype)
    store(k_ref, ks_ref, k_head, rotate(n_heads + h, key=True))
    store(v_ref, vs_ref, v_head, [load(n_heads + n_kv + h, j) for j in range(2)])


def split_view(x: jax.Array, pairing: str) -> jax.Array:
    """x [..., D] as [..., 2, D/2] ("halves") or [..., D/2, 2] ("pairs"): each rotation half one index."""
    d = x.shape[-1]
    return x.reshape(*x.shape[:-1], *((2, d // 2) if pairing == "halves" else (d // 2, 2)))


@functools.partial(jax.jit, static_argnames=("n_heads", "pairing", "dtype", "interpret", "eps"))
def rope_append_kernel(parts, bias, pos, k_cache, v_cache, inv_freq, rows, *, n_heads: int, pairing: str,
                       dtype, interpret: bool = False, k_scale=None, v_scale=None, qk_norm=None, eps: float = 0.0,
                       at=None):
    """parts [S, B, (Hq + 2 Hkv) D]: the QKV product of B tokens as S partial sums; bias
    [(Hq + 2 Hkv) D] or None; pos [B] the tokens' positions, which rotate them; rows [B] each
    token's cache row, and at [B] the index in that row it is written at (None: its position;
    -1: write nothing). A paged cache passes its pool as the rows (a token's page) and the
    offsets in the page as `at`. Caches
    [n_slots, Hkv, S, D], float, or int8 / fp8 with their scales k_scale, v_scale (int8:
    [n_slots, Hkv, S], written here; fp8: [Hkv], read); qk_norm: None, or the weights (q [D],
    k [D]) of an RMS norm (epsilon `eps`) of every query and key head before the rotation.
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
    group = n_heads // n_kv
    view = functools.partial(split_view, pairing=pairing)
    heads = lambda x: x.reshape(*x.shape[:-1], n_heads + 2 * n_kv, d)  # noqa: E731
    before = [] if bias is None else [view(heads(bias))]
    if qk_norm is not None:
        before += [view(w.astype(_F32)) for w in qk_norm]
    if kind == "fp8":
        before += [k_scale.astype(_F32), v_scale.astype(_F32)]
    caches = [view(k_cache), view(v_cache)] + ([k_scale, v_scale] if kind == "int8" else [])
    kernel = functools.partial(_kernel, n_heads=n_heads, group=group, n_parts=n_parts, pairing=pairing,
                               has_bias=bias is not None, has_norm=qk_norm is not None, eps=float(eps), kind=kind)
    first_cache = 5 + len(before)
    outs = pl.pallas_call(
        kernel,
        grid=(B, n_kv),
        out_shape=[jax.ShapeDtypeStruct((B, n_heads) + view(k_cache).shape[-2:], dtype)]
        + [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches],
        input_output_aliases={first_cache + i: 1 + i for i in range(len(caches))},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="rope_append",
    )(pos.astype(jnp.int32), (pos if at is None else at).astype(jnp.int32), rows.astype(jnp.int32),
      inv_freq.astype(_F32), view(heads(parts)), *before, *caches)
    q, k_out, v_out = outs[0].reshape(B, n_heads, d), outs[1].reshape(k_cache.shape), outs[2].reshape(v_cache.shape)
    if kind == "int8":
        k_scale, v_scale = outs[3], outs[4]
    return q, k_out, v_out, k_scale, v_scale
