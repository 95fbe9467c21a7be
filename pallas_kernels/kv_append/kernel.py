"""Rotary embedding of one decode token's queries and keys, and its K/V written into the cache, as one kernel.

At decode, between the QKV product and attention XLA runs the sum of the split-K product's
partial sums, the bias, the split into q, k and v, the rotation of q and of k, and one in-place
update per cache (k, v): five or six fusions of a few kilobytes each, every one a launch of
1-1.5 us. This kernel does all of it in one launch. One program per (sequence, KV head) sums
the partials (and bias) of the G query rows of that KV head's group and of its key and value
row, rounds them to the compute dtype (as the product would have been), rotates them in
float32 with angles computed from the position,
writes the rotated queries, and stores the key and value at the sequence's position in the
caches, which are aliased to the outputs (XLA updates the donated cache in place). A negative
position (an inactive slot) writes nothing to the caches.

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

_F32 = jnp.float32


def _half(ref, idx: tuple, j: int, pairing: str):
    """The view of rotation half j (0 or 1) of the rows ref[idx] (ref in the split view)."""
    j = jnp.int32(j)  # the interpreter cannot discharge plain int indices
    return ref.at[(*idx, j, slice(None)) if pairing == "halves" else (*idx, slice(None), j)]


class ProductRows:
    """Rows (heads) of sequence b's QKV product inside a kernel program, from its split-K partial
    sums in the split view (`split_view`): summed with the bias, rounded to `dtype` (as the
    product would have been), in float32; and rotated for position `pos`. Shared with the
    decode attention kernel that runs this pass as its prologue (pallas_kernels.attention)."""

    def __init__(self, parts_ref, bias_ref, inv_ref, b, pos, *, n_parts: int, pairing: str, dtype):
        self.parts_ref, self.bias_ref, self.b = parts_ref, bias_ref, b
        self.n_parts, self.pairing, self.dtype = n_parts, pairing, dtype
        angles = pos.astype(_F32) * inv_ref[...].astype(_F32)
        self.cos, self.sin = jnp.cos(angles), jnp.sin(angles)

    def half(self, head, j):
        """Half j of row `head`: its partial sums and bias, rounded to the dtype."""
        x = plgpu.load(_half(self.parts_ref, (jnp.int32(0), self.b, head), j, self.pairing)).astype(_F32)
        for s in range(1, self.n_parts):
            x = x + plgpu.load(_half(self.parts_ref, (jnp.int32(s), self.b, head), j, self.pairing)).astype(_F32)
        if self.bias_ref is not None:
            x = x + plgpu.load(_half(self.bias_ref, (head,), j, self.pairing)).astype(_F32)
        return x.astype(self.dtype).astype(_F32)

    def rotated(self, head):
        """(first, second) rotation half of row `head`, rotated."""
        x1, x2 = self.half(head, 0), self.half(head, 1)
        return x1 * self.cos - x2 * self.sin, x2 * self.cos + x1 * self.sin

    def rotated_rows(self, first_head, n: int, valid):
        """(first, second) rotation half, rotated, of the n rows (heads) from `first_head`, each
        [n, D/2]; rows where `valid` [n] is false read nothing and hold zeros."""
        heads, mask = pl.ds(first_head, n), valid[:, None]

        def half(j):
            at = lambda ref, *idx: _half(ref, idx, j, self.pairing)  # noqa: E731
            x = sum(plgpu.load(at(self.parts_ref, jnp.int32(s), self.b, heads), mask=mask, other=0).astype(_F32)
                    for s in range(self.n_parts))
            if self.bias_ref is not None:
                x = x + plgpu.load(at(self.bias_ref, heads), mask=mask, other=0).astype(_F32)
            return x.astype(self.dtype).astype(_F32)

        x1, x2 = half(0), half(1)
        cos, sin = self.cos[None, :], self.sin[None, :]
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    def row(self, halves):
        """The two halves as one [D] row in the natural order of the head dim."""
        pairs = jnp.stack(halves, axis=-1)  # [D/2, 2]: the one join Triton lowers
        return (pairs.T if self.pairing == "halves" else pairs).reshape(2 * halves[0].shape[-1])


def _kernel(pos_ref, row_ref, inv_ref, parts_ref, *refs, n_heads: int, group: int, n_parts: int,
            pairing: str, has_bias: bool):
    bias_ref = refs[0] if has_bias else None
    q_ref, k_ref, v_ref = refs[-3:]
    b, h = pl.program_id(0), pl.program_id(1)
    pos = pos_ref[b]
    product = ProductRows(parts_ref, bias_ref, inv_ref, b, pos, n_parts=n_parts, pairing=pairing, dtype=q_ref.dtype)
    cos, load, rotate = product.cos, product.half, product.rotated

    for g in range(group):  # G loads of D/2 values: no gathers or masks for any G
        head = h * group + g
        for j, val in enumerate(rotate(head)):
            plgpu.store(_half(q_ref, (b, head), j, pairing), val.astype(q_ref.dtype))

    n_kv = pl.num_programs(1)
    row = row_ref[b]
    at = jnp.maximum(pos, 0)
    write = jnp.broadcast_to(pos >= 0, cos.shape)
    for j, val in enumerate(rotate(n_heads + h)):
        plgpu.store(_half(k_ref, (row, h, at), j, pairing), val.astype(k_ref.dtype), mask=write)
    for j in range(2):
        val = load(n_heads + n_kv + h, j)
        plgpu.store(_half(v_ref, (row, h, at), j, pairing), val.astype(v_ref.dtype), mask=write)


def split_view(x: jax.Array, pairing: str) -> jax.Array:
    """x [..., D] as [..., 2, D/2] ("halves") or [..., D/2, 2] ("pairs"): each rotation half one index."""
    d = x.shape[-1]
    return x.reshape(*x.shape[:-1], *((2, d // 2) if pairing == "halves" else (d // 2, 2)))


@functools.partial(jax.jit, static_argnames=("n_heads", "pairing", "dtype", "interpret"))
def rope_append_kernel(parts, bias, pos, k_cache, v_cache, inv_freq, rows, *, n_heads: int, pairing: str,
                       dtype, interpret: bool = False):
    """parts [S, B, (Hq + 2 Hkv) D]: the QKV product of one token per sequence as S partial sums;
    bias [(Hq + 2 Hkv) D] or None; pos [B] (-1: write nothing); rows [B] the cache rows; caches
    [n_slots, Hkv, S, D]. -> (q [B, Hq, D] rotated, in `dtype`; k_cache; v_cache)."""
    n_slots, n_kv, _, d = k_cache.shape
    n_parts, B, n = parts.shape
    if d % 2 or (d // 2) & (d // 2 - 1):
        raise ValueError(f"rope_append: head dim {d} must be twice a power of two")
    if n != (n_heads + 2 * n_kv) * d:
        raise ValueError(f"rope_append: a product of {n} columns is not q, k, v of {n_heads} + 2 x {n_kv} heads "
                         f"of dim {d}")
    group = n_heads // n_kv
    view = functools.partial(split_view, pairing=pairing)
    heads = lambda x: x.reshape(*x.shape[:-1], n_heads + 2 * n_kv, d)  # noqa: E731
    bias_args = [] if bias is None else [view(heads(bias))]
    kernel = functools.partial(_kernel, n_heads=n_heads, group=group, n_parts=n_parts, pairing=pairing,
                               has_bias=bias is not None)
    k_at = 4 + len(bias_args)
    q, k_out, v_out = pl.pallas_call(
        kernel,
        grid=(B, n_kv),
        out_shape=[jax.ShapeDtypeStruct((B, n_heads) + view(k_cache).shape[-2:], dtype),
                   jax.ShapeDtypeStruct(view(k_cache).shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(view(v_cache).shape, v_cache.dtype)],
        input_output_aliases={k_at: 1, k_at + 1: 2},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="rope_append",
    )(pos.astype(jnp.int32), rows.astype(jnp.int32), inv_freq.astype(_F32), view(heads(parts)), *bias_args,
      view(k_cache), view(v_cache))
    return q.reshape(B, n_heads, d), k_out.reshape(k_cache.shape), v_out.reshape(v_cache.shape)
