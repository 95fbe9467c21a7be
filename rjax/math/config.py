"""ModelConfig: everything about a model's shape and architecture that is fixed at compile time.

It is frozen and hashable, so it is passed to jitted functions as a static argument: a new
config is a new compilation, never a silently reused one. Every architecture switch the forward
pass needs lives here as a plain field; loaders translate file metadata into it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Literal

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3-style frequency scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_context_length: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_theta: float
    # "pairs": rotate adjacent (2i, 2i+1) pairs, as llama GGUF files need (their Q/K rows are
    # permuted for it); "halves": rotate (i, i + d/2), as Hugging Face and NEOX-style models do.
    rope_pairing: Literal["pairs", "halves"] = "halves"
    rope_scaling: RopeScaling | None = None
    # Per-layer attention window (None = full attention) and rope base, derived in __post_init__
    # callers may pass them explicitly for mixed local/global models.
    layer_windows: tuple[int | None, ...] = ()
    layer_rope_theta: tuple[float, ...] = ()
    # Per-layer linear rope scaling (positions divided by the factor; Gemma 3 4B+ uses it on its
    # global layers only), 1.0 = none; derived in __post_init__ when not given.
    layer_rope_linear: tuple[float, ...] = ()
    # Per-frequency divisors of the rope frequencies (head_dim // 2 of them): how llama.cpp stores
    # Llama-3 scaling (the `rope_freqs` tensor) and Phi-3's LongRoPE (its short factors). None = none.
    rope_freq_factors: tuple[float, ...] | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    activation: Literal["silu", "gelu_tanh"] = "silu"
    embed_scale: float = 1.0
    tie_embeddings: bool = True
    attn_scale: float = 0.0  # 0 -> 1/sqrt(head_dim)
    # Mixture of experts (Mixtral, Qwen3-MoE): every layer's MLP is n_experts MLPs of expert_d_ff,
    # of which a router picks n_experts_used per token (softmax over all, top k, and with
    # expert_norm the k weights renormalized to sum to 1). 0 experts: a dense MLP of d_ff.
    n_experts: int = 0
    n_experts_used: int = 0
    expert_d_ff: int = 0
    expert_norm: bool = True

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (None,) * self.n_layers)
        if not self.layer_rope_theta:
            object.__setattr__(self, "layer_rope_theta", (self.rope_theta,) * self.n_layers)
        if not self.layer_rope_linear:
            object.__setattr__(self, "layer_rope_linear", (1.0,) * self.n_layers)
        if (len(self.layer_windows) != self.n_layers or len(self.layer_rope_theta) != self.n_layers
                or len(self.layer_rope_linear) != self.n_layers):
            raise ValueError("layer_windows, layer_rope_theta and layer_rope_linear need one entry per layer")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"rope_freq_factors has {len(self.rope_freq_factors)} entries; "
                             f"head_dim {self.head_dim} needs {self.head_dim // 2}")
        if self.n_experts and not (1 <= self.n_experts_used <= self.n_experts and self.expert_d_ff >= 1):
            raise ValueError(f"{self.n_experts} experts need 1 to {self.n_experts} used per token (got "
                             f"{self.n_experts_used}) and an expert feed-forward size (got {self.expert_d_ff})")
        if not self.n_experts and self.n_experts_used:
            raise ValueError(f"{self.n_experts_used} experts used per token, but the model has no experts")
        if not self.attn_scale:
            object.__setattr__(self, "attn_scale", 1.0 / math.sqrt(self.head_dim))

    @property
    def q_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads


def longrope_context(context: int, original: int, short, long) -> int:
    """The context a LongRoPE model (Phi-3) runs with its short factors: all of it where the long
    factors are the same, else up to its original context. Past that, transformers switches
    every position to the long factors at once and llama.cpp picks them by the context size;
    rjax keeps one set of frequencies, so it stops at the original context instead of
    silently mixing the two."""
    return context if long is None or tuple(long) == tuple(short) else min(context, original)
