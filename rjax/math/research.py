"""The model as one differentiable function, for research: `forward` from token ids or input
embeddings to logits and hidden states, and `split_params` / `merge_params` to take gradients
with respect to the float parameters while the quantized weights stay frozen.

`forward` is the engine's forward pass (`rjax.math.model.layers_forward`) run from position 0 over a
fresh KV cache it throws away, on the XLA plan (`plan_for(gpu=False)`: dequantize-then-dot and
XLA's attention on any backend), because the GPU kernels have no derivatives. It is a pure jitted
function of arrays, so `jax.grad`, `jax.vmap` and `jax.jit` compose with it.

Gradients: a quantized weight (`QTensor`) stores integer planes, which have no gradient, beside
float16 block scales that belong to the encoding. `split_params` puts every QTensor in the
frozen half and every float array (norms, biases, unquantized weights: all of a float model's
weights) in the trainable half; `merge_params(trainable, frozen)` rebuilds the params.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from gguf_blocks.qtensor import QTensor
from rjax.math.cache import init_cache
from rjax.math.config import ModelConfig
from rjax.math.model import embed, layers_forward, logits_from_hidden
from rjax.math.params import Params
from rjax.math.plan import plan_for


class NotDifferentiableError(ValueError):
    """Gradients asked of parameters that have none (quantized weights); the message names them."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardResult:
    logits: jax.Array              # [B, T, vocab] float32
    hidden: jax.Array              # [B, T, d_model] final-normed hidden states: the LM head's input
    # [n_layers + 1, B, T, d_model] float32: the residual stream entering layer 0 (the input
    # embeddings) and after each layer, before the final norm; None unless asked for.
    residuals: jax.Array | None = None


def forward(cfg: ModelConfig, params: Params, tokens=None, *, embeddings=None, lengths=None, residuals: bool = False,
            dtype=jnp.float32) -> ForwardResult:
    """Run the model over B sequences from position 0, causally, with no cache kept.

    Give `tokens` [B, T] (int ids) or `embeddings` [B, T, d_model] (the residual stream's input,
    what `rjax.embed(cfg, params, tokens)` returns, Gemma's scale included), not both. `lengths`
    [B]: each sequence's length in a right-padded batch (default: all T); padding positions
    attend to nothing and their outputs are meaningless. `residuals`: also return the residual
    stream at every layer. `dtype`: what the blocks compute in (the residual stream is float32).
    """
    if (tokens is None) == (embeddings is None):
        raise ValueError("rjax.forward takes tokens or embeddings, exactly one of them")
    if params.tp is not None:
        raise ValueError("rjax.forward runs on one device; these params are split over a mesh (load without mesh=)")
    if embeddings is not None:
        embeddings = jnp.asarray(embeddings)
        if embeddings.ndim != 3 or embeddings.shape[-1] != cfg.d_model:
            raise ValueError(f"rjax.forward: embeddings must be [batch, tokens, {cfg.d_model}] (d_model), "
                             f"got shape {tuple(embeddings.shape)}")
        shape = embeddings.shape[:2]
    else:
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"rjax.forward: tokens must be integer ids [batch, tokens], got {tokens.dtype}"
                             f"{list(tokens.shape)}")
        shape = tokens.shape
    if lengths is None:
        lengths = jnp.full(shape[:1], shape[1], jnp.int32)
    return _forward(cfg, params, tokens, embeddings, jnp.asarray(lengths, jnp.int32), residuals, jnp.dtype(dtype).name)


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _forward(cfg, params, tokens, embeddings, lengths, residuals, dtype):
    B, T = (tokens if tokens is not None else embeddings).shape[:2]
    pos = jnp.where(jnp.arange(T)[None] < lengths[:, None], jnp.arange(T, dtype=jnp.int32)[None], -1)
    x = embed(cfg, params, jnp.where(pos >= 0, tokens, 0)) if tokens is not None else embeddings.astype(jnp.float32)
    cache = init_cache(cfg, B, T, dtype)
    plan = plan_for(cfg, params, B, T, dtype, gpu=False)
    h, _, after = layers_forward(cfg, params, plan, cache, x, pos, None)
    return ForwardResult(logits_from_hidden(params, h), h, jnp.stack((x, *after)) if residuals else None)


def _name(path) -> str:
    return ".".join(str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k)))) for k in path)


def _is_frozen(leaf) -> bool:
    return isinstance(leaf, QTensor) or not jnp.issubdtype(leaf.dtype, jnp.inexact)


def split_params(params: Params, trainable: Callable[[str], bool] | None = None) -> tuple[Params, Params]:
    """-> (trainable, frozen): two params pytrees of the same shape, each with None where the
    other holds a tensor. `trainable`: a predicate on a tensor's name ("embed", "final_norm",
    "layers.3.attn_norm", "layers.3.wq", ...) choosing what to train among the float tensors
    (default: all of them); naming a quantized weight raises NotDifferentiableError listing
    every one named. Differentiate a function of `merge_params(trainable, frozen)` with respect
    to `trainable`."""
    named = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, QTensor))[0]
    if trainable is not None:
        bad = [f"{_name(p)} ({x.qtype.name if isinstance(x, QTensor) else x.dtype})" for p, x in named
               if _is_frozen(x) and trainable(_name(p))]
        if bad:
            raise NotDifferentiableError(
                f"cannot differentiate {len(bad)} quantized weight(s): {', '.join(bad[:8])}"
                f"{', ...' if len(bad) > 8 else ''}: their planes are integers. Leave them out of `trainable`, "
                "or load a model whose weights are float (an F32/F16/BF16 GGUF or a safetensors directory)")
    train = [not _is_frozen(x) and (trainable is None or trainable(_name(p))) for p, x in named]
    treedef = jax.tree.structure(params, is_leaf=lambda x: isinstance(x, QTensor))
    leaves = [x for _, x in named]
    return (jax.tree.unflatten(treedef, [x if t else None for x, t in zip(leaves, train)]),
            jax.tree.unflatten(treedef, [None if t else x for x, t in zip(leaves, train)]))


def merge_params(trainable: Params, frozen: Params) -> Params:
    """The params that `split_params` split (each tensor from whichever half holds it)."""
    return jax.tree.map(lambda t, f: f if t is None else t, trainable, frozen,
                        is_leaf=lambda x: x is None or isinstance(x, QTensor))
