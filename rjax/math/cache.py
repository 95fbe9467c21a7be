"""The KV cache: an immutable pytree with one row ("slot") per sequence and a length per slot.

Layout: k and v are tuples with one array per layer, each [n_slots, n_kv_heads, max_len,
head_dim], so that each (slot, head) is one contiguous run of positions, which is what the
attention kernels stream, and a layer's cache reaches its kernel as a whole buffer (a slice of
one stacked array would be copied for the kernel at every layer of every step). `lengths[s]`
counts the valid positions of slot s. Writes go through `write`, which scatters new entries
at their absolute positions and drops padding (position -1), so no write can land in another
slot or past the end. Jitted callers donate the cache and XLA updates it in place.

KV dtypes (`KV_DTYPES`, chosen at `init_cache`; static, as the arrays' dtypes are): "bf16" keeps
K and V unquantized in the compute dtype (bfloat16 on a GPU, float32 on the CPU); "int8" stores
int8 values with one float32 scale per (token, head), computed when the token is written;
"fp8" stores e4m3 values with one float32 scale per (layer, KV head) (1.0 unless given: the
values are written as x / scale, saturated at +-448). The scales are pytree fields beside the
values (`k_scale`, `v_scale`), and `attend` hands both to the attention kernels, which
dequantize in registers (pallas_kernels/kv_quant.py).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.attention import attention, kind_of, rope_attention
from pallas_kernels.kv_append import rope_append, write_entries
from rjax.math.config import ModelConfig

KV_DTYPES = ("bf16", "int8", "fp8")
_STORAGE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def check_kv_dtype(kv_dtype: str | None) -> str:
    """The KV dtype name (None: "bf16"), or ValueError naming the choices."""
    kv_dtype = "bf16" if kv_dtype is None else kv_dtype
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    return kv_dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple[jax.Array, ...]  # per layer [n_slots, n_kv_heads, max_len, head_dim]
    v: tuple[jax.Array, ...]
    lengths: jax.Array  # [n_slots] int32
    # [n_slots, n_kv_heads] int32, zero between calls: the decode attention kernel's count of
    # the split programs that have finished (it merges their partials in the last one).
    # Carried here so that a step need not make fresh zeros for every layer. None: it does.
    arrivals: jax.Array | None = None
    # Quantized K/V (int8, fp8) only: per layer, int8 [n_slots, n_kv_heads, max_len] float32 (one
    # per entry), fp8 [n_kv_heads] float32 (one per head); None for a float cache.
    k_scale: tuple[jax.Array, ...] | None = None
    v_scale: tuple[jax.Array, ...] | None = None
    # The dtype attention computes in, for a quantized cache (a float cache computes in its own).
    compute_dtype: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    # Whether positions live in pages (a block table per slot) rather than contiguous rows.
    paged = False

    @property
    def n_slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def dtype(self):
        """The compute dtype (of the activations attention takes and returns)."""
        return jnp.dtype(self.compute_dtype) if self.compute_dtype else self.k[0].dtype

    @property
    def storage_dtype(self):
        """The dtype K and V are stored in."""
        return self.k[0].dtype

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def kv_dtype(self) -> str:
        """"int8", "fp8", or "bf16" for an unquantized cache (in the compute dtype)."""
        return kind_of(self.storage_dtype) or "bf16"

    def write(self, layer: int, k_new, v_new, pos, slots):
        """k_new, v_new [B, T, Hkv, D] at positions pos [B, T] (-1: skip) of cache rows `slots`;
        quantized here for an int8 or fp8 cache."""
        rows = jnp.arange(pos.shape[0]) if slots is None else slots
        k, ks = write_entries(self.k[layer], self._scale(self.k_scale, layer), k_new, pos, rows)
        v, vs = write_entries(self.v[layer], self._scale(self.v_scale, layer), v_new, pos, rows)
        return self._with(layer, k, v, ks, vs)

    def _scale(self, scales, layer: int):
        return None if scales is None else scales[layer]

    def _with(self, layer: int, k, v, k_scale=None, v_scale=None, **changes):
        """This cache with layer `layer`'s K, V (and int8 scales, else unchanged) replaced."""
        if self.kv_dtype == "int8":
            changes.update(k_scale=_replace(self.k_scale, layer, k_scale),
                           v_scale=_replace(self.v_scale, layer, v_scale))
        return dataclasses.replace(self, k=_replace(self.k, layer, k), v=_replace(self.v, layer, v), **changes)

    def rope_write(self, layer: int, parts, bias, pos, slots, inv_freq, *, n_heads: int, pairing: str, dtype,
                   qk_norm=None, eps: float = 0.0, implementation: str | None = None):
        """The fused QKV product as partial sums parts [S, B, T, (Hq + 2 Hkv) D] (plus bias or
        None), summed and rounded to `dtype`: queries and keys (RMS-normed per head by qk_norm's
        weights where given) rotated for positions pos [B, T],
        keys and values written as `write` does (quantized for an int8 or fp8 cache); one kernel
        (pallas_kernels.kv_append), or its reference, as `implementation` says (the plan's).
        -> (q [B, T, Hq, D], cache)."""
        rows = jnp.arange(pos.shape[0]) if slots is None else slots
        q, k, v, ks, vs = rope_append(parts, bias, pos, self.k[layer], self.v[layer], inv_freq, rows, n_heads=n_heads,
                                      pairing=pairing, dtype=dtype, k_scale=self._scale(self.k_scale, layer),
                                      v_scale=self._scale(self.v_scale, layer), qk_norm=qk_norm, eps=eps,
                                      implementation=implementation)
        return q, self._with(layer, k, v, ks, vs)

    def rope_write_attend(self, layer: int, parts, bias, pos, inv_freq, *, n_heads: int, pairing: str, dtype,
                          scale: float, window: int | None, quantize_out: bool = False, qk_norm=None,
                          eps: float = 0.0, slots=None, implementation: str | None = None):
        """`rope_write`, then `attend`, for one token per sequence in rows 0..B-1 (parts
        [S, B, 1, (Hq + 2 Hkv) D], pos [B, 1]), as one kernel on the GPU
        (pallas_kernels.attention.rope_attention). -> (attention output [B, 1, Hq, D], or
        with quantize_out possibly a QuantizedX [B, 1] of it, cache). slots: None (the kernel
        writes rows 0..B-1 only). implementation: what runs it (the plan's)."""
        if slots is not None:
            raise ValueError("KVCache.rope_write_attend: the fused kernel takes rows 0..B-1 (slots=None)")
        out, k, v, arrivals, ks, vs = rope_attention(
            parts[:, :, 0], bias, pos[:, 0], self.k[layer], self.v[layer], inv_freq, n_heads=n_heads, pairing=pairing,
            dtype=dtype, scale=scale, window=window, arrivals=self.arrivals, quantize_out=quantize_out,
            qk_norm=qk_norm, eps=eps, k_scale=self._scale(self.k_scale, layer), v_scale=self._scale(self.v_scale, layer),
            implementation=implementation)
        return out, self._with(layer, k, v, ks, vs, arrivals=arrivals)

    def attend(self, layer: int, q, pos, slots, *, scale: float, window: int | None, kernel=None,
               implementation: str | None = None):
        """Attention of q [B, T, Hq, D] at positions pos [B, T] over cache rows `slots`, on the
        plan's `kernel` (a pallas_kernels.attention.AttentionKernel) run as `implementation` says."""
        k, v = self.k[layer], self.v[layer]
        ks = vs = None
        if self.quantized:
            ks, vs = self.k_scale[layer], self.v_scale[layer]
        if slots is not None:
            k, v = k[slots], v[slots]
            if ks is not None and ks.ndim > 1:
                ks, vs = ks[slots], vs[slots]
        # Visible length: everything up to the newest query position of each sequence.
        kv_len = jnp.max(pos, axis=1) + 1
        return attention(q, k, v, pos, kv_len, scale=scale, window=window, k_scale=ks, v_scale=vs, kernel=kernel,
                         implementation=implementation)

    def layer_view(self, layer: int):
        """(this cache as layer `layer` alone, None): what a layer call attends over (index 0 of
        the view), its K/V the layer's own buffers."""
        one = lambda arrays: None if arrays is None else (arrays[layer],)  # noqa: E731
        return dataclasses.replace(self, k=one(self.k), v=one(self.v), k_scale=one(self.k_scale),
                                   v_scale=one(self.v_scale)), None

    def advance(self, slots, n_new):
        """lengths[slots] += n_new (n_new [B] int32)."""
        if slots is None:
            return dataclasses.replace(self, lengths=self.lengths + n_new)
        return dataclasses.replace(self, lengths=self.lengths.at[slots].add(n_new))

    def row(self, slot):
        """Slot `slot`'s K and V as stored, each [L, Hkv, max_len, D]."""
        return jnp.stack([k[slot] for k in self.k]), jnp.stack([v[slot] for v in self.v])

    def row_scales(self, slot):
        """Slot `slot`'s int8 scales, each [L, Hkv, max_len]; None, None for float and fp8 caches
        (fp8 scales belong to the cache's heads, not to a slot)."""
        if not self.quantized or self.k_scale[0].ndim == 1:
            return None, None
        return jnp.stack([s[slot] for s in self.k_scale]), jnp.stack([s[slot] for s in self.v_scale])

    def set_row(self, slot, k, v, length, k_scale=None, v_scale=None):
        """Slot `slot` holds k, v [L, Hkv, max_len, D] as stored (with their int8 scales [L, Hkv,
        max_len]) and `length` positions."""
        out = dataclasses.replace(self, k=tuple(c.at[slot].set(x) for c, x in zip(self.k, k)),
                                  v=tuple(c.at[slot].set(x) for c, x in zip(self.v, v)),
                                  lengths=self.lengths.at[slot].set(length))
        if k_scale is not None:
            out = dataclasses.replace(out, k_scale=tuple(c.at[slot].set(x) for c, x in zip(self.k_scale, k_scale)),
                                      v_scale=tuple(c.at[slot].set(x) for c, x in zip(self.v_scale, v_scale)))
        return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixSnapshot:
    """One sequence's KV: k, v [L, Hkv, max_len, D] as the cache stores them (positions past
    `length` are whatever the slot held there), `length` (int32 scalar) valid positions, and for
    an int8 cache the scales [L, Hkv, max_len]. A pytree of fixed shapes, so `snapshot` and
    `restore` jit once per cache shape whatever the length."""
    k: jax.Array
    v: jax.Array
    length: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None


@jax.jit
def snapshot(cache, slot) -> PrefixSnapshot:
    """The KV of slot `slot` (a traced int is fine) of a contiguous or paged cache."""
    k, v = cache.row(slot)
    return PrefixSnapshot(k, v, cache.lengths[slot], *cache.row_scales(slot))


@jax.jit
def restore(cache, slot, snap: PrefixSnapshot):
    """`cache` with slot `slot` holding `snap` (the cache's own shape; a float snapshot is cast to
    a float cache's dtype, a quantized one must come from a cache of the same KV dtype and, for
    fp8, head scales). A paged slot must own the pages for snap.length positions: restore fills
    them and writes nothing else."""
    if not cache.quantized:
        return cache.set_row(slot, snap.k.astype(cache.dtype), snap.v.astype(cache.dtype), snap.length)
    if snap.k.dtype != cache.storage_dtype or (snap.k_scale is None) != (cache.kv_dtype != "int8"):
        raise ValueError(f"restore: a snapshot of {snap.k.dtype} values into a {cache.kv_dtype} cache")
    return cache.set_row(slot, snap.k, snap.v, snap.length, snap.k_scale, snap.v_scale)


@functools.partial(jax.jit, static_argnums=1)
def grow(cache: KVCache, max_len: int) -> KVCache:
    """A contiguous `cache` with room for `max_len` positions, holding what it held (a
    conversation that outgrows its cache keeps its keys and values instead of prefilling again).
    Not donated: a request refused after growing leaves the caller's cache as it was."""
    def pad(x):  # per-position arrays ([n_slots, Hkv, max_len, ...]); fp8's per-head scales stay
        return jnp.pad(x, [(0, 0), (0, 0), (0, max_len - x.shape[2])] + [(0, 0)] * (x.ndim - 3))
    scales = (None, None) if cache.k_scale is None or cache.k_scale[0].ndim < 3 else \
        (tuple(map(pad, cache.k_scale)), tuple(map(pad, cache.v_scale)))
    return dataclasses.replace(cache, k=tuple(map(pad, cache.k)), v=tuple(map(pad, cache.v)),
                               **({} if scales[0] is None else dict(k_scale=scales[0], v_scale=scales[1])))


def _replace(arrays: tuple, i: int, new) -> tuple:
    return arrays[:i] + (new,) + arrays[i + 1:]


def fp8_head_scales(cfg: ModelConfig, fp8_scales=None) -> tuple[jax.Array, jax.Array]:
    """The fp8 scales of K and V, each [L, Hkv] float32: `fp8_scales` (k, v), else ones."""
    shape = (cfg.n_layers, cfg.n_kv_heads)
    if fp8_scales is None:
        return jnp.ones(shape, jnp.float32), jnp.ones(shape, jnp.float32)
    k, v = (jnp.broadcast_to(jnp.asarray(s, jnp.float32), shape) for s in fp8_scales)
    return k, v


def init_cache(cfg: ModelConfig, n_slots: int, max_len: int, dtype=jnp.float32, kv_dtype: str | None = None,
               fp8_scales=None) -> KVCache:
    """An empty cache of n_slots x max_len positions; attention computes in `dtype`, and K/V are
    stored as `kv_dtype` (see the module docstring; None or "bf16": in `dtype`). fp8_scales:
    (k, v) scales per layer and KV head, broadcast to [L, Hkv] (fp8 only; default 1.0)."""
    if max_len > cfg.context_length:
        raise ValueError(f"cache length {max_len} exceeds the model's context length {cfg.context_length}")
    kv_dtype = check_kv_dtype(kv_dtype)
    scales = fp8_head_scales(cfg, fp8_scales) if kv_dtype == "fp8" else None
    return _empty_cache(cfg, n_slots, max_len, jnp.dtype(dtype).name, kv_dtype, scales)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _empty_cache(cfg: ModelConfig, n_slots: int, max_len: int, dtype: str, kv_dtype: str, fp8_scales) -> KVCache:
    # One program makes every layer's arrays: one dispatch instead of one per array (a
    # 32-layer cache is over 64 arrays, each a dispatch of its own when made eagerly).
    shape = (n_slots, cfg.n_kv_heads, max_len, cfg.head_dim)
    store = _STORAGE.get(kv_dtype, dtype)
    zeros = lambda sh, dt: tuple(jnp.zeros(sh, dt) for _ in range(cfg.n_layers))  # noqa: E731
    common = (zeros(shape, store), zeros(shape, store), jnp.zeros((n_slots,), jnp.int32),
              jnp.zeros(shape[:2], jnp.int32))
    if kv_dtype == "bf16":
        return KVCache(*common)
    if kv_dtype == "int8":
        ks, vs = zeros(shape[:3], jnp.float32), zeros(shape[:3], jnp.float32)
    else:
        ks, vs = tuple(fp8_scales[0]), tuple(fp8_scales[1])
    return KVCache(*common, k_scale=ks, v_scale=vs, compute_dtype=dtype)
