"""On-device sampling with per-sequence parameters.

The parameters are arrays with one entry per sequence, never static arguments, so requests
with different temperatures or nucleus sizes share one compiled program. Temperature 0 is
greedy; top_k 0 and top_p 1 switch those filters off.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: jax.Array  # [B] float32
    top_k: jax.Array        # [B] int32
    top_p: jax.Array        # [B] float32

    @staticmethod
    def make(batch: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> "SamplingParams":
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        return SamplingParams(jnp.full((batch,), temperature, jnp.float32),
                              jnp.full((batch,), top_k, jnp.int32),
                              jnp.full((batch,), top_p, jnp.float32))


def _filtered_sample(logits, key, sp: SamplingParams):
    """Temperature, then top-k and top-p over the sorted distribution, then a categorical draw."""
    B, V = logits.shape
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1) / jnp.maximum(sp.temperature, 1e-6)[:, None]
    rank = jnp.arange(V)[None, :]
    drop = (sp.top_k[:, None] > 0) & (rank >= sp.top_k[:, None])
    sorted_logits = jnp.where(drop, -jnp.inf, sorted_logits)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    sorted_logits = jnp.where(mass_before >= sp.top_p[:, None], -jnp.inf, sorted_logits)
    choice = jax.random.categorical(key, sorted_logits, axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]


def sample(logits: jax.Array, key: jax.Array, sp: SamplingParams) -> jax.Array:
    """logits [B, V] float32 -> token ids [B] int32."""
    greedy = jnp.argmax(logits, axis=-1)
    sampled = jax.lax.cond(jnp.any(sp.temperature > 0), lambda: _filtered_sample(logits, key, sp), lambda: greedy)
    return jnp.where(sp.temperature > 0, sampled, greedy).astype(jnp.int32)
