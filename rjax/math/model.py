"""The transformer forward pass for every supported architecture, as pure functions.

`forward` runs a chunk of T new tokens per sequence through the model, writing their keys and
values into the KV cache and attending over everything the cache holds for that sequence. The
same function serves prefill (T = padded prompt length) and decode (T = 1, or a few tokens to
verify speculative drafts); architecture differences are static fields of `ModelConfig`.

Every layer is the same math:

    h = norm(x)
    q, k, v = h @ [wq; wk; wv].T (+ bias); q, k = norm(q), norm(k) (Gemma); q, k = rope(q), rope(k)
    x = x + post_norm(attention(q, k, v, cache) @ wo.T)           (post_norm: Gemma only)
    h = norm(x)
    x = x + post_norm((act(h @ w_gate.T) * (h @ w_up.T)) @ w_down.T)   (or a mixture of such MLPs)

The residual stream x stays float32; the blocks compute in `dtype` (bfloat16 on a GPU). Which
kernels run these ops, and which ops one kernel does together, is the plan's business
(rjax.math.plan): the model hands each op its layer's plan and never sees the kernels' types.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from gguf_blocks import reference
from gguf_blocks.qtensor import QTensor
from rjax.math import ops, tensor_parallel
from rjax.math.config import ModelConfig
from rjax.math.params import LayerParams, Params
from rjax.math.plan import TUNING, Attention, LayerPlan, Plan, Tuning, plan_for


def rope_inv_freq(cfg: ModelConfig, theta: float, linear: float = 1.0) -> jax.Array:
    d = cfg.head_dim
    inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)) / linear
    if cfg.rope_freq_factors is not None:
        inv = inv / jnp.asarray(cfg.rope_freq_factors, jnp.float32)
    s = cfg.rope_scaling
    if s is not None:  # Llama 3: stretch low frequencies, keep high ones, blend between
        low_wavelen = s.original_context_length / s.low_freq_factor
        high_wavelen = s.original_context_length / s.high_freq_factor
        wavelen = 2 * jnp.pi / inv
        smooth = (s.original_context_length / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * inv / s.factor + smooth * inv
        inv = jnp.where(wavelen > low_wavelen, inv / s.factor, jnp.where(wavelen < high_wavelen, inv, blended))
    return inv


def _bias(p: LayerParams):
    return None if p.bq is None else jnp.concatenate([p.bq, p.bk, p.bv])


def _layer(cfg: ModelConfig, plan: Plan, lp: LayerPlan, i: int, p: LayerParams, s: ops.Stream, cache, pos, slots,
           next_norm: jax.Array) -> tuple[ops.Stream, object]:
    """One transformer layer on the stream s (x and norm(x) for its q/k/v) -> the stream after
    the layer, normed by `next_norm` for the next layer (or the LM head), and the cache."""
    if plan.layer_calls:
        return _layer_by_calls(cfg, plan, lp, i, p, s, cache, pos, slots, next_norm)
    qkv, s = ops.project(plan, s, [p.wqkv] if p.wqkv is not None else [p.wq, p.wk, p.wv],
                         partials=lp.attention != Attention.XLA)
    attn, cache = ops.attention(plan, lp, i, qkv, _bias(p), p.q_norm, p.k_norm, cache, pos, slots,
                                rope_inv_freq(cfg, cfg.layer_rope_theta[i], cfg.layer_rope_linear[i]),
                                n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, eps=cfg.rms_eps,
                                pairing=cfg.rope_pairing, scale=cfg.attn_scale, window=cfg.layer_windows[i])
    return _after_attention(cfg, plan, lp, p, s, attn, next_norm), cache


def _after_attention(cfg: ModelConfig, plan: Plan, lp: LayerPlan, p: LayerParams, s: ops.Stream, attn,
                     next_norm: jax.Array) -> ops.Stream:
    """The rest of a layer after its attention output `attn`: the output product and its add +
    norm, then the MLP (or the mixture of experts) and its add + norm by `next_norm`."""
    s = ops.add_norm(plan, lp.ffn_norm, s, attn, p.wo, p.post_attn_norm, p.ffn_norm, cfg.rms_eps)
    if cfg.n_experts:
        out = ops.experts(lp.gate_up, s.h, p.router, p.w_gate_exps, p.w_up_exps, p.w_down_exps, k=cfg.n_experts_used,
                          normalize=cfg.expert_norm, act=cfg.activation, tp_axis=plan.tp_axis)
        return ops.add_norm_sum(plan, s, out, next_norm, cfg.rms_eps)
    gate_up, s = ops.project(plan, s, [p.w_gate_up] if p.w_gate_up is not None else [p.w_gate, p.w_up])
    gated = ops.glu(plan, lp.glu, gate_up, cfg.activation)
    return ops.add_norm(plan, lp.out_norm, s, gated, p.w_down, p.post_ffn_norm, next_norm, cfg.rms_eps)


# Layer calls (a plan's `layer_calls`: the XLA path): each layer runs as two calls of computations
# that every layer of the same shapes and settings shares, so XLA traces, lowers and compiles a
# layer once per program instead of once per layer. The K/V write runs between the calls, in the
# calling program, where it updates the cache in place (a call's outputs are buffers of their own).

@functools.cache
def _layer_config(cfg: ModelConfig, i: int) -> ModelConfig:
    """cfg as one layer sees it: equal for layers of equal window and rope settings."""
    return dataclasses.replace(cfg, n_layers=1, layer_windows=(cfg.layer_windows[i],),
                               layer_rope_theta=(cfg.layer_rope_theta[i],), layer_rope_linear=(cfg.layer_rope_linear[i],))


def _dense(p: LayerParams, dtype) -> LayerParams:
    """The layer's weights dequantized, as its products would dequantize them (experts stay packed:
    a step reads only those it routes to). Done in the calling program, where XLA hoists it out
    of a decode loop (inside a call it would run every step)."""
    return jax.tree.map(lambda w: reference.dequantize(w).astype(dtype) if isinstance(w, QTensor) and len(w.shape) == 2
                        else w, p, is_leaf=lambda w: isinstance(w, QTensor))


@functools.partial(jax.jit, static_argnums=1)
def _dense_layer(p: LayerParams, dtype) -> LayerParams:
    return _dense(p, dtype)


def dense_layers(params: Params, dtype) -> Params:
    """params with every layer's weights dequantized to `dtype`, as the layer calls dequantize
    them in each program: the same values, converted once for programs that run many times."""
    dtype = jnp.dtype(dtype)
    return dataclasses.replace(params, layers=tuple(_dense_layer(p, dtype) for p in params.layers))


def dense_layers_bytes(params: Params, dtype) -> int:
    """The bytes `dense_layers` adds: each layer's quantized 2-D weights in `dtype`."""
    return sum(w.shape[0] * w.shape[1] * jnp.dtype(dtype).itemsize for p in params.layers
               for w in jax.tree.leaves(p, is_leaf=lambda w: isinstance(w, QTensor))
               if isinstance(w, QTensor) and len(w.shape) == 2)


@functools.partial(jax.jit, static_argnums=(0, 1), inline=jax.Inline.XLA_LATE)
def _attention_in(cfg: ModelConfig, plan: Plan, p: LayerParams, x, h, pos):
    """A layer's queries, keys and values [B, T, heads, D], normed (Gemma) and rotated."""
    qkv, _ = ops.project(plan, ops.Stream(x, h), [p.wqkv] if p.wqkv is not None else [p.wq, p.wk, p.wv])
    inv_freq = rope_inv_freq(cfg, cfg.layer_rope_theta[0], cfg.layer_rope_linear[0])
    return ops.qkv_heads(qkv, _bias(p), p.q_norm, p.k_norm, pos, inv_freq, n_heads=cfg.n_heads,
                         n_kv_heads=cfg.n_kv_heads, eps=cfg.rms_eps, pairing=cfg.rope_pairing)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), inline=jax.Inline.XLA_LATE)
def _attention_out(cfg: ModelConfig, plan: Plan, lp: LayerPlan, p: LayerParams, x, h, q, view, at, pos, slots,
                   next_norm):
    """Attention of q over the layer's K/V (`view`, `at`: `layer_view`'s), then the rest of the layer."""
    B, T = pos.shape
    attn = view.attend(0 if at is None else at, q, pos, slots, scale=cfg.attn_scale, window=cfg.layer_windows[0],
                       kernel=lp.attend, implementation=plan.implementation)
    s = _after_attention(cfg, plan, lp, p, ops.Stream(x, h), attn.reshape(B, T, -1), next_norm)
    return s.x, s.h


def _layer_by_calls(cfg: ModelConfig, plan: Plan, lp: LayerPlan, i: int, p: LayerParams, s: ops.Stream, cache,
                    pos, slots, next_norm):
    one = _layer_config(cfg, i)
    p = _dense(p, jnp.dtype(plan.dtype))
    q, k, v = _attention_in(one, plan, p, s.x, s.h, pos)
    cache = cache.write(i, k, v, pos, slots)
    view, at = cache.layer_view(i)
    x, h = _attention_out(one, plan, lp, p, s.x, s.h, q, view, at, pos, slots, next_norm)
    return ops.Stream(x, h), cache


def embed(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """Token embeddings as the float32 residual stream (Gemma's scale included)."""
    x = ops.take_rows(params.embed, tokens, jnp.float32)
    if cfg.embed_scale != 1.0:
        x = x * jnp.float32(cfg.embed_scale)
    return x


def plan_of(cfg: ModelConfig, params: Params, cache, tokens: jax.Array, slots, dtype, tuning: Tuning = TUNING,
            tp_axis: str | None = None) -> Plan:
    """The plan for this call's shapes, cache (kind, length, dtype) and backend (on one device's
    shard of a split model: `tp_axis` names the mesh axis its row-parallel products are summed over)."""
    B, T = tokens.shape
    return plan_for(cfg, params, B, T, dtype, paged=cache.paged, slots=slots is not None, tuning=tuning,
                    tp_axis=tp_axis, cache_len=cache.max_len, cache_dtype=cache.storage_dtype)


def hidden_states(cfg: ModelConfig, params: Params, cache, tokens: jax.Array, pos: jax.Array,
                  slots: jax.Array | None, dtype=jnp.float32, plan: Plan | None = None, *,
                  tuning: Tuning = TUNING, tp_axis: str | None = None):
    """Final-normed hidden states [B, T, d_model] and the updated cache.

    tokens, pos: [B, T]; pos[b, t] is the absolute position of token t of sequence b, or -1 for
    padding (its K/V is not written and it attends to nothing). slots: [B] cache rows that the
    B sequences live in, or None for rows 0..B-1. `plan`: the fusion plan (rjax.math.plan), by
    default `plan_of` this call's. Params split over devices run this per device
    (rjax.math.tensor_parallel), each shard planned for its own shapes.
    """
    if params.tp is not None:
        return tensor_parallel.hidden_states(hidden_states, cfg, params, cache, tokens, pos, slots, dtype,
                                             plan.tuning if plan is not None else tuning)
    plan = plan or plan_of(cfg, params, cache, tokens, slots, dtype, tuning, tp_axis)
    h, cache, _ = layers_forward(cfg, params, plan, cache, embed(cfg, params, jnp.where(pos >= 0, tokens, 0)), pos,
                                 slots)
    return h, cache


def layers_forward(cfg: ModelConfig, params: Params, plan: Plan, cache, x: jax.Array, pos: jax.Array,
                   slots: jax.Array | None):
    """The layers over the float32 residual stream x [B, T, d_model] (`embed`'s output, or any
    input embeddings) -> (final-normed hidden states, the cache, the residual stream after each
    layer: a tuple with None where the plan leaves a layer's add and norm to the next product's
    kernel). pos, slots: as `hidden_states`."""
    layers = params.layers
    s = ops.norm(plan, x, layers[0].attn_norm, cfg.rms_eps)
    after = []
    for i, (p, lp) in enumerate(zip(layers, plan.layers)):
        next_norm = params.final_norm if i + 1 == len(layers) else layers[i + 1].attn_norm
        s, cache = _layer(cfg, plan, lp, i, p, s, cache, pos, slots, next_norm)
        after.append(s.x)
    return s.h, cache, tuple(after)


def logits_from_hidden(params: Params, h: jax.Array) -> jax.Array:
    if params.tp is not None:  # split over the vocabulary where the head is
        return tensor_parallel.logits(logits_from_hidden, params, h)
    head = params.embed if params.lm_head is None else params.lm_head
    return ops.matmul(h, head).astype(jnp.float32)


def forward(cfg: ModelConfig, params: Params, cache, tokens, pos, slots=None, dtype=jnp.float32,
            plan: Plan | None = None):
    """Logits for every position [B, T, vocab] (float32) and the updated cache."""
    h, cache = hidden_states(cfg, params, cache, tokens, pos, slots, dtype, plan)
    return logits_from_hidden(params, h), cache
