"""Attention over a KV cache: Pallas GPU kernels for prefill and decode, each beside a pure-JAX reference.

`attention` (contiguous cache [B, Hkv, S, D]) and `paged_attention` (page pool [P, Hkv, page_size, D]
plus block tables) are the entry points the model calls; semantics are in reference.py.

implementation:
  None         choose: on a GPU backend the Pallas kernel (prefill kernel when T > 8, decode kernel
               otherwise), elsewhere the reference. The contiguous prefill uses the Mosaic GPU kernel
               (prefill_mgpu.py) where it applies (16-bit inputs, head dim 64/128/192/256, cache
               length a multiple of its key block), else the Triton-lowered one (prefill.py).
  "reference"  the pure-JAX reference
  "pallas"     the Pallas kernel, compiled for the GPU
  "interpret"  the Pallas kernel in interpret mode (runs on the CPU; for tests)
"""
from __future__ import annotations

import jax

from .decode import decode_attention, paged_decode_attention
from .prefill import paged_prefill_attention, prefill_attention
from .prefill_mgpu import mgpu_prefill_attention, supports as mgpu_prefill_supports
from .reference import attention_reference, paged_attention_reference

__all__ = [
    "attention", "paged_attention", "attention_reference", "paged_attention_reference",
    "prefill_attention", "mgpu_prefill_attention", "paged_prefill_attention", "decode_attention", "paged_decode_attention",
    "MAX_DECODE_TOKENS",
]

MAX_DECODE_TOKENS = 8  # query tokens per sequence up to which the decode kernel is used
_IMPLEMENTATIONS = (None, "reference", "pallas", "interpret")


def _resolve(implementation):
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"attention: implementation={implementation!r} is not one of {_IMPLEMENTATIONS}")
    if implementation is None:
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return implementation


def attention(q, k, v, q_pos, kv_len, *, scale: float, window: int | None = None, implementation=None):
    """q [B, T, Hq, D] over the contiguous cache k, v [B, Hkv, S, D]; returns [B, T, Hq, D]."""
    impl = _resolve(implementation)
    if impl == "reference":
        return attention_reference(q, k, v, q_pos, kv_len, scale=scale, window=window)
    if q.shape[1] <= MAX_DECODE_TOKENS:
        kernel = decode_attention
    elif mgpu_prefill_supports(q, k):
        kernel = mgpu_prefill_attention
    else:
        kernel = prefill_attention
    return kernel(q, k, v, q_pos, kv_len, scale=scale, window=window, interpret=impl == "interpret")


def paged_attention(q, k_pages, v_pages, block_tables, q_pos, kv_len, *, scale: float, window: int | None = None,
                    implementation=None):
    """q [B, T, Hq, D] over the paged cache k_pages, v_pages [P, Hkv, page_size, D]; returns [B, T, Hq, D]."""
    impl = _resolve(implementation)
    if impl == "reference":
        return paged_attention_reference(q, k_pages, v_pages, block_tables, q_pos, kv_len, scale=scale,
                                         window=window)
    kernel = paged_prefill_attention if q.shape[1] > MAX_DECODE_TOKENS else paged_decode_attention
    return kernel(q, k_pages, v_pages, block_tables, q_pos, kv_len, scale=scale, window=window,
                  interpret=impl == "interpret")
