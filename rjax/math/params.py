"""The model's parameters as a pytree: `Params` (embedding, final norm, output head) over one
`LayerParams` per layer, each weight a dense array or a `QTensor`. Loaders fill them, the layout
re-arranges them and the model reads them; none of those is imported here."""
from __future__ import annotations

import dataclasses

import jax

from gguf_blocks.qtensor import Weight
from rjax.math.tensor_parallel import TensorParallel


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
    # Mixture of experts, in place of w_gate, w_up, w_down: the router (n_experts, d_model) and
    # the experts' weights stacked (n_experts, out, in).
    router: jax.Array | None = None
    w_gate_exps: jax.Array | None = None
    w_up_exps: jax.Array | None = None
    w_down_exps: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Params:
    embed: Weight                # (vocab, d_model)
    layers: tuple[LayerParams, ...]
    final_norm: jax.Array
    lm_head: Weight | None       # (vocab, d_model); None: tied to `embed`
    # The device mesh the params are split over (rjax.math.tensor_parallel); None: one device.
    tp: TensorParallel | None = dataclasses.field(default=None, metadata=dict(static=True))
