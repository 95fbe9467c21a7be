"""The model's ops, with plain-math signatures, carrying out a fusion plan (rjax.math.plan).

The model says what is computed: `project` (h @ w.T), `add_norm` (x += a @ w.T, then h =
rms_norm(x) * w_norm), `glu` (act(gate) * up), `attention`. How is decided by the plan each op
is given: where the kernel after a norm applies it (the residual stream then travels as a
PendingNorm until that product hands the sum back), where activations are handed over rounded
to int8 (QuantizedX), where the GLU is left to the down product (GatedX), where a product sums
its split-K partials itself, where the product before a norm adds and norms in its own kernel
(the normed rows handed over as int8, or with the norm's scale pending: NormedRows). Those
types live here and in the kernels, never in the model.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.int8_activations import GatedX, QuantizedX, dequantize_x, quantize
from pallas_kernels.kv_append import apply_rope, split_qkv
from pallas_kernels.quant_matmul import qmatmul, qmatmul_add_norm, qmatmul_pending_norm
from pallas_kernels.rms_norm import NormedRows, PendingNorm, add_rms_norm, rms_norm
from gguf_blocks import reference
from gguf_blocks.qtensor import QTensor, Weight
from rjax.math.plan import Attention, Glu, LayerPlan, Norm, Plan


@dataclasses.dataclass(frozen=True)
class Stream:
    """The float32 residual stream x and h, its RMS norm for the next products: plain rows, rows
    rounded to int8 (QuantizedX), or (with x None) the add and the norm still pending in the
    next product's kernel (PendingNorm). `counts`: the zeroed group counts that products which
    fuse an add + norm pass on (None where none does)."""

    x: jax.Array | None
    h: object
    counts: jax.Array | None = None


def _impl(plan: Plan) -> str | None:
    # "pallas" leaves each kernel entry point its own choice on the GPU (a norm kernel at
    # decode sizes, XLA's fusion for prefill); the others force one implementation.
    return None if plan.implementation == "pallas" else plan.implementation


def _plain(x):
    if isinstance(x, (GatedX, NormedRows)):
        return x.materialize()
    return dequantize_x(x).astype(x.dtype) if isinstance(x, QuantizedX) else x


def matmul(x, w: Weight, *, partials: bool = False, plan: Plan | None = None):
    """x @ w.T for x (..., in) and w of logical shape (out, in), in x's dtype; with `partials`
    as S float32 partial sums (S, ..., out) whose sum is the product (S = 1 unless a split-K
    kernel leaves them to the consumer). Quantized weights go to the kernels on a GPU plan and
    to dequantize-then-dot elsewhere; dense ones to XLA's dot."""
    if isinstance(w, QTensor):
        kw = {} if plan is None else dict(implementation=_impl(plan), tuning=plan.tuning)
        return qmatmul(x, w, partials=partials, **kw)
    x = _plain(x)
    out = jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return out[None] if partials else out.astype(x.dtype)


def take_rows(w: Weight, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Rows `ids` of w, dequantized: an embedding lookup."""
    if isinstance(w, QTensor):
        return reference.take_rows(w, ids, dtype)
    return jnp.take(w, ids, axis=0).astype(dtype)


def norm(plan: Plan, x: jax.Array, w: jax.Array, eps: float) -> Stream:
    """The stream x and rms_norm(x) * w for the first products."""
    x, h = add_rms_norm(x, None, w, eps, plan.dtype, quantize=plan.first_norm == Norm.NORM_INT8,
                        implementation=_impl(plan))
    counts = jnp.zeros((x.shape[-1] // 32,), jnp.int32) if plan.counts else None
    return Stream(x, h, counts)


def project(plan: Plan, s: Stream, ws: list, *, partials: bool = False):
    """h @ [w_1; w_2; ...].T for the stream's normed rows h -> (product, the stream with its
    residual summed). Several weights (products the loader could not stack) are concatenated
    along the output."""
    if isinstance(s.h, PendingNorm):
        (w,) = ws
        out, x = qmatmul_pending_norm(s.h, w, partials=partials, implementation=_impl(plan), tuning=plan.tuning)
        return out, Stream(x, None, s.counts)
    outs = [matmul(s.h, w, partials=partials, plan=plan) for w in ws]
    return (outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=-1)), s


def add_norm(plan: Plan, how: Norm, s: Stream, a, w: Weight, post_norm, norm_w: jax.Array, eps: float) -> Stream:
    """x + post_norm(a @ w.T) (post_norm: None, or the block output's own RMS norm weight), and
    that sum RMS-normed by norm_w for the next products, the fusion `how` as planned."""
    if how in (Norm.PRODUCT, Norm.PRODUCT_ROWS):
        x, h, counts = qmatmul_add_norm(a, w, s.x, norm_w, eps, s.counts, plan.dtype, rows=how == Norm.PRODUCT_ROWS,
                                        implementation=_impl(plan), tuning=plan.tuning)
        return Stream(x, h, counts)
    parts = matmul(a, w, partials=True, plan=plan)
    if plan.tp_axis is not None:  # one device's share of a row-parallel product: sum the devices'
        parts = jax.lax.psum(parts.sum(axis=0), plan.tp_axis)[None]
    if post_norm is not None:
        parts = rms_norm(parts.sum(axis=0), post_norm, eps, jnp.float32)[None]
    if how == Norm.PENDING:
        return Stream(None, PendingNorm(s.x, parts, norm_w, eps, jnp.dtype(plan.dtype)), s.counts)
    x, h = add_rms_norm(s.x, parts, norm_w, eps, plan.dtype, quantize=how == Norm.NORM_INT8, implementation=_impl(plan))
    return Stream(x, h, s.counts)


def add_norm_sum(plan: Plan, s: Stream, out: jax.Array, norm_w: jax.Array, eps: float) -> Stream:
    """x + out for a block output `out` computed whole (a mixture of experts), and that sum
    RMS-normed by norm_w for the next products."""
    x, h = add_rms_norm(s.x, out.astype(jnp.float32)[None], norm_w, eps, plan.dtype, implementation=_impl(plan))
    return Stream(x, h, s.counts)


def route(h: jax.Array, router: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """The router's choice for the rows h (..., d): softmax over the E experts' logits, then the top
    k (as transformers' Mixtral and Qwen3-MoE do), renormalized to sum to 1 with `normalize`.
    -> (weights (..., k) float32, expert ids (..., k) int32)."""
    probs = jax.nn.softmax(jnp.einsum("...d,ed->...e", h.astype(jnp.float32), router.astype(jnp.float32)), axis=-1)
    top, index = jax.lax.top_k(probs, k)
    if normalize:
        top = top / top.sum(axis=-1, keepdims=True)
    return top, index


def _dense(w: Weight, dtype) -> jax.Array:
    return (reference.dequantize(w) if isinstance(w, QTensor) else w).astype(dtype)


def experts_reference(h, router: jax.Array, w_gate: Weight, w_up: Weight, w_down: Weight, *, k: int,
                      normalize: bool, act: str) -> jax.Array:
    """A mixture of E gated MLPs on the normed rows h (..., d), by definition: every expert runs on
    every row, weighted by the router (`route`) and 0 where not chosen. The ground truth `experts`
    is tested against. w_gate, w_up: (E, F, d); w_down: (E, d, F)."""
    h = _plain(h)
    top, index = route(h, router, k, normalize)
    weights = jnp.einsum("...k,...ke->...e", top, jax.nn.one_hot(index, router.shape[0], dtype=top.dtype))
    gate = jnp.einsum("...d,efd->...ef", h, _dense(w_gate, h.dtype), preferred_element_type=jnp.float32)
    up = jnp.einsum("...d,efd->...ef", h, _dense(w_up, h.dtype), preferred_element_type=jnp.float32)
    mid = (activation(act, gate) * up * weights[..., None]).astype(h.dtype)
    return jnp.einsum("...ef,edf->...d", mid, _dense(w_down, h.dtype), preferred_element_type=jnp.float32)


def _take_experts(w: Weight, ids: jax.Array, dtype) -> jax.Array:
    """The experts `ids` (n,) of a stacked weight (E, out, in), dense in `dtype` -> (n, out, in):
    a quantized one's packed blocks are gathered first, so only those experts' bytes are read."""
    if isinstance(w, QTensor):
        planes = jax.tree.map(lambda p: jnp.take(p, ids, axis=0), w.planes)
        return reference.dequantize(QTensor(planes, w.qtype, (int(ids.shape[0]), *w.shape[1:]))).astype(dtype)
    return jnp.take(w, ids, axis=0).astype(dtype)


def _gathered(x, top, index, w_gate, w_up, w_down, act):
    """Each row's k chosen experts' weights gathered and multiplied: a step reads n * k experts,
    not E (decode). x (n, d), top and index (n, k)."""
    n, k = index.shape
    flat = index.reshape(-1)
    gate = jnp.einsum("nd,nkfd->nkf", x, _take_experts(w_gate, flat, x.dtype).reshape(n, k, -1, x.shape[-1]),
                      preferred_element_type=jnp.float32)
    up = jnp.einsum("nd,nkfd->nkf", x, _take_experts(w_up, flat, x.dtype).reshape(n, k, -1, x.shape[-1]),
                    preferred_element_type=jnp.float32)
    mid = (activation(act, gate) * up * top[..., None]).astype(x.dtype)
    down = _take_experts(w_down, flat, x.dtype).reshape(n, k, x.shape[-1], -1)
    return jnp.einsum("nkf,nkdf->nd", mid, down, preferred_element_type=jnp.float32)


def _grouped(x, top, index, w_gate, w_up, w_down, act):
    """The n * k (row, expert) pairs sorted by expert and cut into tiles of T pairs of one expert
    each (each expert's pairs padded to whole tiles), every tile multiplied by its expert's weights:
    each expert's weights are read once per tile of its rows, an unchosen expert's never (prefill,
    larger batches). Static shapes: at most n * k / T + E tiles, run a few at a time."""
    n, k = index.shape
    n_experts, pairs = w_gate.shape[0], n * k
    tile = int(min(128, max(8, 1 << max(0, (pairs // n_experts - 1).bit_length()))))
    n_tiles = -(-pairs // tile) + n_experts
    flat = index.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pair ids by expert
    sizes = jnp.bincount(flat, length=n_experts)
    tiles = -(-sizes // tile)
    tile_end = jnp.cumsum(tiles)
    expert = jnp.searchsorted(tile_end, jnp.arange(n_tiles), side="right")  # n_experts: a tile left empty
    used = expert < n_experts
    expert = jnp.minimum(expert, n_experts - 1)
    r = (jnp.arange(n_tiles) - (tile_end - tiles)[expert])[:, None] * tile + jnp.arange(tile)  # rank in group
    valid = used[:, None] & (r < sizes[expert][:, None])
    pair = jnp.take(order, jnp.clip((jnp.cumsum(sizes) - sizes)[expert][:, None] + r, 0, pairs - 1))
    rows = pair // k
    weight = jnp.where(valid, jnp.take(top.reshape(-1), pair), 0)

    def one(args):  # one tile: (expert, its rows (T, d), their router weights (T,)) -> (T, d)
        e, xt, wt = args
        ids = e[None]
        gate = jnp.dot(xt, _take_experts(w_gate, ids, xt.dtype)[0].T, preferred_element_type=jnp.float32)
        up = jnp.dot(xt, _take_experts(w_up, ids, xt.dtype)[0].T, preferred_element_type=jnp.float32)
        mid = (activation(act, gate) * up * wt[:, None]).astype(xt.dtype)
        return jnp.dot(mid, _take_experts(w_down, ids, xt.dtype)[0].T, preferred_element_type=jnp.float32)

    out = jax.lax.map(one, (expert, jnp.take(x, rows, axis=0), weight), batch_size=8)
    out = jnp.where(valid[..., None], out, 0).reshape(-1, x.shape[-1])
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[rows.reshape(-1)].add(out)


def experts(how: str, h, router: jax.Array, w_gate: Weight, w_up: Weight, w_down: Weight, *, k: int,
            normalize: bool, act: str, tp_axis: str | None = None) -> jax.Array:
    """A mixture of E gated MLPs on the normed rows h (..., d) -> float32 (..., d): the router's
    top k experts per row (`route`), and the sum of act(h @ gate.T) * (h @ up.T) @ down.T over
    them, weighted. Only the chosen experts are computed, in the form `how` the plan chose:
    "gather" (each row's k experts' weights gathered: decode) or "grouped" (rows sorted by
    expert: prefill); "reference" runs `experts_reference` (tests). w_gate, w_up: (E, F, d); w_down: (E, d, F), dense or packed QTensors with
    a leading expert axis. On one device's shard of a split model (each expert's F split over
    the mesh axis `tp_axis`), the devices' partial sums are added here. The one entry point a
    grouped kernel would take over."""
    if how == "reference":
        out = experts_reference(h, router, w_gate, w_up, w_down, k=k, normalize=normalize, act=act)
        return out if tp_axis is None else jax.lax.psum(out, tp_axis)
    h = _plain(h)
    top, index = route(h, router, k, normalize)
    lead, d = h.shape[:-1], h.shape[-1]
    x, top, index = h.reshape(-1, d), top.reshape(-1, k), index.reshape(-1, k)
    out = (_gathered if how == "gather" else _grouped)(x, top, index, w_gate, w_up, w_down, act)
    if tp_axis is not None:
        out = jax.lax.psum(out, tp_axis)
    return out.reshape(*lead, d)


def activation(name: str, x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=True) if name == "gelu_tanh" else jax.nn.silu(x)


def glu(plan: Plan, how: Glu, gate_up: jax.Array, act: str):
    """act(gate) * up for gate_up = [gate | up] (..., 2F): computed here, rounded to int8 for an
    int8 down product in the same pass, or left to the down product's kernel."""
    if how == Glu.INT8:
        return quantize(gate_up, act, implementation=_impl(plan))
    if how == Glu.DOWN:
        return GatedX(gate_up, act)
    f = gate_up.shape[-1] // 2
    return activation(act, gate_up[..., :f]) * gate_up[..., f:]


def qkv_heads(qkv, bias, q_norm, k_norm, pos, inv_freq, *, n_heads: int, n_kv_heads: int, eps: float,
              pairing: str):
    """qkv [B, T, (Hq + 2 Hkv) D] (plus `bias`) -> q, k, v [B, T, heads, D]: q and k RMS-normed
    per head (q_norm, k_norm: Gemma's weights, or None) and rotated for positions pos [B, T]."""
    if bias is not None:
        qkv = qkv + bias.astype(qkv.dtype)
    q, k, v = split_qkv(qkv, n_heads, n_kv_heads)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    return apply_rope(q, pos, inv_freq, pairing), apply_rope(k, pos, inv_freq, pairing), v


def attention(plan: Plan, lp: LayerPlan, layer: int, qkv, bias, q_norm, k_norm, cache, pos, slots, inv_freq, *,
              n_heads: int, n_kv_heads: int, eps: float, pairing: str, scale: float, window: int | None):
    """softmax(rope(q) rope(k)^T * scale) v over the cache, with the chunk's k and v written into it
    first: qkv [B, T, (Hq + 2 Hkv) D] (or its split-K partial sums [S, B, T, ...] where the plan
    has the rotation kernel sum them), plus `bias`; q_norm, k_norm: per-head RMS norms (Gemma)
    or None. -> (output [B, T, Hq D], or rounded to int8 for the output product; cache). The
    caches run the kernels the layer's plan names, as the plan's implementation says."""
    B, T = pos.shape
    kw = dict(n_heads=n_heads, pairing=pairing, dtype=jnp.dtype(plan.dtype),
              qk_norm=None if q_norm is None else (q_norm, k_norm), eps=eps)
    if lp.attention == Attention.ROPE_ATTENTION:
        out, cache = cache.rope_write_attend(layer, qkv, bias, pos, inv_freq, **kw, scale=scale, window=window,
                                             quantize_out=lp.attn_out_int8, slots=slots,
                                             implementation=plan.implementation)
        return (out if isinstance(out, QuantizedX) else out.reshape(B, T, -1)), cache
    if lp.attention in (Attention.ROPE_APPEND, Attention.ROPE_APPEND_XLA):
        append = plan.implementation if lp.attention == Attention.ROPE_APPEND else "reference"
        q, cache = cache.rope_write(layer, qkv, bias, pos, slots, inv_freq, **kw, implementation=append)
    else:
        q, k, v = qkv_heads(qkv, bias, q_norm, k_norm, pos, inv_freq, n_heads=n_heads, n_kv_heads=n_kv_heads, eps=eps,
                            pairing=pairing)
        cache = cache.write(layer, k, v, pos, slots)
    out = cache.attend(layer, q, pos, slots, scale=scale, window=window, kernel=lp.attend,
                       implementation=plan.implementation)
    return out.reshape(B, T, -1), cache


__all__ = ["Stream", "matmul", "take_rows", "norm", "project", "add_norm", "add_norm_sum", "route", "experts",
           "experts_reference", "activation", "glu", "qkv_heads", "attention"]
