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
from typing import NamedTuple

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


# The filters find where they cut by searching, not by sorting the vocabulary. A sort of [B, V]
# costs more than the rest of a large batch's decode step, and a sort of one row XLA hands to
# cub, a custom call no CUDA graph captures, which sends a decode loop back to the host. A
# search pass tries 16 thresholds at once over each row, so 8 passes settle a 32-bit key and
# 4-5 an index. (4 thresholds a pass took as long at batch 64 over 128k tokens: twice the
# passes, each half as long.)
_WAYS = 16


def _order_keys(x):
    """float32 [B, V] -> uint32 in the same order (-0.0 taken as 0.0)."""
    b = jax.lax.bitcast_convert_type(x + 0.0, jnp.uint32)
    return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(0x80000000))


def _search(holds, bits: int, batch: int, rolled: bool | None = None):
    """The largest t in [0, 2**bits) for which holds(t) (t: [B, _WAYS, 1] uint32 -> [B, _WAYS]
    bool, true up to some t and false above it) is true, per row; 0 where holds(0) is false.
    rolled: the passes as a loop (True) or unrolled (False); None: by the platform, below."""
    rounds = -(-bits // 4)
    ways = jnp.arange(_WAYS, dtype=jnp.uint32)[None]

    def one(r, lo):
        step = jnp.left_shift(jnp.uint32(1), (4 * (rounds - 1 - r)).astype(jnp.uint32))
        t = lo + ways * step
        n = jnp.sum(holds(t[:, :, None]), axis=-1, keepdims=True, dtype=jnp.uint32)
        return lo + jnp.maximum(n, 1).astype(jnp.uint32) * step - step

    def unrolled(lo):
        for r in range(rounds):
            lo = one(jnp.int32(r), lo)
        return lo

    # The same passes either way. A GPU runs them unrolled: a loop would bring the decode step's
    # control back to the host. On the CPU a loop compiles one pass instead of up to eight, which
    # is most of the compile time a sampled program spends on its filters.
    # Chosen while tracing, by the backend the engine runs on: a platform_dependent switch would
    # leave a conditional in every decode program's text.
    rolled = jax.default_backend() == "cpu" if rolled is None else rolled
    lo = jnp.zeros((batch, 1), jnp.uint32)
    return (jax.lax.fori_loop(0, rounds, one, lo) if rolled else unrolled(lo))[:, 0]


def _nth_index(mask, n):
    """The index of each row's n-th (1-based) True in mask [B, V] (n >= 1, at most its count)."""
    B, V = mask.shape
    idx = jnp.arange(V, dtype=jnp.uint32)[None, None]
    bits = max(4, (V - 1).bit_length())
    # Each pass reduces [B, _WAYS, V] along its last axis, a row reduction XLA fuses whole.
    return _search(lambda t: jnp.sum(mask[:, None] & (idx < t), axis=-1, dtype=jnp.uint32) < n[:, None], bits, B)


def _keep(logits, sp: SamplingParams):
    """[B, V] bool: the tokens the filters keep, found without a sort. In the order of the logits
    (the larger first, ties by index): top-k keeps the first k; of those, top-p keeps each token
    while the mass before it (the softmax of the logits / temperature over top-k's tokens) is
    below top_p, so at least the first."""
    B, V = logits.shape
    u = _order_keys(logits)
    idx = jnp.arange(V, dtype=jnp.uint32)[None]

    # top-k: the k-th largest key, and how many of the tokens at it fall within k (by index).
    k = jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, V), V).astype(jnp.uint32)
    t_k = _search(lambda t: jnp.sum(u[:, None] >= t, axis=-1, dtype=jnp.uint32) >= k[:, None], 32, B)
    m_k = k - jnp.sum(u > t_k[:, None], axis=1, dtype=jnp.uint32)
    at_k = u == t_k[:, None]
    keep_k = (u > t_k[:, None]) | (at_k & (idx <= _nth_index(at_k, m_k)[:, None]))
    # top-p over what top-k kept: v_p, the lowest key whose tokens start before the mass above
    # them reaches p; at that key the ties (by index) keep while the mass before them is < p.
    z = logits / jnp.maximum(sp.temperature, 1e-6)[:, None]
    z = jnp.where(keep_k, z, -jnp.inf)
    q = jax.nn.softmax(z, axis=-1)
    p = sp.top_p[:, None]
    above = lambda t: jnp.sum(jnp.where(u[:, None] > t, q[:, None], 0.0), axis=-1)  # noqa: E731
    a = _search(lambda t: above(t) >= p, 32, B)
    a_holds = jnp.sum(jnp.where(u > a[:, None], q, 0.0), axis=1) >= sp.top_p
    v_p = jnp.where((sp.top_p < 1) & a_holds, a + 1, 0)
    # The last key kept, and how many of its tokens (by index).
    last = jnp.maximum(t_k, v_p)
    at = keep_k & (u == last[:, None])
    n_at = jnp.sum(at, axis=1, dtype=jnp.uint32)
    mass_above = jnp.sum(jnp.where(u > last[:, None], q, 0.0), axis=1)
    q_at = jnp.max(jnp.where(at, q, 0.0), axis=1)
    n_p = jnp.ceil((sp.top_p - mass_above) / jnp.maximum(q_at, jnp.finfo(jnp.float32).tiny))
    n_p = jnp.clip(jnp.nan_to_num(n_p, nan=1.0, posinf=float(V)), 1, V).astype(jnp.uint32)
    n = jnp.where(v_p == last, jnp.minimum(n_at, n_p), n_at)
    keep = (u > last[:, None]) | (at & (idx <= _nth_index(at, jnp.maximum(n, 1))[:, None]))
    return keep | ~filtered(sp)[:, None]


@jax.jit  # its own function in a program's text, where tests look for it
def filtered_logits(logits, sp: SamplingParams):
    """logits [B, V] -> what sampling draws from, in vocabulary order: divided by the temperature,
    -inf outside top-k and top-p (softmax of it is the sampling distribution)."""
    z = logits / jnp.maximum(sp.temperature, 1e-6)[:, None]
    return jnp.where(_keep(logits, sp), z, -jnp.inf)


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
    """[B] bool: the rows whose top-k or top-p filter leaves tokens out."""
    return (sp.top_k > 0) | (sp.top_p < 1)


def sample(logits: jax.Array, key: jax.Array, sp: SamplingParams, filters: bool = True) -> jax.Array:
    """logits [B, V] float32 -> token ids [B] int32.

    Each row draws from softmax(logits / temperature) over what its top-k and top-p keep (all of
    the vocabulary where they are off). filters=False (static): the caller knows no row is
    filtered, so the program leaves out the filters' search (most of a sampled step's cost over
    a large vocabulary); a row's token is the same either way. No conditional skips the work for
    greedy rows: XLA evaluates a conditional on the host, which inside a decode loop keeps every
    step there; greedy batches have programs of their own."""
    check_sample_args(logits, sp)
    greedy = jnp.argmax(logits, axis=-1)
    z = filtered_logits(logits, sp) if filters else logits / jnp.maximum(sp.temperature, 1e-6)[:, None]
    drawn = jax.random.categorical(key, z, axis=-1)
    return jnp.where(sp.temperature > 0, drawn, greedy).astype(jnp.int32)


# Logit adjustments: OpenAI's presence and frequency penalties and logit_bias, vLLM's (and
# llama.cpp's) repetition penalty and min-p. Per-sequence arrays like SamplingParams, kept apart
# from them so that programs which never adjust (rjax.generate, greedy serving) carry none.

MAX_LOGIT_BIAS = 300   # entries of one logit_bias (OpenAI's limit)
# A sequence's token history as one int32 per vocabulary entry: the count of times it was
# generated in the low bits, and PROMPT_BIT where it occurs in the prompt (the repetition
# penalty counts the prompt, the presence and frequency penalties only generated tokens).
PROMPT_BIT = 1 << 30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LogitAdjust:
    presence: jax.Array     # [B] float32: subtracted once from every generated token's logit (0: off)
    frequency: jax.Array    # [B] float32: subtracted per time a token was generated (0: off)
    repetition: jax.Array   # [B] float32: a seen token's logit divided by it if > 0, else times it (1: off)
    min_p: jax.Array        # [B] float32: drop tokens below min_p x the most likely's probability (0: off)
    bias_ids: jax.Array     # [B, MAX_LOGIT_BIAS] int32, -1 padded
    bias: jax.Array         # [B, MAX_LOGIT_BIAS] float32, added to those tokens' logits

    @staticmethod
    def host(rows: list[dict]) -> tuple[np.ndarray, ...]:
        """NumPy arrays of a LogitAdjust from one dict per row (keys presence, frequency, repetition,
        min_p, logit_bias: {token id: bias}; missing: off), for the caller to put on the device."""
        B = len(rows)
        ids = np.full((B, MAX_LOGIT_BIAS), -1, np.int32)
        bias = np.zeros((B, MAX_LOGIT_BIAS), np.float32)
        for i, r in enumerate(rows):
            items = sorted((r.get("logit_bias") or {}).items())
            ids[i, : len(items)] = [t for t, _ in items]
            bias[i, : len(items)] = [b for _, b in items]
        return (np.asarray([r.get("presence", 0.0) for r in rows], np.float32),
                np.asarray([r.get("frequency", 0.0) for r in rows], np.float32),
                np.asarray([r.get("repetition", 1.0) for r in rows], np.float32),
                np.asarray([r.get("min_p", 0.0) for r in rows], np.float32), ids, bias)

    @staticmethod
    def make(batch: int, **row) -> "LogitAdjust":
        """One setting for all `batch` rows (keys as `host`)."""
        return LogitAdjust(*map(jnp.asarray, LogitAdjust.host([row] * batch)))


def check_adjust(vocab_size: int, presence=0.0, frequency=0.0, repetition=1.0, min_p=0.0, logit_bias=None) -> None:
    """Refuse logit adjustments out of range: penalties in [-2, 2] (OpenAI's), repetition finite
    and > 0, min_p in [0, 1], logit_bias at most MAX_LOGIT_BIAS token ids of the vocabulary with
    biases in [-100, 100]."""
    for name, v in (("presence_penalty", presence), ("frequency_penalty", frequency),
                    ("repetition_penalty", repetition), ("min_p", min_p)):
        _number(name, v, numbers.Real)
        if not np.isfinite(v):
            raise ValueError(f"{name} must be finite, got {v!r}")
    for name, v in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -2 <= v <= 2:
            raise ValueError(f"{name} must be in [-2, 2] (0: off), got {v!r}")
    if repetition <= 0:
        raise ValueError(f"repetition_penalty must be > 0 (1: off), got {repetition!r}")
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1] (0: off), got {min_p!r}")
    if logit_bias is None:
        return
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must map token ids to biases, got {type(logit_bias).__name__}")
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
    for t, b in logit_bias.items():
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size:
            raise ValueError(f"logit_bias: token id {t!r} is not in the vocabulary [0, {vocab_size})")
        _number(f"logit_bias[{t}]", b, numbers.Real)
        if not -100 <= b <= 100:
            raise ValueError(f"logit_bias[{t}] must be in [-100, 100], got {b!r}")


def adjusts(presence=0.0, frequency=0.0, repetition=1.0, min_p=0.0, logit_bias=None) -> bool:
    """Whether these settings change any logit (all at their neutral values: no)."""
    return bool(presence or frequency or repetition != 1.0 or min_p or logit_bias)


def penalizes(presence=0.0, frequency=0.0, repetition=1.0, **_) -> bool:
    """Whether these settings read the token history."""
    return bool(presence or frequency or repetition != 1.0)


@jax.jit  # its own function in a program's text, where tests look for it
def adjust_logits(logits, adj: LogitAdjust, history, temperature):
    """logits [B, V] -> float32 logits with each row's bias, penalties and min-p applied, in
    vLLM's order: logit_bias; the repetition penalty (over prompt and generated tokens), then
    frequency and presence (generated tokens: history [B, V], see PROMPT_BIT); min-p on the
    distribution at `temperature` [B] (none at 0, where the argmax is kept anyway). A row at
    neutral settings keeps its logits exactly."""
    B, V = logits.shape
    x = logits.astype(jnp.float32)
    ids = jnp.where(adj.bias_ids < 0, V, adj.bias_ids)    # padding scatters out of range: dropped
    x = x.at[jnp.arange(B)[:, None], ids].add(adj.bias, mode="drop")
    count = (history & (PROMPT_BIT - 1)).astype(jnp.float32)
    seen = (history != 0)
    r = adj.repetition[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
    x = x - adj.frequency[:, None] * count - adj.presence[:, None] * (count > 0)
    # min-p: p_i < min_p * p_max  <=>  (x_i - x_max) / T < log(min_p)
    floor = jnp.where((adj.min_p > 0) & (temperature > 0), temperature * jnp.log(adj.min_p), -jnp.inf)
    low = x - jnp.max(x, axis=-1, keepdims=True) < floor[:, None]
    return jnp.where(low, -jnp.inf, x)


def mask_logits(logits, mask):
    """logits [B, V] with -inf where the token bitmask mask [B, ceil(V / 32)] int32 has a 0 bit
    (bit i % 32 of word i // 32 is token i; all ones: every token allowed)."""
    idx = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    bits = (mask[:, idx // 32] >> (idx % 32)[None]) & 1
    return jnp.where(bits != 0, logits, -jnp.inf)


# Top log-probabilities a request may ask for per token (OpenAI's top_logprobs limit).
MAX_TOP_LOGPROBS = 20


class TopLogprobs(NamedTuple):
    """Log-probabilities under the model's raw distribution (log_softmax of the logits)."""

    chosen: jax.Array     # [...] the sampled token's
    top_ids: jax.Array    # [..., MAX_TOP_LOGPROBS] int32, most likely first
    top: jax.Array        # [..., MAX_TOP_LOGPROBS]


def top_logprobs(logits, tokens) -> TopLogprobs:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    top, ids = jax.lax.top_k(logp, min(MAX_TOP_LOGPROBS, logp.shape[-1]))
    return TopLogprobs(chosen, ids.astype(jnp.int32), top)
