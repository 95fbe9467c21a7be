"""The KV cache: an immutable pytree with one row ("slot") per sequence and a length per slot.

Layout: k and v are tuples with one array per layer, each [n_slots, n_kv_heads, max_len,
head_dim], so that each (slot, head) is one contiguous run of positions, which is what the
attention kernels stream, and a layer's cache reaches its kernel as a whole buffer (a slice of
one stacked array would be copied for the kernel at every layer of every step). `lengths[s]`
counts the valid positions of slot s. Writes go through `write`, which scatters new entries
at their absolute positions and drops padding (position -1), so no write can land in another
slot or past the end. Jitted callers donate the cache and XLA updates it in place.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.attention import attention, rope_attention
from pallas_kernels.kv_append import rope_append, write_positions
from rjax.config import ModelConfig


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
        return self.k[0].dtype

    def write(self, layer: int, k_new, v_new, pos, slots):
        """k_new, v_new [B, T, Hkv, D] at positions pos [B, T] (-1: skip) of cache rows `slots`."""
        rows = jnp.arange(pos.shape[0]) if slots is None else slots
        k = write_positions(self.k[layer], k_new, pos, rows)
        v = write_positions(self.v[layer], v_new, pos, rows)
        return dataclasses.replace(self, k=_replace(self.k, layer, k), v=_replace(self.v, layer, v))

    def rope_write(self, layer: int, parts, bias, pos, slots, inv_freq, *, n_heads: int, pairing: str, dtype):
        """The fused QKV product as partial sums parts [S, B, T, (Hq + 2 Hkv) D] (plus bias or
        None), summed and rounded to `dtype`: queries and keys rotated for positions pos [B, T],
        keys and values written as `write` does; one kernel at decode (pallas_kernels.kv_append).
        -> (q [B, T, Hq, D], cache)."""
        rows = jnp.arange(pos.shape[0]) if slots is None else slots
        q, k, v = rope_append(parts, bias, pos, self.k[layer], self.v[layer], inv_freq, rows, n_heads=n_heads,
                              pairing=pairing, dtype=dtype)
        return q, dataclasses.replace(self, k=_replace(self.k, layer, k), v=_replace(self.v, layer, v))

    def rope_write_attend(self, layer: int, parts, bias, pos, inv_freq, *, n_heads: int, pairing: str, dtype,
                          scale: float, window: int | None, quantize_out: bool = False):
        """`rope_write`, then `attend`, for one token per sequence in rows 0..B-1 (parts
        [S, B, 1, (Hq + 2 Hkv) D], pos [B, 1]), as one kernel on the GPU
        (pallas_kernels.attention.rope_attention). -> (attention output [B, 1, Hq, D], or with
        quantize_out possibly a QuantizedX [B, 1] of it, cache)."""
        out, k, v, arrivals = rope_attention(parts[:, :, 0], bias, pos[:, 0], self.k[layer], self.v[layer], inv_freq,
                                             n_heads=n_heads, pairing=pairing, dtype=dtype, scale=scale,
                                             window=window, arrivals=self.arrivals, quantize_out=quantize_out)
        return out, dataclasses.replace(self, k=_replace(self.k, layer, k), v=_replace(self.v, layer, v),
                                        arrivals=arrivals)

    def attend(self, layer: int, q, pos, slots, *, scale: float, window: int | None):
        k, v = self.k[layer], self.v[layer]
        if slots is not None:
            k, v = k[slots], v[slots]
        # Visible length: everything up to the newest query position of each sequence.
        kv_len = jnp.max(pos, axis=1) + 1
        return attention(q, k, v, pos, kv_len, scale=scale, window=window)

    def advance(self, slots, n_new):
        """lengths[slots] += n_new (n_new [B] int32)."""
        if slots is None:
            return dataclasses.replace(self, lengths=self.lengths + n_new)
        return dataclasses.replace(self, lengths=self.lengths.at[slots].add(n_new))

    def row(self, slot):
        """Slot `slot`'s K and V, each [L, Hkv, max_len, D]."""
        return jnp.stack([k[slot] for k in self.k]), jnp.stack([v[slot] for v in self.v])

    def set_row(self, slot, k, v, length):
        """Slot `slot` holds k, v [L, Hkv, max_len, D] and `length` positions."""
        return dataclasses.replace(self, k=tuple(c.at[slot].set(x) for c, x in zip(self.k, k)),
                                   v=tuple(c.at[slot].set(x) for c, x in zip(self.v, v)),
                                   lengths=self.lengths.at[slot].set(length))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixSnapshot:
    """One sequence's KV: k, v [L, Hkv, max_len, D] (positions past `length` are whatever the
    slot held there), and `length` (int32 scalar) valid positions. A pytree of fixed shapes, so
    `snapshot` and `restore` jit once per cache shape whatever the length."""
    k: jax.Array
    v: jax.Array
    length: jax.Array


@jax.jit
def snapshot(cache, slot) -> PrefixSnapshot:
    """The KV of slot `slot` (a traced int is fine) of a contiguous or paged cache."""
    k, v = cache.row(slot)
    return PrefixSnapshot(k, v, cache.lengths[slot])


@jax.jit
def restore(cache, slot, snap: PrefixSnapshot):
    """`cache` with slot `slot` holding `snap` (the cache's own shape and dtype). A paged slot
    must own the pages for snap.length positions: restore fills them and writes nothing else."""
    return cache.set_row(slot, snap.k.astype(cache.dtype), snap.v.astype(cache.dtype), snap.length)


def _replace(arrays: tuple, i: int, new) -> tuple:
    return arrays[:i] + (new,) + arrays[i + 1:]


def init_cache(cfg: ModelConfig, n_slots: int, max_len: int, dtype=jnp.float32) -> KVCache:
    if max_len > cfg.context_length:
        raise ValueError(f"cache length {max_len} exceeds the model's context length {cfg.context_length}")
    shape = (n_slots, cfg.n_kv_heads, max_len, cfg.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))  # noqa: E731
    return KVCache(zeros(), zeros(), jnp.zeros((n_slots,), jnp.int32), jnp.zeros(shape[:2], jnp.int32))
