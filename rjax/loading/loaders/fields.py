"""The params fields a `ModelConfig` implies, as both loaders fill them: each field's shape, the
fields every layer needs, which fields are norms and biases, and the `Params` built from them.

Both loaders name tensors in their own file's terms but check and assemble the same fields, so
a GGUF and a Hugging Face checkpoint of one model give the same params.
"""
from __future__ import annotations

from rjax.math.config import ModelConfig
from rjax.math.params import LayerParams, Params

# Applied elementwise, so never quantized.
NORM_FIELDS = frozenset({"attn_norm", "ffn_norm", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm",
                         "final_norm"})
BIAS_FIELDS = frozenset({"bq", "bk", "bv"})


def expected_shape(cfg, field: str) -> tuple[int, ...]:
    """The (out, in) shape a `LayerParams` / `Params` field has under `cfg`."""
    q, kv, d = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.d_model
    return {
        "embed": (cfg.vocab_size, d), "lm_head": (cfg.vocab_size, d), "final_norm": (d,),
        "attn_norm": (d,), "ffn_norm": (d,), "post_attn_norm": (d,), "post_ffn_norm": (d,),
        "q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,),
        "wq": (q, d), "wk": (kv, d), "wv": (kv, d), "wo": (d, q), "bq": (q,), "bk": (kv,), "bv": (kv,),
        "w_gate": (cfg.d_ff, d), "w_up": (cfg.d_ff, d), "w_down": (d, cfg.d_ff),
        "wqkv": (q + 2 * kv, d), "w_gate_up": (2 * cfg.d_ff, d),
        "router": (cfg.n_experts, d), "w_gate_exps": (cfg.n_experts, cfg.expert_d_ff, d),
        "w_up_exps": (cfg.n_experts, cfg.expert_d_ff, d), "w_down_exps": (cfg.n_experts, d, cfg.expert_d_ff),
    }[field]


# Products a file may store stacked (Phi-3 does): either the stacked field or all of its parts.
FUSED_FIELDS = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


def required_layer_fields(cfg: ModelConfig) -> list[str]:
    """The `LayerParams` fields every layer of `cfg` must load, in the order missing ones are named."""
    if cfg.n_experts:
        required = ["attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "router", "w_gate_exps", "w_up_exps", "w_down_exps"]
    elif cfg.arch == "phi3":
        required = ["attn_norm", "wqkv", "wo", "ffn_norm", "w_gate_up", "w_down"]
    else:
        required = ["attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down"]
    if cfg.qkv_bias:
        required += ["bq", "bk", "bv"]
    if cfg.qk_norm:
        required += ["q_norm", "k_norm"]
    if cfg.post_norms:
        required += ["post_attn_norm", "post_ffn_norm"]
    return required


def missing_layer_fields(cfg: ModelConfig, have) -> list[str]:
    """The required fields of one layer that `have` (the fields loaded) lacks; a stacked product
    stands in for its parts and its parts for it."""
    have = set(have)
    for fused, parts in FUSED_FIELDS.items():
        if fused in have or have.issuperset(parts):
            have |= {fused, *parts}
    return [f for f in required_layer_fields(cfg) if f not in have]


def assemble_params(cfg: ModelConfig, top: dict, layers: list[dict]) -> Params:
    """Loaded fields (top-level ones, and one dict per layer) -> Params; a tied head is the embedding."""
    unfused = dict.fromkeys([p for parts in FUSED_FIELDS.values() for p in parts] + ["w_down"])  # None where absent
    return Params(embed=top["embed"], layers=tuple(LayerParams(**{**unfused, **l}) for l in layers),
                  final_norm=top["final_norm"], lm_head=None if cfg.tie_embeddings else top["lm_head"])
