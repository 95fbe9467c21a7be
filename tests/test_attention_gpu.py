"""Attention kernels on the GPU at model-sized shapes, against the reference computed on the same GPU
(float32 with HIGHEST precision products). Skipped without a GPU.

Error bounds (relative Frobenius norm): bf16 inputs 1e-2 (bf16 probabilities and output, ~2^-9 each);
float32 inputs 1e-4 (IEEE float32 products, only the summation order differs).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import triton as pltriton

pytestmark = pytest.mark.gpu
if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU", allow_module_level=True)

from pallas_kernels.attention import (  # noqa: E402
    attention, attention_reference, decode_attention, mgpu_prefill_attention, paged_attention,
    paged_decode_attention, paged_prefill_attention, prefill_attention,
)

PREFILL_KERNELS = {"triton": prefill_attention, "mosaic": mgpu_prefill_attention}

BF16_TOL, F32_TOL = 1e-2, 1e-4


def rel_err(out, ref):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    assert np.isfinite(out).all(), "kernel output has NaN/inf"
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def make(seed, B, T, Hq, Hkv, S, D, dtype):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, T, Hq, D), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, Hkv, S, D), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, Hkv, S, D), jnp.float32).astype(dtype)
    return q, k, v


def paginate(k, page_size, seed):
    """Contiguous [B, Hkv, S, D] -> shuffled pool [P, Hkv, page_size, D] (P = all pages + 7 spare) and tables."""
    B, Hkv, S, D = k.shape
    n = S // page_size
    P = B * n + 7
    order = np.random.default_rng(seed).permutation(P)[: B * n].reshape(B, n)
    pool = jax.random.normal(jax.random.key(seed), (P, Hkv, page_size, D), jnp.float32).astype(k.dtype)
    pages = k.reshape(B, Hkv, n, page_size, D).transpose(0, 2, 1, 3, 4).reshape(B * n, Hkv, page_size, D)
    return pool.at[order.reshape(-1)].set(pages), jnp.asarray(order, jnp.int32)


@pytest.mark.parametrize("kernel", list(PREFILL_KERNELS))
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("window", [None, 384])
def test_prefill_matches_reference(kernel, D, window):
    B, T, Hq, Hkv, S = 3, 1024, 32, 8, 1536
    q, k, v = make(D, B, T, Hq, Hkv, S, D, jnp.bfloat16)
    # A fresh 1024-token prompt, a 700-token chunk after a 500-token prefix (padded), an empty slot.
    pos = np.stack([np.arange(T), np.where(np.arange(T) < 700, 500 + np.arange(T), -1), -np.ones(T, int)])
    pos, kv_len = jnp.asarray(pos, jnp.int32), jnp.asarray([1024, 1200, 0], jnp.int32)
    ref = attention_reference(q, k, v, pos, kv_len, scale=D ** -0.5, window=window)
    out = PREFILL_KERNELS[kernel](q, k, v, pos, kv_len, scale=D ** -0.5, window=window)
    assert rel_err(out, ref) < BF16_TOL
    assert not np.any(np.asarray(out[1, 700:], np.float32)) and not np.any(np.asarray(out[2], np.float32))


@pytest.mark.parametrize("D", [128, 256])
def test_mosaic_prefill_ragged_and_repeatable(D):
    # T = 300 (padded inside to 384); the same inputs twice must give the same bits (no race).
    q, k, v = make(11, 2, 300, 16, 4, 512, D, jnp.bfloat16)
    pos = jnp.asarray(np.stack([np.arange(300) + 200, np.where(np.arange(300) < 260, np.arange(300), -1)]),
                      jnp.int32)
    kv_len = jnp.asarray([500, 260], jnp.int32)
    ref = attention_reference(q, k, v, pos, kv_len, scale=0.07, window=128)
    out = mgpu_prefill_attention(q, k, v, pos, kv_len, scale=0.07, window=128)
    again = mgpu_prefill_attention(q, k, v, pos, kv_len, scale=0.07, window=128)
    assert rel_err(out, ref) < BF16_TOL
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(again, np.float32))


def test_prefill_float32_ragged():
    q, k, v = make(1, 2, 300, 8, 2, 333, 64, jnp.float32)
    pos = jnp.asarray(np.stack([np.arange(300) + 33, np.arange(300)]), jnp.int32)
    kv_len = jnp.asarray([333, 250], jnp.int32)
    ref = attention_reference(q, k, v, pos, kv_len, scale=0.125, window=100)
    assert rel_err(prefill_attention(q, k, v, pos, kv_len, scale=0.125, window=100), ref) < F32_TOL


@pytest.mark.parametrize("T", [1, 4, 8])
@pytest.mark.parametrize("D,window", [(128, None), (128, 1000), (256, None)])
def test_decode_matches_reference(T, D, window):
    B, Hq, Hkv, S = 8, 32, 8, 4096
    q, k, v = make(T + D, B, T, Hq, Hkv, S, D, jnp.bfloat16)
    lens = np.array([4096, 4000, 3001, 2048, 1500, 700, 33, 0])
    pos = np.maximum(lens[:, None] - T + np.arange(T)[None], -1)
    pos[-1] = -1
    pos, kv_len = jnp.asarray(pos, jnp.int32), jnp.asarray(lens, jnp.int32)
    ref = attention_reference(q, k, v, pos, kv_len, scale=D ** -0.5, window=window)
    for splits in (None, 1):
        out = decode_attention(q, k, v, pos, kv_len, scale=D ** -0.5, window=window, num_splits=splits)
        assert rel_err(out, ref) < BF16_TOL
        assert not np.any(np.asarray(out[-1], np.float32))


@pytest.mark.parametrize("T", [9, 12, 16])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_takes_a_verification(T, paged):
    """9-16 query positions per sequence (llama-8b heads: up to 64 rows of 128) on the decode
    kernels, contiguous and paged."""
    B, Hq, Hkv, S, D = 3, 32, 8, 2048, 128
    q, k, v = make(T, B, T, Hq, Hkv, S, D, jnp.bfloat16)
    lens = np.array([2048, 1000, 40])
    pos = jnp.asarray(lens[:, None] - T + np.arange(T)[None], jnp.int32)
    kv_len = jnp.asarray(lens, jnp.int32)
    ref = attention_reference(q, k, v, pos, kv_len, scale=D ** -0.5)
    if paged:
        kp, table = paginate(k, 64, seed=T)
        vp, _ = paginate(v, 64, seed=T)
        out = paged_decode_attention(q, kp, vp, table, pos, kv_len, scale=D ** -0.5)
    else:
        out = decode_attention(q, k, v, pos, kv_len, scale=D ** -0.5)
    assert rel_err(out, ref) < BF16_TOL


@pytest.mark.parametrize("paged", [False, True])
def test_one_token_merged_in_kernel_is_exact_every_call(paged):
    """One token over 16 splits, merged by whichever program arrives last: 50 calls match the
    reference and each other bit for bit (a missing ordering between a program's partials and
    its arrival would show as a call that differs)."""
    B, Hq, Hkv, S, D = 2, 9, 3, 2048, 64
    q, k, v = make(11, B, 1, Hq, Hkv, S, D, jnp.bfloat16)
    lens = np.array([2048, 777])
    pos, kv_len = jnp.asarray(lens[:, None] - 1, jnp.int32), jnp.asarray(lens, jnp.int32)
    ref = attention_reference(q, k, v, pos, kv_len, scale=D ** -0.5)
    if paged:
        kp, table = paginate(k, 64, seed=5)
        vp, _ = paginate(v, 64, seed=5)
        call = lambda q: paged_decode_attention(q, kp, vp, table, pos, kv_len, scale=D ** -0.5,  # noqa: E731
                                                num_splits=16)
    else:
        call = lambda q: decode_attention(q, k, v, pos, kv_len, scale=D ** -0.5, num_splits=16)  # noqa: E731
    call = jax.jit(call)
    outs = np.stack([np.asarray(call(q).astype(jnp.float32)) for _ in range(50)])
    assert rel_err(outs[0], ref) < BF16_TOL
    np.testing.assert_array_equal(outs, np.broadcast_to(outs[0], outs.shape))


@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_paged_decode_and_prefill_match_reference(page_size):
    B, Hq, Hkv, S, D = 4, 32, 8, 2048, 128
    q, k, v = make(page_size, B, 8, Hq, Hkv, S, D, jnp.bfloat16)
    kp, table = paginate(k, page_size, seed=3)
    vp, _ = paginate(v, page_size, seed=3)
    lens = np.array([2048, 1111, 520, 9])
    pos = jnp.asarray(lens[:, None] - 8 + np.arange(8)[None], jnp.int32)
    pos = jnp.maximum(pos, -1)
    kv_len = jnp.asarray(lens, jnp.int32)
    ref = attention_reference(q, k, v, pos, kv_len, scale=D ** -0.5, window=512)
    out = paged_decode_attention(q, kp, vp, table, pos, kv_len, scale=D ** -0.5, window=512)
    assert rel_err(out, ref) < BF16_TOL
    # Prefill over the paged cache: 256 queries ending at each sequence's length.
    qp, _, _ = make(7, B, 256, Hq, Hkv, 16, D, jnp.bfloat16)
    ppos = jnp.asarray(lens[:, None] - 256 + np.arange(256)[None], jnp.int32)
    ppos = jnp.where(ppos < 0, -1, ppos)
    ref = attention_reference(qp, k, v, ppos, kv_len, scale=D ** -0.5)
    out = paged_prefill_attention(qp, kp, vp, table, ppos, kv_len, scale=D ** -0.5)
    assert rel_err(out, ref) < BF16_TOL


def test_entry_points_pick_the_kernels_on_gpu():
    q, k, v = make(5, 2, 32, 8, 2, 512, 128, jnp.bfloat16)  # 32 positions: past the decode kernel's 16
    pos = jnp.asarray(np.stack([np.arange(32) + 400, np.arange(32)]), jnp.int32)
    kv_len = jnp.asarray([432, 32], jnp.int32)
    ref = attention_reference(q, k, v, pos, kv_len, scale=0.1)
    step = jax.jit(lambda *a: attention(*a, scale=0.1))
    assert rel_err(step(q, k, v, pos, kv_len), ref) < BF16_TOL  # prefill kernel (Mosaic GPU)
    assert "mosaic_gpu" in step.lower(q, k, v, pos, kv_len).as_text()
    assert rel_err(step(q[:, -1:], k, v, pos[:, -1:], kv_len), ref[:, -1:]) < BF16_TOL  # decode kernel
    kp, table = paginate(k, 32, seed=4)
    vp, _ = paginate(v, 32, seed=4)
    paged = paged_attention(q, kp, vp, table, pos, kv_len, scale=0.1)
    assert rel_err(paged, ref) < BF16_TOL
    lowered = step.lower(q[:, -1:], k, v, pos[:, -1:], kv_len).as_text()
    assert pltriton.CUSTOM_CALL_TARGET_NAME in lowered  # a Pallas kernel, not the reference
