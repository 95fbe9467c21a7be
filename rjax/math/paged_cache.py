"""The paged KV cache: a pool of fixed-size pages shared by all slots, plus a block table per slot.

Layout: k, v [n_layers, n_pages, n_kv_heads, page_size, head_dim]; `block_tables[s, i]` is the
page holding positions i * page_size .. (i + 1) * page_size - 1 of slot s, or -1 where slot s
owns no page yet; `lengths[s]` counts the valid positions of slot s. The pytree has the same
`write` / `attend` / `advance` methods as the contiguous `KVCache`, so the model runs on either,
and the same KV dtypes (rjax.math.cache.KV_DTYPES): an int8 pool has scales [L, n_pages, Hkv,
page_size] beside its values (a page carries its own scales, so a shared prefix page needs
nothing of the slot that wrote it), an fp8 pool scales [L, Hkv].

Which pages a slot owns is decided on the host by `rjax.runtime.pages.PageAllocator` (free list,
reservations, the prefix cache) and copied into the device table by the pure `set_block_tables`. On the device a write whose position has no page in the slot's table is
dropped, never redirected: no write can reach a page the slot does not own.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.attention import kind_of, paged_attention, paged_rope_attention
from pallas_kernels.kv_append import rope_append
from pallas_kernels.kv_quant import quantize_entries
from rjax.math.cache import _STORAGE, check_kv_dtype, fp8_head_scales
from rjax.math.config import ModelConfig

NO_PAGE = -1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    k: jax.Array             # [L, n_pages, Hkv, page_size, D]
    v: jax.Array
    block_tables: jax.Array  # [n_slots, max_pages] int32, NO_PAGE where unallocated
    lengths: jax.Array       # [n_slots] int32
    # Quantized K/V only: int8 [L, n_pages, Hkv, page_size] float32 (per entry), fp8 [L, Hkv].
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    # [n_slots, Hkv] int32, zero between calls: the fused decode kernel's count of finished split
    # programs (as rjax.math.cache.KVCache's). None: each call makes fresh zeros.
    arrivals: jax.Array | None = None
    # The dtype attention computes in, for a quantized cache (a float cache computes in its own).
    compute_dtype: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    # Whether positions live in pages (a block table per slot) rather than contiguous rows.
    paged = True

    @property
    def n_slots(self) -> int:
        return self.block_tables.shape[0]

    @property
    def n_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def max_pages(self) -> int:
        return self.block_tables.shape[1]

    @property
    def max_len(self) -> int:
        """Positions one slot can hold (when its whole table is allocated)."""
        return self.max_pages * self.page_size

    @property
    def dtype(self):
        """The compute dtype (of the activations attention takes and returns)."""
        return jnp.dtype(self.compute_dtype) if self.compute_dtype else self.k.dtype

    @property
    def storage_dtype(self):
        return self.k.dtype

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def kv_dtype(self) -> str:
        return kind_of(self.k.dtype) or "bf16"

    def _tables(self, slots):
        return self.block_tables if slots is None else self.block_tables[slots]

    def _pages_of(self, pos, slots):
        """(page, offset in the page) [B, T] of positions pos [B, T] of slots `slots`; page
        NO_PAGE where nothing may be written: padding (pos -1), positions past the table and
        pages the slot does not own."""
        ps = self.page_size
        col = jnp.where(pos >= 0, pos // ps, self.max_pages)
        page = jnp.take_along_axis(self._tables(slots), col, axis=1, mode="fill", fill_value=NO_PAGE)
        return jnp.where(page >= 0, page, NO_PAGE), jnp.where(pos >= 0, pos % ps, 0)

    def _pool(self, x):
        """All layers' pages of x [L, P, ...] as one pool [L * P, ...] (a reshape: no copy)."""
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])

    def write(self, layer: int, k_new, v_new, pos, slots):
        """k_new, v_new [B, T, Hkv, D] at positions pos [B, T] (-1: skip) of slots `slots` [B] (None: 0..B-1)."""
        page, off = self._pages_of(pos, slots)
        page = jnp.where(page >= 0, page, self.n_pages)  # n_pages: dropped
        if not self.quantized:
            k = self.k.at[layer, page, :, off].set(k_new.astype(self.k.dtype), mode="drop")
            v = self.v.at[layer, page, :, off].set(v_new.astype(self.v.dtype), mode="drop")
            return dataclasses.replace(self, k=k, v=v)
        kind = self.kv_dtype
        (kq, ks), (vq, vs) = (quantize_entries(x, kind, s[layer]) for x, s in
                              ((k_new, self.k_scale), (v_new, self.v_scale)))
        k = self.k.at[layer, page, :, off].set(kq, mode="drop")
        v = self.v.at[layer, page, :, off].set(vq, mode="drop")
        k_scale, v_scale = self.k_scale, self.v_scale
        if kind == "int8":
            k_scale = k_scale.at[layer, page, :, off].set(ks, mode="drop")
            v_scale = v_scale.at[layer, page, :, off].set(vs, mode="drop")
        return dataclasses.replace(self, k=k, v=v, k_scale=k_scale, v_scale=v_scale)

    def rope_write(self, layer: int, parts, bias, pos, slots, inv_freq, *, n_heads: int, pairing: str, dtype,
                   qk_norm=None, eps: float = 0.0, implementation: str | None = None):
        """rjax.math.cache.KVCache.rope_write into the pages: the kernel takes the layer's part of the
        pool as its cache rows, each token's page as its row and its offset in the page as where
        in the row it is written. -> (q [B, T, Hq, D], cache)."""
        page, off = self._pages_of(pos, slots)
        rows, at = layer * self.n_pages + jnp.maximum(page, 0), jnp.where(page >= 0, off, -1)
        _, k, v, ks, vs = self._layer_view(layer, slots)
        q, k, v, ks, vs = rope_append(parts, bias, pos, k, v, inv_freq, rows, n_heads=n_heads, pairing=pairing,
                                      dtype=dtype, k_scale=ks, v_scale=vs, qk_norm=qk_norm, eps=eps, at=at,
                                      implementation=implementation)
        return q, self._with_pool(k, v, ks, vs)

    def _layer_view(self, layer: int, slots):
        """What a kernel reads of layer `layer`: all layers' pages as one pool [L * n_pages, ...]
        (a reshape: no copy; slicing out one layer's pool would copy it), the tables of `slots`
        pointing into this layer's part, and the scales. -> (tables, k, v, k_scale, v_scale)."""
        tables = self._tables(slots)
        tables = jnp.where(tables >= 0, tables + layer * self.n_pages, NO_PAGE)
        ks = vs = None
        if self.kv_dtype == "int8":
            ks, vs = self._pool(self.k_scale), self._pool(self.v_scale)
        elif self.quantized:
            ks, vs = self.k_scale[layer], self.v_scale[layer]
        return tables, self._pool(self.k), self._pool(self.v), ks, vs

    def _with_pool(self, k, v, ks, vs, **changes):
        """This cache with the pools (and int8 scales) a kernel returned."""
        out = dataclasses.replace(self, k=k.reshape(self.k.shape), v=v.reshape(self.v.shape), **changes)
        if self.kv_dtype == "int8":
            out = dataclasses.replace(out, k_scale=ks.reshape(self.k_scale.shape), v_scale=vs.reshape(self.v_scale.shape))
        return out

    def rope_write_attend(self, layer: int, parts, bias, pos, inv_freq, *, n_heads: int, pairing: str, dtype,
                          scale: float, window: int | None, quantize_out: bool = False, qk_norm=None,
                          eps: float = 0.0, slots=None, implementation: str | None = None):
        """`rope_write`, then `attend`, for one token per sequence (parts [S, B, 1, (Hq + 2 Hkv) D],
        pos [B, 1]) of slots `slots` (None: 0..B-1), as one kernel on the GPU
        (pallas_kernels.attention.paged_rope_attention). -> (attention output [B, 1, Hq, D], or
        with quantize_out possibly a QuantizedX [B, 1] of it, cache)."""
        tables, k, v, ks, vs = self._layer_view(layer, slots)
        fits = self.arrivals is not None and self.arrivals.shape[0] >= pos.shape[0]
        arrivals = self.arrivals if fits and self.arrivals.shape[1] == self.k.shape[2] else None
        out, k, v, arrivals_out, ks, vs = paged_rope_attention(
            parts[:, :, 0], bias, pos[:, 0], k, v, tables, inv_freq, n_heads=n_heads, pairing=pairing, dtype=dtype,
            scale=scale, window=window, arrivals=arrivals, quantize_out=quantize_out, qk_norm=qk_norm, eps=eps,
            k_scale=ks, v_scale=vs, implementation=implementation)
        changes = {} if arrivals is None else dict(arrivals=arrivals_out)
        return out, self._with_pool(k, v, ks, vs, **changes)

    def attend(self, layer: int, q, pos, slots, *, scale: float, window: int | None, kernel=None,
               implementation: str | None = None):
        """rjax.math.cache.KVCache.attend over the pages."""
        # Visible length: everything up to the newest query position of each sequence.
        kv_len = jnp.max(pos, axis=1) + 1
        tables, k, v, ks, vs = self._layer_view(layer, slots)
        return paged_attention(q, k, v, tables, pos, kv_len, scale=scale, window=window, k_scale=ks, v_scale=vs,
                               kernel=kernel, implementation=implementation)

    def layer_view(self, layer: int):
        """(this cache, layer as an int32 array): what a layer call attends over. Every layer's pages
        are one pool, passed whole; the index, traced in the call, picks the layer's part."""
        return self, jnp.int32(layer)

    def advance(self, slots, n_new):
        """lengths[slots] += n_new (n_new [B] int32)."""
        if slots is None:
            return dataclasses.replace(self, lengths=self.lengths + n_new)
        return dataclasses.replace(self, lengths=self.lengths.at[slots].add(n_new))

    def row(self, slot):
        """Slot `slot`'s K and V, each [L, Hkv, max_len, D]; zeros where it owns no page."""
        table = self.block_tables[slot]

        def gather(pool):  # [L, P, Hkv, ps, D] -> [L, Hkv, max_pages * ps, D]
            pages = jnp.take(pool, table, axis=1, mode="fill", fill_value=0)
            L, M, H, ps, D = pages.shape
            return pages.transpose(0, 2, 1, 3, 4).reshape(L, H, M * ps, D)

        return gather(self.k), gather(self.v)

    def row_scales(self, slot):
        """Slot `slot`'s int8 scales, each [L, Hkv, max_len] (zeros where it owns no page); None,
        None for float and fp8 caches."""
        if self.kv_dtype != "int8":
            return None, None
        k, v = PagedKVCache.row(dataclasses.replace(self, k=self.k_scale[..., None], v=self.v_scale[..., None]),
                                slot)
        return k[..., 0], v[..., 0]

    def set_row(self, slot, k, v, length, k_scale=None, v_scale=None):
        """Slot `slot` holds k, v [L, Hkv, max_len, D] as stored (with int8 scales [L, Hkv,
        max_len]) and `length` positions: written into the pages its table names (positions
        without a page are dropped; no other page is touched)."""
        table = self.block_tables[slot]
        page = jnp.where(table >= 0, table, self.n_pages)

        def scatter(pool, x):
            L, H, S, D = x.shape
            pages = x.reshape(L, H, self.max_pages, self.page_size, D).transpose(0, 2, 1, 3, 4)
            return pool.at[:, page].set(pages, mode="drop")

        out = dataclasses.replace(self, k=scatter(self.k, k), v=scatter(self.v, v),
                                  lengths=self.lengths.at[slot].set(length))
        if k_scale is not None:
            out = dataclasses.replace(out, k_scale=scatter(self.k_scale[..., None], k_scale[..., None])[..., 0],
                                      v_scale=scatter(self.v_scale[..., None], v_scale[..., None])[..., 0])
        return out

    def reset(self, slots):
        """Empty slots `slots` [B]: length 0 and no pages (indices >= n_slots are ignored)."""
        return dataclasses.replace(
            self, lengths=self.lengths.at[slots].set(0, mode="drop"),
            block_tables=self.block_tables.at[slots].set(NO_PAGE, mode="drop"))


def init_paged_cache(cfg: ModelConfig, n_slots: int, n_pages: int, page_size: int, max_len: int,
                     dtype=jnp.float32, kv_dtype: str | None = None, fp8_scales=None) -> PagedKVCache:
    """An empty paged cache: n_pages pages of page_size positions; each slot may grow to max_len
    positions (a multiple of page_size) when the pool has pages for it. Attention computes in
    `dtype`; K/V are stored as `kv_dtype` (rjax.math.cache.init_cache)."""
    kv_dtype = check_kv_dtype(kv_dtype)
    if max_len > cfg.context_length:
        raise ValueError(f"cache length {max_len} exceeds the model's context length {cfg.context_length}")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    if max_len % page_size:
        raise ValueError(f"cache length {max_len} is not a multiple of the page size {page_size}")
    if n_slots < 1 or n_pages < 1:
        raise ValueError(f"a paged cache needs at least one slot and one page (got {n_slots} slots, {n_pages} pages)")
    shape = (cfg.n_layers, n_pages, cfg.n_kv_heads, page_size, cfg.head_dim)
    store = _STORAGE.get(kv_dtype, dtype)
    common = (jnp.zeros(shape, store), jnp.zeros(shape, store),
              jnp.full((n_slots, max_len // page_size), NO_PAGE, jnp.int32), jnp.zeros((n_slots,), jnp.int32))
    arrivals = jnp.zeros((n_slots, cfg.n_kv_heads), jnp.int32)
    if kv_dtype == "bf16":
        return PagedKVCache(*common, arrivals=arrivals)
    if kv_dtype == "int8":
        ks, vs = jnp.zeros(shape[:4], jnp.float32), jnp.zeros(shape[:4], jnp.float32)
    else:
        ks, vs = fp8_head_scales(cfg, fp8_scales)
    return PagedKVCache(*common, k_scale=ks, v_scale=vs, arrivals=arrivals, compute_dtype=jnp.dtype(dtype).name)


@functools.partial(jax.jit, donate_argnames=("cache",))
def set_lengths(cache: PagedKVCache, slots: jax.Array, lengths: jax.Array) -> PagedKVCache:
    """lengths[slots] = lengths ([B]); slots >= n_slots are ignored (padding). For a slot whose
    table starts with pages of a cached prefix: it holds those positions already."""
    return dataclasses.replace(cache, lengths=cache.lengths.at[slots].set(lengths, mode="drop"))


@functools.partial(jax.jit, donate_argnames=("cache",))
def set_block_tables(cache: PagedKVCache, slots: jax.Array, tables: jax.Array) -> PagedKVCache:
    """block_tables[slots] = tables ([B], [B, max_pages]); slots >= n_slots are ignored (padding)."""
    return dataclasses.replace(cache, block_tables=cache.block_tables.at[slots].set(tables, mode="drop"))


def row_view(cache: PagedKVCache, rows):
    """Rows [R] of the cache as a cache of R rows: their block tables and lengths over the same
    page pool (no K/V copy); a padding row (>= n_slots) owns no page and holds nothing."""
    n = cache.block_tables.shape[0]
    pad = rows >= n
    idx = jnp.minimum(rows, n - 1)
    return dataclasses.replace(cache, block_tables=jnp.where(pad[:, None], NO_PAGE, cache.block_tables[idx]),
                               lengths=jnp.where(pad, 0, cache.lengths[idx]))


def put_row_view(cache: PagedKVCache, rows, view: PagedKVCache) -> PagedKVCache:
    """Back from a `row_view`: its pool is the cache's, written in place; only the rows'
    lengths go back (padding rows dropped)."""
    return dataclasses.replace(view, block_tables=cache.block_tables,
                               lengths=cache.lengths.at[rows].set(view.lengths, mode="drop"))
