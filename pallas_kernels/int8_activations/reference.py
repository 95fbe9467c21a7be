"""Activations rounded to int8 per 32 values (ggml's Q8_1 scheme), in plain JAX: the format
the int8 decode GEMV multiplies, and the oracle of the kernels that produce it."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_I32, _F32 = jnp.int32, jnp.float32
ACTIVATIONS = ("silu", "gelu_tanh")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedX:
    """x (..., K) quantized per 32 values: x ~= d * q, q int8 in [-127, 127]. `dtype` is the
    activations' own (half-precision) dtype, which a product with them returns."""
    words: jax.Array   # (..., K // 4) int32: four int8 q per word, little-endian
    d: jax.Array       # (..., K // 32) float32
    dsum32: jax.Array  # (..., K // 32) float32: d * (sum of q over the 32 values)
    dsum16: jax.Array  # (..., K // 16) float32: d * (sum of q over each 16 values)
    dtype: jnp.dtype = dataclasses.field(default=jnp.dtype(jnp.bfloat16), metadata=dict(static=True))
    # An RMS norm still to apply: with `ss` (..., K // 32), the per-group sums of squares of the
    # un-normed row, the activations are d * q * rsqrt(sum(ss) / K + eps). A product's kernel
    # before the norm rounds the row times the norm weight without knowing the whole row's
    # sum of squares (`qmatmul_add_norm`); the product after it scales its sums once.
    ss: jax.Array | None = None
    eps: float = dataclasses.field(default=0.0, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape (..., K) of the activations."""
        return (*self.words.shape[:-1], 4 * self.words.shape[-1])

    def reshape(self, *lead: int) -> "QuantizedX":
        """The same values with leading dims `lead` (the last axis stays K)."""
        return jax.tree.map(lambda a: a.reshape(*lead, a.shape[-1]), self)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GatedX:
    """The activations act(gate) * up (..., K) of an FFN, handed to the down product as the
    [gate | up] (..., 2K) they come from, so the product's kernel applies the GLU as it loads
    them (no pass of its own). `materialize` is what every other consumer multiplies."""
    gate_up: jax.Array   # (..., 2K)
    activation: str = dataclasses.field(default="silu", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.gate_up.shape[:-1], self.gate_up.shape[-1] // 2)

    @property
    def dtype(self):
        return self.gate_up.dtype

    def reshape(self, *lead: int) -> "GatedX":
        return GatedX(self.gate_up.reshape(*lead, self.gate_up.shape[-1]), self.activation)

    def materialize(self) -> jax.Array:
        """act(gate) * up in float32, rounded to the activations' dtype."""
        return glu(self.gate_up, self.activation).astype(self.dtype)


def quantize_x(x: jax.Array) -> QuantizedX:
    """Round x (..., K), K a multiple of 32, to int8 per 32 values.

    The sums serve the weight formats with offsets or mins: sum(x * (q_w - 8)) is
    d_x * (dot(q_x, q_w) - 8 * sum(q_x)), so they are taken over the rounded q."""
    *lead, k = x.shape
    xf = x.astype(_F32).reshape(*lead, k // 32, 32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    d = amax / 127.0
    inv = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
    q = jnp.clip(jnp.round(xf * inv[..., None]), -127, 127).astype(jnp.int8)
    words = jax.lax.bitcast_convert_type(q.reshape(*lead, k // 4, 4), _I32)
    sum16 = q.astype(_I32).reshape(*lead, k // 32, 2, 16).sum(-1).astype(_F32)
    half = x.dtype if jnp.dtype(x.dtype).itemsize == 2 else jnp.dtype(jnp.bfloat16)
    return QuantizedX(words, d, d * sum16.sum(-1), (d[..., None] * sum16).reshape(*lead, k // 16), half)


def norm_scale(ss: jax.Array, k: int, eps: float) -> jax.Array:
    """rsqrt(mean of squares + eps) (...,) of rows whose per-group sums of squares are ss (..., G)."""
    return jax.lax.rsqrt(jnp.sum(ss, axis=-1) / k + eps)


def quantize_normed(h: jax.Array, w: jax.Array, eps: float, dtype=jnp.bfloat16) -> QuantizedX:
    """rms_norm(h) * w for un-normed rows h (..., K), as a QuantizedX with the norm pending: h * w
    rounded per 32 values (the norm's scale is one factor per row, so it changes no q), and
    the per-group sums of squares of h, from which a consumer gets the scale."""
    *lead, k = h.shape
    h = h.astype(_F32)
    xq = quantize_x(h * w.astype(_F32))
    ss = jnp.sum(jnp.square(h).reshape(*lead, k // 32, 32), axis=-1)
    return dataclasses.replace(xq, dtype=jnp.dtype(dtype), ss=ss, eps=float(eps))


def dequantize_x(xq: QuantizedX) -> jax.Array:
    """The float32 activations the int8 kernels multiply: d * q (times the pending norm's
    scale, if any), shape (..., K)."""
    *lead, nw = xq.words.shape
    q = jax.lax.bitcast_convert_type(xq.words, jnp.int8).reshape(*lead, nw // 8, 32).astype(_F32)
    x = (q * xq.d[..., None]).reshape(*lead, 4 * nw)
    return x if xq.ss is None else x * norm_scale(xq.ss, 4 * nw, xq.eps)[..., None]


def activate(gate: jax.Array, activation: str) -> jax.Array:
    """The gate's activation in float32, by the formulas the kernel evaluates."""
    g = gate.astype(_F32)
    if activation == "silu":
        return g / (1.0 + jnp.exp(-g))
    if activation == "gelu_tanh":
        return 0.5 * g * (1.0 + jnp.tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    raise ValueError(f"activation {activation!r}; expected one of {ACTIVATIONS}")


def glu(gate_up: jax.Array, activation: str) -> jax.Array:
    """act(gate) * up for gate_up (..., 2K) = [gate | up], in float32."""
    k = gate_up.shape[-1] // 2
    return activate(gate_up[..., :k], activation) * gate_up[..., k:].astype(_F32)


def quantize_reference(x: jax.Array, activation: str | None = None) -> QuantizedX:
    """`quantize_x` of x, or of glu(x, activation) when an activation is given."""
    if activation is None:
        return quantize_x(x)
    xq = quantize_x(glu(x, activation))
    return dataclasses.replace(xq, dtype=jnp.dtype(x.dtype) if jnp.dtype(x.dtype).itemsize == 2 else xq.dtype)
