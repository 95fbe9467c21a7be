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

from pallas_kernels.attention import fuses_rope
from pallas_kernels.int8_activations import GatedX, QuantizedX, quantize
from pallas_kernels.kv_append import apply_rope, split_qkv
from pallas_kernels.rms_norm import PendingNorm, add_rms_norm, rms_norm
from rjax.cache import KVCache
from rjax.config import ModelConfig
from rjax.quant.qtensor import QTensor, Weight, matmul, matmul_partials, take_rows
from rjax.quant.reference import q4_k_chunks
from rjax.quant.words import as_words


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    attn_norm: jax.Array
    wq: Weight | None            # None when fused into `wqkv`
    wk: Weight | None
    wv: Weight | None
    wo: Weight
    ffn_norm: jax.Array
    w_gate: Weight | None        # None when fused into `w_gate_up`
    w_up: Weight | None
    w_down: Weight
    # q, k, v (gate, up) stacked along the output rows: one matmul instead of three (two);
    # see `fuse_projections`.
    wqkv: Weight | None = None
    w_gate_up: Weight | None = None
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


def _stack_rows(ws: list[Weight]) -> Weight | None:
    """Weights (n_i, K) of one type -> one weight (sum n_i, K); None if their types differ."""
    if all(isinstance(w, QTensor) for w in ws):
        if len({(w.qtype, w.shape[1]) for w in ws}) != 1:
            return None
        planes = jax.tree.map(lambda *p: jnp.concatenate(p, axis=0), *[w.planes for w in ws])
        return QTensor(planes, ws[0].qtype, (sum(w.shape[0] for w in ws), ws[0].shape[1]))
    if any(isinstance(w, QTensor) for w in ws) or len({(w.dtype, w.shape[1]) for w in ws}) != 1:
        return None
    return jnp.concatenate(ws, axis=0)


def fuse_projections(params: Params) -> Params:
    """Stack each layer's q, k, v weights into `wqkv` and gate, up into `w_gate_up` where they
    share a type (a Q4_K_M file's Q6_K v stays apart): the same products in fewer, larger
    matmuls, which is what decoding small batches on a GPU is bound by (one kernel launch and
    one pass over the activations per matmul). Layer by layer, so the extra memory while
    fusing is one layer's projections."""
    layers = []
    for p in params.layers:
        if p.wqkv is None and (qkv := _stack_rows([p.wq, p.wk, p.wv])) is not None:
            p = dataclasses.replace(p, wqkv=qkv, wq=None, wk=None, wv=None)
        if p.w_gate_up is None and (gu := _stack_rows([p.w_gate, p.w_up])) is not None:
            p = dataclasses.replace(p, w_gate_up=gu, w_gate=None, w_up=None)
        layers.append(p)
    return dataclasses.replace(params, layers=tuple(layers))


def gpu_weight_layout(params: Params) -> Params:
    """The same values in the layout the GPU decode kernels read fastest: every Q4_K weight's
    packed 6-bit scales re-encoded per quant chunk (`Q4_KChunks`: fewer loads and integer
    ops; 3% more bytes), and the quant planes of the weights whose kernels read words faster
    viewed as int32 words (rjax.quant.words, `gemv.reads_words`)."""
    return jax.tree.map(_gpu_weight, params, is_leaf=lambda x: isinstance(x, QTensor))


def _gpu_weight(w):
    from pallas_kernels.quant_matmul.gemv import reads_words  # here: the kernels import rjax.quant

    w = q4_k_chunks(w)
    return as_words(w) if isinstance(w, QTensor) and reads_words(w.qtype, *w.shape) else w


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


def _activation(cfg: ModelConfig, x: jax.Array) -> jax.Array:
    if cfg.activation == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.silu(x)


def _project(h, w: Weight, partials: bool = False):
    """(h @ w.T, or its partial sums, and the residual stream where h is a PendingNorm, which
    the product materializes; else None)."""
    from pallas_kernels.quant_matmul import qmatmul_pending_norm  # here: the kernels import rjax

    if isinstance(h, PendingNorm):
        if isinstance(w, QTensor):
            return qmatmul_pending_norm(h, w, partials=partials)
        x, h = h.materialize()
        return (matmul_partials if partials else matmul)(h, w), x
    return (matmul_partials if partials else matmul)(h, w), None


def _attention_block(cfg: ModelConfig, i: int, p: LayerParams, x, cache: KVCache, pos, slots):
    """Attention of the normed rows x [B, T, d_model] (or a PendingNorm of them): its output
    [B, T, Hq * D] before the output projection, the cache with the chunk's keys and values
    written, and the residual stream where x was a PendingNorm (else None)."""
    B, T, _ = x.shape
    residual = None
    if isinstance(x, PendingNorm) and (p.wqkv is None or p.q_norm is not None or not isinstance(cache, KVCache)):
        residual, x = x.materialize()
    inv_freq = rope_inv_freq(cfg, cfg.layer_rope_theta[i], cfg.layer_rope_linear[i])
    if p.wqkv is not None:
        if p.q_norm is None and isinstance(cache, KVCache):
            # Sum of the split-K partials, bias, split, rotation and cache append: one kernel at
            # decode, or one with the attention too (every slot decoding one token).
            bias = None if p.bq is None else jnp.concatenate([p.bq, p.bk, p.bv])
            parts, residual = _project(x, p.wqkv, partials=True)
            if slots is None and fuses_rope(B, T):
                from pallas_kernels.quant_matmul import gemv, runs_int8_gemv

                out, cache = cache.rope_write_attend(i, parts, bias, pos, inv_freq, n_heads=cfg.n_heads,
                                                     pairing=cfg.rope_pairing, dtype=x.dtype, scale=cfg.attn_scale,
                                                     window=cfg.layer_windows[i],
                                                     quantize_out=bool(gemv.QUANTIZED_ATTENTION_OUT)
                                                     and cfg.head_dim % 32 == 0 and runs_int8_gemv(p.wo, B * T, x.dtype))
                if isinstance(out, QuantizedX):
                    return out, cache, residual
                return out.reshape(B, T, cfg.n_heads * cfg.head_dim), cache, residual
            q, cache = cache.rope_write(i, parts, bias, pos, slots, inv_freq,
                                        n_heads=cfg.n_heads, pairing=cfg.rope_pairing, dtype=x.dtype)
            return (*_attention_output(cfg, i, p, q, cache, pos, slots), residual)
        qkv, residual = _project(x, p.wqkv)
        if p.bq is not None:
            qkv = qkv + jnp.concatenate([p.bq, p.bk, p.bv]).astype(qkv.dtype)
        q, k, v = split_qkv(qkv, cfg.n_heads, cfg.n_kv_heads)
    else:
        q, k, v = matmul(x, p.wq), matmul(x, p.wk), matmul(x, p.wv)
        if p.bq is not None:
            q, k, v = (q + p.bq).astype(q.dtype), (k + p.bk).astype(k.dtype), (v + p.bv).astype(v.dtype)
        q = q.reshape(B, T, cfg.n_heads, cfg.head_dim)
        k = k.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
        v = v.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
    if p.q_norm is not None:
        q = rms_norm(q, p.q_norm, cfg.rms_eps)
        k = rms_norm(k, p.k_norm, cfg.rms_eps)
    q = apply_rope(q, pos, inv_freq, cfg.rope_pairing)
    k = apply_rope(k, pos, inv_freq, cfg.rope_pairing)
    cache = cache.write(i, k, v, pos, slots)
    return (*_attention_output(cfg, i, p, q, cache, pos, slots), residual)


def _attention_output(cfg: ModelConfig, i: int, p: LayerParams, q, cache, pos, slots):
    """Attention of q [B, T, Hq, D] over the cache, [B, T, Hq * D] (before the output projection)."""
    B, T = q.shape[:2]
    out = cache.attend(i, q, pos, slots, scale=cfg.attn_scale, window=cfg.layer_windows[i])
    return out.reshape(B, T, cfg.n_heads * cfg.head_dim), cache


def _post_norm(cfg: ModelConfig, parts: jax.Array, w: jax.Array | None) -> jax.Array:
    """A block output given as partial sums, normed where the architecture norms it (Gemma)."""
    if w is None:
        return parts
    return rms_norm(parts.sum(axis=0), w, cfg.rms_eps, jnp.float32)[None]


def _int8_in(weights, rows: int, dtype) -> bool:
    """Whether every one of these products wants its x rounded to int8 by the kernel before it."""
    from pallas_kernels.quant_matmul import takes_quantized_x  # here: the kernels import rjax

    return all(takes_quantized_x(w, rows, dtype) for w in weights if w is not None)


def _qkv_weights(p: LayerParams) -> list:
    return [p.wqkv, p.wq, p.wk, p.wv]


def _ffn_in_weights(p: LayerParams) -> list:
    return [p.w_gate_up, p.w_gate, p.w_up]


def _residual_norm(cfg: ModelConfig, a, w, post_norm, x, norm, consumers, counts, dtype):
    """x + a @ w.T (post-normed where the architecture norms a block's output), and that sum
    RMS-normed by `norm` for the products `consumers` (None: for no product, as a plain array)
    -> (residual, normed, counts). Where the product's kernel can do the add and the norm
    itself (`fuses_add_norm`), it does, with `counts` (see qmatmul_add_norm). Where the one
    consumer's kernel can (`takes_pending_norm`), the normed rows are a PendingNorm and the
    residual None: the consumer's product hands it back (`_project`)."""
    from pallas_kernels.quant_matmul import fuses_add_norm, qmatmul_add_norm, takes_pending_norm

    rows = x.shape[0] * x.shape[1]
    if post_norm is None and consumers is not None and fuses_add_norm(w, rows, dtype, consumers):
        return qmatmul_add_norm(a, w, x, norm, cfg.rms_eps, counts, dtype)
    parts = _post_norm(cfg, matmul_partials(a, w), post_norm)
    takers = [c for c in consumers or () if c is not None]
    if len(takers) == 1 and takes_pending_norm(takers[0], rows, dtype):
        return None, PendingNorm(x, parts, norm, cfg.rms_eps, jnp.dtype(dtype)), counts
    quantize = consumers is not None and _int8_in(consumers, rows, dtype)
    return (*add_rms_norm(x, parts, norm, cfg.rms_eps, dtype, quantize=quantize), counts)


def _layer(cfg: ModelConfig, i: int, p: LayerParams, x, h, cache, pos, slots, dtype, next_norm, next_consumers,
           counts):
    """One transformer layer. x is the float32 residual stream, h the rows normed for this
    layer's attention (or, with x None, a PendingNorm that holds the residual). Returns the
    residual with the layer's output added, that normed by `next_norm` for `next_consumers`
    (the next layer's q/k/v products, or None after the last layer; the pair may again be None
    and a PendingNorm), the cache, and the counts the fused residual-norm products pass on.
    The blocks compute in `dtype` (bfloat16 on GPU)."""
    from pallas_kernels.quant_matmul import fuses_glu, qmatmul_glu, takes_gated_x  # here: the kernels import rjax

    rows = h.shape[0] * h.shape[1]
    attn, cache, residual = _attention_block(cfg, i, p, h, cache, pos, slots)
    x = x if residual is None else residual
    x, h, counts = _residual_norm(cfg, attn, p.wo, p.post_attn_norm, x, p.ffn_norm, _ffn_in_weights(p), counts,
                                  dtype)
    if isinstance(h, PendingNorm) and p.w_gate_up is None:
        x, h = h.materialize()
    if p.w_gate_up is not None and fuses_glu(p.w_gate_up, p.w_down, rows, dtype):
        if isinstance(h, PendingNorm):
            x, h = h.materialize()
        glu_out = qmatmul_glu(h, p.w_gate_up, cfg.activation, dtype)  # act(gate) * up rounded in the product
    elif p.w_gate_up is not None:
        gate_up, residual = _project(h, p.w_gate_up)
        x = x if residual is None else residual
        if _int8_in([p.w_down], rows, dtype):  # act(gate) * up rounded to int8 in one kernel
            glu_out = quantize(gate_up, cfg.activation)
        elif takes_gated_x(p.w_down, rows, dtype):  # act(gate) * up applied by the down product's kernel
            glu_out = GatedX(gate_up, cfg.activation)
        else:
            glu_out = _activation(cfg, gate_up[..., :cfg.d_ff]) * gate_up[..., cfg.d_ff:]
    else:
        glu_out = _activation(cfg, matmul(h, p.w_gate)) * matmul(h, p.w_up)
    x, h, counts = _residual_norm(cfg, glu_out, p.w_down, p.post_ffn_norm, x, next_norm, next_consumers, counts,
                                  dtype)
    return x, h, cache, counts


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
    rows = x.shape[0] * x.shape[1]
    layers = params.layers
    x, h = add_rms_norm(x, None, layers[0].attn_norm, cfg.rms_eps, dtype,
                        quantize=_int8_in(_qkv_weights(layers[0]), rows, dtype))
    counts = jnp.zeros((cfg.d_model // 32,), jnp.int32)  # dropped by XLA where no product fuses the norm
    for i, p in enumerate(layers):
        last = i + 1 == len(layers)
        next_norm = params.final_norm if last else layers[i + 1].attn_norm
        next_consumers = None if last else _qkv_weights(layers[i + 1])
        x, h, cache, counts = _layer(cfg, i, p, x, h, cache, pos, slots, dtype, next_norm, next_consumers, counts)
    return h, cache


def logits_from_hidden(params: Params, h: jax.Array) -> jax.Array:
    head = params.embed if params.lm_head is None else params.lm_head
    return matmul(h, head).astype(jnp.float32)


def forward(cfg: ModelConfig, params: Params, cache: KVCache, tokens, pos, slots=None, dtype=jnp.float32):
    """Logits for every position [B, T, vocab] (float32) and the updated cache."""
    h, cache = hidden_states(cfg, params, cache, tokens, pos, slots, dtype)
    return logits_from_hidden(params, h), cache
