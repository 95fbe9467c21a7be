"""The transformer forward pass for every supported architecture, as pure functions.

`forward` runs a chunk of T new tokens per sequence through the model, writing their keys and
values into the KV cache and attending over everything the cache holds for that sequence. The
same function serves prefill (T = padded prompt length) and decode (T = 1, or a few tokens to
verify speculative drafts); architecture differences are static fields of `ModelConfig`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rjax.cache import KVCache
from rjax.config import ModelConfig
from rjax.quant.qtensor import Weight, matmul, take_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    attn_norm: jax.Array
    wq: Weight
    wk: Weight
    wv: Weight
    wo: Weight
    ffn_norm: jax.Array
    w_gate: Weight
    w_up: Weight
    w_down: Weight
    # Architecture-specific pieces; None where the architecture has none.
    bq: jax.Array | None = None
    bk: jax.Array | None = None
    bv: jax.Array | None = None
    q_norm: jax.Array | None = None
    k_norm: jax.Array | None = None
    post_attn_norm: jax.Array | None = None
    post_ffn_norm: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Params:
    embed: Weight                # (vocab, d_model)
    layers: tuple[LayerParams, ...]
    final_norm: jax.Array
    lm_head: Weight | None       # (vocab, d_model); None: tied to `embed`


def rms_norm(x: jax.Array, w: jax.Array, eps: float, out_dtype=None) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32)).astype(out_dtype or x.dtype)


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


def apply_rope(x: jax.Array, pos: jax.Array, inv_freq: jax.Array, pairing: str) -> jax.Array:
    """x: [B, T, H, D]; pos: [B, T] absolute positions."""
    angles = pos.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    if pairing == "pairs":
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(xf.shape)
    else:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _activation(cfg: ModelConfig, x: jax.Array) -> jax.Array:
    if cfg.activation == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.silu(x)


def _attention_block(cfg: ModelConfig, i: int, p: LayerParams, x, cache: KVCache, pos, slots):
    B, T, _ = x.shape
    q = matmul(x, p.wq)
    k = matmul(x, p.wk)
    v = matmul(x, p.wv)
    if p.bq is not None:
        q, k, v = q + p.bq, k + p.bk, v + p.bv
    q = q.reshape(B, T, cfg.n_heads, cfg.head_dim)
    k = k.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
    v = v.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
    if p.q_norm is not None:
        q = rms_norm(q, p.q_norm, cfg.rms_eps)
        k = rms_norm(k, p.k_norm, cfg.rms_eps)
    inv_freq = rope_inv_freq(cfg, cfg.layer_rope_theta[i], cfg.layer_rope_linear[i])
    q = apply_rope(q, pos, inv_freq, cfg.rope_pairing)
    k = apply_rope(k, pos, inv_freq, cfg.rope_pairing)
    cache = cache.write(i, k, v, pos, slots)
    out = cache.attend(i, q, pos, slots, scale=cfg.attn_scale, window=cfg.layer_windows[i])
    return matmul(out.reshape(B, T, cfg.n_heads * cfg.head_dim), p.wo), cache


def _layer(cfg: ModelConfig, i: int, p: LayerParams, x, cache, pos, slots, dtype):
    """x is the float32 residual stream; the blocks compute in `dtype` (bfloat16 on GPU)."""
    h = rms_norm(x, p.attn_norm, cfg.rms_eps, dtype)
    h, cache = _attention_block(cfg, i, p, h, cache, pos, slots)
    if p.post_attn_norm is not None:
        h = rms_norm(h, p.post_attn_norm, cfg.rms_eps, jnp.float32)
    x = x + h.astype(jnp.float32)
    h = rms_norm(x, p.ffn_norm, cfg.rms_eps, dtype)
    h = matmul(_activation(cfg, matmul(h, p.w_gate)) * matmul(h, p.w_up), p.w_down)
    if p.post_ffn_norm is not None:
        h = rms_norm(h, p.post_ffn_norm, cfg.rms_eps, jnp.float32)
    return x + h.astype(jnp.float32), cache


def embed(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """Token embeddings as the float32 residual stream (Gemma's scale included)."""
    x = take_rows(params.embed, tokens, jnp.float32)
    if cfg.embed_scale != 1.0:
        x = x * jnp.float32(cfg.embed_scale)
    return x


def hidden_states(cfg: ModelConfig, params: Params, cache: KVCache, tokens: jax.Array,
                  pos: jax.Array, slots: jax.Array | None, dtype=jnp.float32):
    """Final-normed hidden states [B, T, d_model] and the updated cache.

    tokens, pos: [B, T]; pos[b, t] is the absolute position of token t of sequence b, or -1 for
    padding (its K/V is not written and it attends to nothing). slots: [B] cache rows that the
    B sequences live in, or None for rows 0..B-1. The residual stream stays float32 whatever
    `dtype` the blocks compute in, as llama.cpp and the reference implementations keep it.
    """
    x = embed(cfg, params, jnp.where(pos >= 0, tokens, 0))
    for i, p in enumerate(params.layers):
        x, cache = _layer(cfg, i, p, x, cache, pos, slots, dtype)
    return rms_norm(x, params.final_norm, cfg.rms_eps, dtype), cache


def logits_from_hidden(params: Params, h: jax.Array) -> jax.Array:
    head = params.embed if params.lm_head is None else params.lm_head
    return matmul(h, head).astype(jnp.float32)


def forward(cfg: ModelConfig, params: Params, cache: KVCache, tokens, pos, slots=None, dtype=jnp.float32):
    """Logits for every position [B, T, vocab] (float32) and the updated cache."""
    h, cache = hidden_states(cfg, params, cache, tokens, pos, slots, dtype)
    return logits_from_hidden(params, h), cache
