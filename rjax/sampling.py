"""On-device sampling with per-sequence parameters.

The parameters are arrays with one entry per sequence, never static arguments, so requests
with different temperatures or nucleus sizes share one compiled program. Temperature 0 is
greedy; top_k 0 and top_p 1 switch those filters off.

Their ranges are checked on the host (`SamplingParams.make`, `check_sampling`): inside the
program a NaN or negative temperature would quietly mean greedy and a top_p of 0 an
arbitrary token, so out-of-range values are refused before anything runs.
"""
from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np

_INT32_MAX = 2**31 - 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: jax.Array  # [B] float32
    top_k: jax.Array        # [B] int32
    top_p: jax.Array        # [B] float32

    @staticmethod
    def make(batch: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> "SamplingParams":
        """One setting for all `batch` sequences; raises ValueError for a value out of range."""
        if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < 1:
            raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
        check_sampling(temperature, top_k, top_p)
        return SamplingParams(jnp.full((batch,), temperature, jnp.float32),
                              jnp.full((batch,), top_k, jnp.int32),
                              jnp.full((batch,), top_p, jnp.float32))


def _number(name: str, value, kind) -> None:
    if isinstance(value, bool) or not isinstance(value, kind):
        what = "an integer" if kind is numbers.Integral else "a number"
        raise ValueError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")


def check_sampling(temperature, top_k, top_p) -> None:
    """Refuse sampling settings out of range: temperature finite and >= 0, top_k an integer in
    [0, 2**31 - 1], top_p in (0, 1]. Scalars or per-sequence arrays (the first bad entry is named)."""
    if all(np.ndim(v) == 0 for v in (temperature, top_k, top_p)) and not any(
            isinstance(v, (np.ndarray, jax.Array)) for v in (temperature, top_k, top_p)):
        _number("temperature", temperature, numbers.Real)
        _number("top_k", top_k, numbers.Integral)
        _number("top_p", top_p, numbers.Real)
    t = np.asarray(temperature, np.float64)
    k = np.asarray(top_k)
    p = np.asarray(top_p, np.float64)
    if k.dtype.kind not in "iu":
        if k.dtype.kind != "f" or not np.all(np.isfinite(k) & (k == np.round(k))):
            raise ValueError(f"top_k must hold integers, got {top_k!r}")
        k = k.astype(np.int64)

    def first_bad(name, values, ok, allowed):
        bad = ~ok
        if bad.any():
            i = int(np.flatnonzero(bad.ravel())[0])
            where = f"[{i}]" if values.ndim else ""
            raise ValueError(f"{name}{where} must be {allowed}, got {values.ravel()[i].item()!r}")

    first_bad("temperature", t, np.isfinite(t) & (t >= 0), ">= 0 and finite (0: greedy)")
    first_bad("top_k", k, (k >= 0) & (k <= _INT32_MAX), f">= 0 and at most {_INT32_MAX} (0: off)")
    first_bad("top_p", p, (p > 0) & (p <= 1), "in (0, 1] (1: off)")


def _sorted_filtered(logits, sp: SamplingParams):
    """(order, logits sorted by `order`, divided by the temperature, -inf outside top-k / top-p)."""
    B, V = logits.shape
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1) / jnp.maximum(sp.temperature, 1e-6)[:, None]
    rank = jnp.arange(V)[None, :]
    drop = (sp.top_k[:, None] > 0) & (rank >= sp.top_k[:, None])
    sorted_logits = jnp.where(drop, -jnp.inf, sorted_logits)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    return order, jnp.where(mass_before >= sp.top_p[:, None], -jnp.inf, sorted_logits)


def filtered_logits(logits, sp: SamplingParams):
    """logits [B, V] -> what sampling draws from, in vocabulary order: divided by the temperature,
    -inf outside top-k and top-p (softmax of it is the sampling distribution)."""
    order, sorted_logits = _sorted_filtered(logits, sp)
    return jnp.take_along_axis(sorted_logits, jnp.argsort(order, axis=-1), axis=-1)


def _filtered_sample(logits, key, sp: SamplingParams):
    """Temperature, then top-k and top-p over the sorted distribution, then a categorical draw."""
    order, sorted_logits = _sorted_filtered(logits, sp)
    choice = jax.random.categorical(key, sorted_logits, axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]


def _is_concrete(*xs) -> bool:
    """True when every array can be read on the host: none is a tracer of a caller's jit."""
    return not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(xs))


def check_sample_args(logits, sp: SamplingParams) -> None:
    """Shapes always; values when the arrays are concrete (a call outside jit)."""
    if np.ndim(logits) != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {np.shape(logits)}")
    B = np.shape(logits)[0]
    for name in ("temperature", "top_k", "top_p"):
        shape = np.shape(getattr(sp, name))
        if shape != (B,):
            raise ValueError(f"SamplingParams.{name} has shape {shape}; the logits have {B} rows, so ({B},)")
    if _is_concrete(sp):
        check_sampling(np.asarray(sp.temperature), np.asarray(sp.top_k), np.asarray(sp.top_p))


def filtered(sp: SamplingParams):
    """[B] bool: the rows whose top-k or top-p filter leaves tokens out (they need the sort)."""
    return (sp.top_k > 0) | (sp.top_p < 1)


def sample(logits: jax.Array, key: jax.Array, sp: SamplingParams, filters: bool = True) -> jax.Array:
    """logits [B, V] float32 -> token ids [B] int32.

    A row without top-k / top-p draws from softmax(logits / temperature) as it is, with no sort;
    a filtered row from its sorted, filtered distribution. filters=False (static): the caller
    knows no row is filtered, so the program holds no sort (over a large vocabulary and batch the
    most expensive part of a step). A row's token is the same either way. No conditional skips
    the work for greedy rows: XLA evaluates a conditional on the host, which inside a decode loop
    keeps every step there; greedy batches have programs of their own."""
    check_sample_args(logits, sp)
    greedy = jnp.argmax(logits, axis=-1)
    drawn = jax.random.categorical(key, logits / jnp.maximum(sp.temperature, 1e-6)[:, None], axis=-1)
    if filters:
        drawn = jnp.where(filtered(sp), _filtered_sample(logits, key, sp), drawn)
    return jnp.where(sp.temperature > 0, drawn, greedy).astype(jnp.int32)
