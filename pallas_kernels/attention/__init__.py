"""Attention over a KV cache: Pallas GPU kernels for prefill and decode, each beside a pure-JAX reference.

`attention` (contiguous cache [B, Hkv, S, D]) and `paged_attention` (page pool [P, Hkv, page_size, D]
plus block tables) are the entry points the model calls; semantics are in reference.py. Both take
a quantized cache too (int8 per entry or fp8 per head, with k_scale and v_scale; pallas_kernels/kv_quant.py),
read by the decode kernel and the Triton prefill kernel.
`rope_attention` is a one-token decode step from the QKV product on: kv_append's rotation and
K/V append, then the attention, as one kernel (`decode_rope_attention`; the model's plan says
for how many sequences); `paged_rope_attention` the same over a paged cache.

Which kernel attends is an `AttentionKernel`: the decode kernel for a few positions per sequence
(`takes_decode`), else for a contiguous cache the Mosaic GPU prefill kernel (prefill_mgpu.py)
where it applies (16-bit inputs, head dim 64/128/192/256, cache length a multiple of its key
block), else the Triton-lowered one (prefill.py). `attention_kernel` states that rule from the
shapes; the model's plan (rjax.math.plan) asks it once and passes its answer as `kernel`, and a call
without one (a test, a benchmark) is answered by the same rule from its arrays.

implementation (what runs the kernel):
  None         on a GPU backend the Pallas kernel, elsewhere the reference
  "reference"  the pure-JAX reference
  "pallas"     the Pallas kernel, compiled for the GPU
  "interpret"  the Pallas kernel in interpret mode (runs on the CPU; for tests)
"""
from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from .decode import decode_attention, decode_rope_attention, paged_decode_attention, paged_decode_rope_attention
from .decode_tiling import token_rows
from .prefill import paged_prefill_attention, prefill_attention
from .prefill_mgpu import mgpu_prefill_attention, supports as mgpu_prefill_supports, supports_shapes
from pallas_kernels.kv_append import rope_append_reference
from pallas_kernels.kv_quant import dequantize, kind_of, quantize_fp8, quantize_int8
from .reference import attention_reference, paged_attention_reference

__all__ = [
    "attention", "paged_attention", "attention_reference", "paged_attention_reference",
    "prefill_attention", "mgpu_prefill_attention", "paged_prefill_attention", "decode_attention",
    "paged_decode_attention", "decode_rope_attention", "rope_attention", "paged_decode_rope_attention",
    "paged_rope_attention",
    "MAX_DECODE_TOKENS", "takes_decode", "AttentionKernel", "attention_kernel", "kind_of", "quantize_int8", "quantize_fp8", "dequantize",
]

# Query tokens per sequence up to which the decode kernel is used: always up to 8, and up to 16
# while the tile's query rows (tokens x query heads per KV head, each padded to a power of two:
# decode_tiling.token_rows) hold at most 64 x 128 values, as llama-8b's 16 x 4 rows of 128 do. A speculative
# verification of 9-16 positions runs several times faster there than on the prefill kernel
# (docs/kernels.md, "Decode").
MAX_DECODE_TOKENS = 16
_DECODE_TILE = 64 * 128


def takes_decode(T: int, q_heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether T query positions per sequence over these heads go to the decode kernel (else to
    the prefill kernels)."""
    Tp, Gp = token_rows(T, q_heads // kv_heads)
    return T <= 8 or (T <= MAX_DECODE_TOKENS and Tp * Gp * head_dim <= _DECODE_TILE)


class AttentionKernel(enum.StrEnum):
    """The kernel that attends a chunk of query positions over a KV cache."""
    REFERENCE = "reference"        # the pure-JAX reference (reference.py)
    DECODE = "decode"              # decode.py: up to MAX_DECODE_TOKENS positions per sequence, keys split
    PREFILL = "prefill"            # prefill.py, lowered by Triton: any cache, dtype and head dim
    PREFILL_MGPU = "prefill_mgpu"  # prefill_mgpu.py, Mosaic GPU: a contiguous 16-bit cache (supports_shapes)


def attention_kernel(tokens: int, q_heads: int, kv_heads: int, head_dim: int, *, gpu: bool, paged: bool, dtype,
                     cache_dtype=None, cache_len: int | None = None) -> AttentionKernel:
    """The kernel for `tokens` query positions per sequence in `dtype` over a cache (paged or
    contiguous; `cache_len` positions per row stored in `cache_dtype`, default `dtype`) on a GPU
    (`gpu`) or elsewhere. Without `cache_len` the Mosaic kernel, which needs it, is not chosen."""
    if not gpu:
        return AttentionKernel.REFERENCE
    if takes_decode(tokens, q_heads, kv_heads, head_dim):
        return AttentionKernel.DECODE
    if not paged and cache_len is not None and supports_shapes(
            dtype, dtype if cache_dtype is None else cache_dtype, head_dim, cache_len):
        return AttentionKernel.PREFILL_MGPU
    return AttentionKernel.PREFILL


_IMPLEMENTATIONS = (None, "reference", "pallas", "interpret")


def _resolve(implementation):
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"attention: implementation={implementation!r} is not one of {_IMPLEMENTATIONS}")
    if implementation is None:
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return implementation


def _kernel_of(kernel: AttentionKernel | None, impl: str, q, k, paged: bool) -> AttentionKernel:
    """The kernel given, or the rule's for these arrays; the reference where `impl` says so."""
    if impl == "reference":
        return AttentionKernel.REFERENCE
    if kernel is None:
        B, T, Hq, D = q.shape
        return attention_kernel(T, Hq, k.shape[1], D, gpu=True, paged=paged, dtype=q.dtype, cache_dtype=k.dtype,
                                cache_len=None if paged else k.shape[2])
    return AttentionKernel(kernel)


def attention(q, k, v, q_pos, kv_len, *, scale: float, window: int | None = None,
              kernel: AttentionKernel | None = None, implementation=None, k_scale=None, v_scale=None):
    """q [B, T, Hq, D] over the contiguous cache k, v [B, Hkv, S, D]; returns [B, T, Hq, D].
    kernel: the plan's choice (None: `attention_kernel` for these arrays)."""
    impl = _resolve(implementation)
    kernel = _kernel_of(kernel, impl, q, k, paged=False)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    if kernel == AttentionKernel.REFERENCE:
        return attention_reference(q, k, v, q_pos, kv_len, scale=scale, window=window, **scales)
    if kernel == AttentionKernel.PREFILL_MGPU and (k_scale is not None or not mgpu_prefill_supports(q, k)):
        raise ValueError(f"attention: the Mosaic prefill kernel does not take q {q.dtype.name} {q.shape} over a "
                         f"cache {k.dtype.name} {k.shape} (a plan made for another cache?)")
    run = {AttentionKernel.DECODE: decode_attention, AttentionKernel.PREFILL_MGPU: mgpu_prefill_attention,
           AttentionKernel.PREFILL: prefill_attention}[kernel]
    if k_scale is None:
        scales = {}
    return run(q, k, v, q_pos, kv_len, scale=scale, window=window, interpret=impl == "interpret", **scales)


def rope_attention(parts, bias, pos, k_cache, v_cache, inv_freq, *, n_heads: int, pairing: str, dtype,
                   scale: float, window: int | None = None, arrivals=None, quantize_out: bool = False,
                   implementation=None, qk_norm=None, eps: float = 0.0, k_scale=None, v_scale=None):
    """One decode token per sequence b (cache row b) from its QKV product's partial sums parts
    [S, B, (Hq + 2 Hkv) D]: q and k rotated for pos [B], k and v appended there, attention over
    positions 0..pos. arrivals: None or the kernel's [B, Hkv] int32 scratch, zero between calls
    (see decode_rope_attention). -> (out [B, 1, Hq, D], k_cache, v_cache, arrivals). The fused
    kernel on a GPU backend; elsewhere kv_append's reference, then this package's. quantize_out:
    the kernel may hand the output over as a QuantizedX [B, 1] (see decode_rope_attention).
    qk_norm, eps: an RMS norm of the query and key heads before the rotation (see rope_append).
    A quantized cache comes with its scales k_scale, v_scale, written quantized (see
    decode_rope_attention). -> (out, k_cache, v_cache, arrivals, k_scale, v_scale)."""
    impl = _resolve(implementation)
    kw = dict(n_heads=n_heads, pairing=pairing, dtype=dtype, qk_norm=qk_norm, eps=eps)
    if impl == "reference":
        B = parts.shape[1]
        q, k_cache, v_cache, k_scale, v_scale = rope_append_reference(
            parts[:, :, None], bias, pos[:, None], k_cache, v_cache, inv_freq, jnp.arange(B), **kw, k_scale=k_scale,
            v_scale=v_scale)
        out = attention_reference(q, k_cache, v_cache, pos[:, None], pos + 1, scale=scale, window=window,
                                  k_scale=k_scale, v_scale=v_scale)
        return out.astype(dtype), k_cache, v_cache, arrivals, k_scale, v_scale
    return decode_rope_attention(parts, bias, pos, k_cache, v_cache, inv_freq, **kw, scale=scale, window=window,
                                 interpret=impl == "interpret", arrivals=arrivals, quantize_out=quantize_out,
                                 k_scale=k_scale, v_scale=v_scale)


def paged_rope_attention(parts, bias, pos, k_pages, v_pages, block_tables, inv_freq, *, n_heads: int, pairing: str,
                         dtype, scale: float, window: int | None = None, arrivals=None, quantize_out: bool = False,
                         implementation=None, qk_norm=None, eps: float = 0.0, k_scale=None, v_scale=None):
    """`rope_attention` over a paged cache: the page pool k_pages, v_pages [P, Hkv, page_size, D]
    and block_tables [B, max_pages] (see paged_decode_rope_attention); the token at pos [B] goes
    on the page sequence b's table names for it. arrivals: None or [B' >= B, Hkv] int32 zeros.
    -> (out [B, 1, Hq, D] or a QuantizedX, k_pages, v_pages, arrivals, k_scale, v_scale)."""
    impl = _resolve(implementation)
    kw = dict(n_heads=n_heads, pairing=pairing, dtype=dtype, qk_norm=qk_norm, eps=eps)
    if impl == "reference":
        ps, max_pages = k_pages.shape[2], block_tables.shape[1]
        col = jnp.where(pos >= 0, pos // ps, max_pages)
        page = jnp.take_along_axis(block_tables, col[:, None], axis=1, mode="fill", fill_value=-1)[:, 0]
        at = jnp.where((pos >= 0) & (page >= 0), pos % ps, -1)
        q, k_pages, v_pages, k_scale, v_scale = rope_append_reference(
            parts[:, :, None], bias, pos[:, None], k_pages, v_pages, inv_freq, jnp.maximum(page, 0)[:, None], **kw,
            k_scale=k_scale, v_scale=v_scale, at=at[:, None])
        out = paged_attention_reference(q, k_pages, v_pages, block_tables, pos[:, None], pos + 1, scale=scale,
                                        window=window, k_scale=k_scale, v_scale=v_scale)
        return out.astype(dtype), k_pages, v_pages, arrivals, k_scale, v_scale
    return paged_decode_rope_attention(parts, bias, pos, k_pages, v_pages, block_tables, inv_freq, **kw, scale=scale,
                                       window=window, interpret=impl == "interpret", arrivals=arrivals,
                                       quantize_out=quantize_out, k_scale=k_scale, v_scale=v_scale)


def paged_attention(q, k_pages, v_pages, block_tables, q_pos, kv_len, *, scale: float, window: int | None = None,
                    kernel: AttentionKernel | None = None, implementation=None, k_scale=None, v_scale=None):
    """q [B, T, Hq, D] over the paged cache k_pages, v_pages [P, Hkv, page_size, D]; returns [B, T, Hq, D].
    kernel: the plan's choice (None: `attention_kernel` for these arrays)."""
    impl = _resolve(implementation)
    kernel = _kernel_of(kernel, impl, q, k_pages, paged=True)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    if kernel == AttentionKernel.REFERENCE:
        return paged_attention_reference(q, k_pages, v_pages, block_tables, q_pos, kv_len, scale=scale,
                                         window=window, **scales)
    run = {AttentionKernel.DECODE: paged_decode_attention, AttentionKernel.PREFILL: paged_prefill_attention}.get(kernel)
    if run is None:
        raise ValueError(f"paged_attention: no {kernel} kernel over a paged cache")
    return run(q, k_pages, v_pages, block_tables, q_pos, kv_len, scale=scale, window=window,
               interpret=impl == "interpret", **(scales if k_scale is not None else {}))
