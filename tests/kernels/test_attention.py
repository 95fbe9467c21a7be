"""Attention kernels on the CPU: the reference against a float64 NumPy loop, the Pallas kernels (interpret
mode) against the reference. Small shapes, random inputs (never zeros).

Error bounds (relative Frobenius norm ||out - ref|| / ||ref||):
- reference vs NumPy float64: 1e-5 (float32 arithmetic).
- kernel vs reference, float32 inputs: 1e-5 (interpret mode multiplies in float32).
- kernel vs reference, bfloat16 inputs: 1e-2 (probabilities are rounded to bf16 before the P @ V
  product and the output is bf16: each ~2^-9 relative; measured ~2e-3).
- on the GPU (tests marked `gpu`, at model-sized shapes) against the reference on the same GPU:
  bf16 1e-2 as above, float32 1e-4 (IEEE float32 products, only the summation order differs).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.attention import (
    attention, attention_reference, decode_attention, paged_attention, paged_attention_reference,
    paged_decode_attention, paged_prefill_attention, prefill_attention,
)
from pallas_kernels.attention import decode_tiling as decode_mod
from pallas_kernels.attention.prefill_mgpu import mgpu_prefill_attention
from pallas_kernels.attention.reference import gather_pages

F32_TOL, BF16_TOL = 1e-5, 1e-2


def rel_err(out, ref):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    assert np.isfinite(out).all(), "kernel output has NaN/inf"
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def numpy_attention(q, k, v, q_pos, kv_len, scale, window):
    """Direct float64 loops over (sequence, query, head): the definition, written independently."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    B, T, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    out = np.zeros((B, T, Hq, D))
    for b in range(B):
        for t in range(T):
            p = int(q_pos[b, t])
            keys = [j for j in range(S) if j <= p and j < kv_len[b] and (window is None or p - j < window)]
            if p < 0 or not keys:
                continue
            for h in range(Hq):
                kh = h // (Hq // Hkv)
                s = np.array([q[b, t, h] @ k[b, kh, j] for j in keys]) * scale
                w = np.exp(s - s.max())
                out[b, t, h] = (w / w.sum()) @ v[b, kh, keys]
    return out


def make_case(seed, *, B, T, Hq, Hkv, S, D, dtype, kv_len, q_start, pad_tail=()):
    """Random q/k/v; sequence b's queries sit at kv_len[b] - T + q_start[b] + t; pad_tail[b] rows padded."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, Hq, D)), dtype)
    k = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), dtype)
    pos = np.asarray(q_start)[:, None] + np.arange(T)[None, :]
    for b, n in enumerate(pad_tail):
        if n:
            pos[b, T - n:] = -1
    return q, k, v, jnp.asarray(pos, jnp.int32), jnp.asarray(kv_len, jnp.int32)


def paginate(k, page_size, num_pages, seed):
    """Scatter a contiguous cache [B, Hkv, S, D] into a shuffled page pool; returns (pool, block_tables)."""
    B, Hkv, S, D = k.shape
    n = S // page_size
    order = np.random.default_rng(seed).permutation(num_pages)[: B * n].reshape(B, n)
    pool = np.random.default_rng(seed + 1).standard_normal((num_pages, Hkv, page_size, D))
    pool = jnp.asarray(pool, k.dtype)
    pages = k.reshape(B, Hkv, n, page_size, D).transpose(0, 2, 1, 3, 4)  # [B, n, Hkv, ps, D]
    pool = pool.at[order.reshape(-1)].set(pages.reshape(B * n, Hkv, page_size, D))
    return pool, jnp.asarray(order, jnp.int32)


# ---------------------------------------------------------------- reference


@pytest.mark.parametrize("window", [None, 5])
def test_reference_matches_numpy_definition(window):
    q, k, v, pos, kv_len = make_case(0, B=3, T=6, Hq=4, Hkv=2, S=24, D=8, dtype=jnp.float32,
                                     kv_len=[20, 7, 0], q_start=[14, 1, 0], pad_tail=[0, 2, 0])
    ref = attention_reference(q, k, v, pos, kv_len, scale=0.35, window=window)
    want = numpy_attention(q, k, v, np.asarray(pos), np.asarray(kv_len), 0.35, window)
    assert rel_err(ref, want) < F32_TOL
    assert np.all(np.asarray(ref)[1, 4:] == 0) and np.all(np.asarray(ref)[2] == 0)  # padding, kv_len = 0


def test_paged_reference_matches_contiguous():
    q, k, v, pos, kv_len = make_case(1, B=2, T=3, Hq=4, Hkv=1, S=32, D=16, dtype=jnp.float32,
                                     kv_len=[30, 9], q_start=[27, 6])
    kp, table = paginate(k, 8, 11, seed=2)
    vp, _ = paginate(v, 8, 11, seed=2)
    np.testing.assert_array_equal(np.asarray(gather_pages(kp, table)), np.asarray(k))
    want = attention_reference(q, k, v, pos, kv_len, scale=0.25)
    got = paged_attention_reference(q, kp, vp, table, pos, kv_len, scale=0.25)
    assert rel_err(got, want) < 1e-6


# ---------------------------------------------------------------- prefill kernel (interpret mode)

PREFILL_CASES = {
    # name: (Hq, Hkv, D, dtype, window, block_q, block_k)
    "mha-f32": (2, 2, 32, jnp.float32, None, 16, 16),
    "gqa2-bf16-window": (4, 2, 64, jnp.bfloat16, 11, 32, 16),
    "gqa8-bf16": (8, 1, 32, jnp.bfloat16, None, 16, 32),
    "gqa4-f32-d128-window": (4, 1, 128, jnp.float32, 20, 32, 16),
}


@pytest.mark.parametrize("name", list(PREFILL_CASES))
def test_prefill_kernel_matches_reference(name):
    Hq, Hkv, D, dtype, window, bq, bk = PREFILL_CASES[name]
    # Three prompts of different lengths in one call: a fresh 40-token prompt, a 25-token chunk that
    # continues a cached prefix (padded), and an empty slot (kv_len = 0, all padding).
    q, k, v, pos, kv_len = make_case(3, B=3, T=40, Hq=Hq, Hkv=Hkv, S=72, D=D, dtype=dtype,
                                     kv_len=[40, 62, 0], q_start=[0, 37, 0], pad_tail=[0, 15, 40])
    ref = attention_reference(q, k, v, pos, kv_len, scale=D ** -0.5, window=window)
    out = prefill_attention(q, k, v, pos, kv_len, scale=D ** -0.5, window=window, block_q=bq, block_k=bk,
                            interpret=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_err(out, ref) < (F32_TOL if dtype == jnp.float32 else BF16_TOL)
    assert np.all(np.asarray(out, np.float32)[1, 25:] == 0) and np.all(np.asarray(out, np.float32)[2] == 0)


def test_prefill_kernel_head_dim_256_full_cache():
    # kv_len = S with S not a multiple of block_k: the last block is read with a bounds mask.
    q, k, v, pos, kv_len = make_case(4, B=1, T=24, Hq=2, Hkv=1, S=56, D=256, dtype=jnp.bfloat16,
                                     kv_len=[56], q_start=[32])
    ref = attention_reference(q, k, v, pos, kv_len, scale=0.0625)
    out = prefill_attention(q, k, v, pos, kv_len, scale=0.0625, block_q=16, block_k=16, interpret=True)
    assert rel_err(out, ref) < BF16_TOL


@pytest.mark.parametrize("page_size,block_k", [(8, 32), (32, 16)])
def test_paged_prefill_kernel_matches_reference(page_size, block_k):
    q, k, v, pos, kv_len = make_case(5, B=2, T=24, Hq=4, Hkv=2, S=64, D=32, dtype=jnp.bfloat16,
                                     kv_len=[50, 24], q_start=[26, 0], pad_tail=[0, 4])
    kp, table = paginate(k, page_size, 2 * 64 // page_size + 3, seed=6)
    vp, _ = paginate(v, page_size, 2 * 64 // page_size + 3, seed=6)
    ref = attention_reference(q, k, v, pos, kv_len, scale=0.2, window=9)
    out = paged_prefill_attention(q, kp, vp, table, pos, kv_len, scale=0.2, window=9, block_q=16,
                                  block_k=block_k, interpret=True)
    assert rel_err(out, ref) < BF16_TOL


def test_mosaic_prefill_kernel_matches_reference():
    window = 40
    # Mosaic GPU kernel in the GPU interpreter: two sequences, the second padded after 150 queries;
    # T = 200 is padded to the 128-row program tile inside the wrapper.
    q, k, v, pos, kv_len = make_case(14, B=2, T=200, Hq=2, Hkv=1, S=256, D=64, dtype=jnp.bfloat16,
                                     kv_len=[230, 150], q_start=[30, 0], pad_tail=[0, 50])
    ref = attention_reference(q, k, v, pos, kv_len, scale=0.125, window=window)
    out = mgpu_prefill_attention(q, k, v, pos, kv_len, scale=0.125, window=window, block_kv=64, interpret=True)
    assert out.shape == q.shape and rel_err(out, ref) < BF16_TOL
    assert not np.any(np.asarray(out[1, 150:], np.float32))


# ---------------------------------------------------------------- decode kernel (interpret mode)

DECODE_CASES = {
    # name: (T, Hq, Hkv, dtype, window, num_splits)
    "t1-gqa4-f32-split3": (1, 8, 2, jnp.float32, None, 3),
    "t4-gqa2-bf16-window-split2": (4, 4, 2, jnp.bfloat16, 13, 2),
    "t8-gqa8-bf16-split4": (8, 8, 1, jnp.bfloat16, None, 4),
    # A verification of 12 positions, 48 query rows per KV head (attention's bound is 64).
    "t12-gqa4-bf16-split2": (12, 8, 2, jnp.bfloat16, None, 2),
    "t3-mha-f32-window-nosplit": (3, 2, 2, jnp.float32, 30, 1),
    # smollm2's verification of 4 drafts: 5 tokens of 3 query heads, read as a padded 8 x 4 grid.
    "t5-gqa3-bf16-split2": (5, 9, 3, jnp.bfloat16, None, 2),
    # One token: q read in place; with one split the output is written without a combine step.
    "t1-gqa3-bf16-nosplit": (1, 9, 3, jnp.bfloat16, None, 1),
    "t1-gqa3-f32-window-split2": (1, 6, 2, jnp.float32, 20, 2),
    "t1-mha-f32-window-nosplit": (1, 2, 2, jnp.float32, 30, 1),
}


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_kernel_matches_reference(name):
    T, Hq, Hkv, dtype, window, splits = DECODE_CASES[name]
    # A long sequence, a short one whose first query is padding, and an empty slot.
    q, k, v, pos, kv_len = make_case(7, B=3, T=T, Hq=Hq, Hkv=Hkv, S=200, D=32, dtype=dtype,
                                     kv_len=[181, 37, 0], q_start=[181 - T, 37 - T, 0], pad_tail=[0, 0, T])
    pos = pos.at[1, 0].set(-1)
    ref = attention_reference(q, k, v, pos, kv_len, scale=0.3, window=window)
    out = decode_attention(q, k, v, pos, kv_len, scale=0.3, window=window, block_k=16, num_splits=splits,
                           interpret=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_err(out, ref) < (F32_TOL if dtype == jnp.float32 else BF16_TOL)
    assert np.all(np.asarray(out, np.float32)[1, 0] == 0) and np.all(np.asarray(out, np.float32)[2] == 0)


@pytest.mark.parametrize("window,merged_in_kernel", [(None, False), (40, True)])
def test_one_token_of_one_kv_head_over_many_blocks(window, merged_in_kernel):
    """One KV head at batch 1 over more blocks than the in-kernel merge's splits can spread:
    the splits' partials go to XLA's combine (about two waves of splits), unless a window keeps
    the rows' keys short."""
    S, block_k = 2048, 16
    assert decode_mod.merges_in_kernel(1, 1, decode_mod.visible_keys(S, window, block_k), block_k) == merged_in_kernel
    q, k, v, pos, kv_len = make_case(15, B=1, T=1, Hq=4, Hkv=1, S=S, D=32, dtype=jnp.float32,
                                     kv_len=[2000], q_start=[1999])
    ref = attention_reference(q, k, v, pos, kv_len, scale=0.2, window=window)
    out = decode_attention(q, k, v, pos, kv_len, scale=0.2, window=window, block_k=block_k, interpret=True)
    assert rel_err(out, ref) < F32_TOL


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_kernel_window_excludes_every_key(splits):
    # The query sits past kv_len by more than the window: it sees no key, output 0, no NaN.
    q, k, v, pos, kv_len = make_case(8, B=2, T=1, Hq=4, Hkv=2, S=64, D=16, dtype=jnp.float32,
                                     kv_len=[10, 64], q_start=[40, 63])
    out = decode_attention(q, k, v, pos, kv_len, scale=0.5, window=8, block_k=16, num_splits=splits,
                           interpret=True)
    ref = attention_reference(q, k, v, pos, kv_len, scale=0.5, window=8)
    assert np.all(np.asarray(out)[0] == 0) and rel_err(out, ref) < F32_TOL


@pytest.mark.parametrize("page_size,block_k,T,splits", [(16, 64, 2, 3), (64, 32, 2, 3), (16, 32, 1, 1),
                                                        (16, 32, 12, 2)])
def test_paged_decode_kernel_matches_reference(page_size, block_k, T, splits):
    q, k, v, pos, kv_len = make_case(9, B=2, T=T, Hq=4, Hkv=2, S=256, D=64, dtype=jnp.bfloat16,
                                     kv_len=[250, 70], q_start=[250 - T, 70 - T])
    kp, table = paginate(k, page_size, 2 * 256 // page_size + 5, seed=10)
    vp, _ = paginate(v, page_size, 2 * 256 // page_size + 5, seed=10)
    ref = attention_reference(q, k, v, pos, kv_len, scale=0.125, window=100)
    out = paged_decode_attention(q, kp, vp, table, pos, kv_len, scale=0.125, window=100, block_k=block_k,
                                 num_splits=splits, interpret=True)
    assert rel_err(out, ref) < BF16_TOL


# ---------------------------------------------------------------- entry points


def test_entry_points_dispatch_and_jit():
    q, k, v, pos, kv_len = make_case(11, B=2, T=12, Hq=4, Hkv=2, S=32, D=16, dtype=jnp.float32,
                                     kv_len=[30, 12], q_start=[18, 0])
    ref = attention_reference(q, k, v, pos, kv_len, scale=0.25, window=6)
    # CPU backend: implementation=None is the reference, bit for bit.
    auto = attention(q, k, v, pos, kv_len, scale=0.25, window=6)
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(ref))
    jitted = jax.jit(functools.partial(attention, scale=0.25, window=6, implementation="interpret"))
    assert rel_err(jitted(q, k, v, pos, kv_len), ref) < F32_TOL  # T = 12, 24 query rows: decode kernel
    wide = jnp.repeat(q, 4, axis=2)  # 8 query heads per KV head: 96 rows, the prefill kernel
    assert rel_err(jitted(wide, k, v, pos, kv_len), attention_reference(wide, k, v, pos, kv_len, scale=0.25,
                                                                         window=6)) < F32_TOL
    assert rel_err(jitted(q[:, -2:], k, v, pos[:, -2:], kv_len), ref[:, -2:]) < F32_TOL  # T = 2: decode kernel
    kp, table = paginate(k, 16, 6, seed=12)
    vp, _ = paginate(v, 16, 6, seed=12)
    paged = paged_attention(q[:, -1:], kp, vp, table, pos[:, -1:], kv_len, scale=0.25, window=6,
                            implementation="interpret")
    assert rel_err(paged, ref[:, -1:]) < F32_TOL
    with pytest.raises(ValueError, match="implementation"):
        attention(q, k, v, pos, kv_len, scale=0.25, implementation="triton")


def test_shape_errors_name_the_argument():
    q, k, v, pos, kv_len = make_case(13, B=1, T=2, Hq=3, Hkv=2, S=16, D=16, dtype=jnp.float32,
                                     kv_len=[4], q_start=[2])
    with pytest.raises(ValueError, match="query heads 3"):
        attention(q, k, v, pos, kv_len, scale=1.0, implementation="interpret")
    with pytest.raises(ValueError, match="q_pos"):
        attention_reference(q, k[:, :1], v[:, :1], pos[:, :1], kv_len, scale=1.0)


@pytest.mark.parametrize("T,splits", [(1, 1), (1, 2), (2, 1)])
def test_decode_kernel_lowers_to_triton_for_h100(T, splits):
    """The decode kernel, in its one-token and padded-rows forms, lowers for sm_90 without a GPU."""
    import warnings
    from unittest import mock

    from jax._src.pallas.triton import gpu_info

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    S = jax.ShapeDtypeStruct
    kv = S((1, 3, 640, 64), jnp.bfloat16)
    args = (S((1, T, 9, 64), jnp.bfloat16), kv, kv, S((1, T), jnp.int32), S((1,), jnp.int32))
    with warnings.catch_warnings(), mock.patch.object(gpu_info, "get_gpu_info", lambda: h100):
        warnings.simplefilter("ignore")
        lowered = decode_attention.trace(*args, scale=0.125, num_splits=splits).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


def test_decode_kernel_takes_a_verification():
    """Up to 8 tokens always; 9-16 while the tile's query rows hold at most 64 x 128 values."""
    from pallas_kernels.attention import takes_decode

    assert takes_decode(8, 64, 4, 256) and takes_decode(16, 32, 8, 128) and takes_decode(9, 9, 3, 64)
    assert not takes_decode(9, 32, 4, 128) and not takes_decode(17, 8, 8, 64)
    assert not takes_decode(16, 14, 2, 128) and not takes_decode(9, 4, 1, 256)


# ---- on the GPU at model-sized shapes, against the reference on the same GPU (float32, HIGHEST products) ----

PREFILL_KERNELS = {"triton": prefill_attention, "mosaic": mgpu_prefill_attention}

GPU_F32_TOL = 1e-4  # IEEE float32 products: only the summation order differs


def make_gpu(seed, B, T, Hq, Hkv, S, D, dtype):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, T, Hq, D), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, Hkv, S, D), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, Hkv, S, D), jnp.float32).astype(dtype)
    return q, k, v


def paginate_spare(k, page_size, seed):
    """Contiguous [B, Hkv, S, D] -> shuffled pool [P, Hkv, page_size, D] (P = all pages + 7 spare) and tables."""
    B, Hkv, S, D = k.shape
    n = S // page_size
    P = B * n + 7
    order = np.random.default_rng(seed).permutation(P)[: B * n].reshape(B, n)
    pool = jax.random.normal(jax.random.key(seed), (P, Hkv, page_size, D), jnp.float32).astype(k.dtype)
    pages = k.reshape(B, Hkv, n, page_size, D).transpose(0, 2, 1, 3, 4).reshape(B * n, Hkv, page_size, D)
    return pool.at[order.reshape(-1)].set(pages), jnp.asarray(order, jnp.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(PREFILL_KERNELS))
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("window", [None, 384])
def test_prefill_matches_reference(kernel, D, window):
    B, T, Hq, Hkv, S = 3, 1024, 32, 8, 1536
    q, k, v = make_gpu(D, B, T, Hq, Hkv, S, D, jnp.bfloat16)
    # A fresh 1024-token prompt, a 700-token chunk after a 500-token prefix (padded), an empty slot.
    pos = np.stack([np.arange(T), np.where(np.arange(T) < 700, 500 + np.arange(T), -1), -np.ones(T, int)])
    pos, kv_len = jnp.asarray(pos, jnp.int32), jnp.asarray([1024, 1200, 0], jnp.int32)
    ref = attention_reference(q, k, v, pos, kv_len, scale=D ** -0.5, window=window)
    out = PREFILL_KERNELS[kernel](q, k, v, pos, kv_len, scale=D ** -0.5, window=window)
    assert rel_err(out, ref) < BF16_TOL
    assert not np.any(np.asarray(out[1, 700:], np.float32)) and not np.any(np.asarray(out[2], np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("D", [128, 256])
def test_mosaic_prefill_ragged_and_repeatable(D):
    # T = 300 (padded inside to 384); the same inputs twice must give the same bits (no race).
    q, k, v = make_gpu(11, 2, 300, 16, 4, 512, D, jnp.bfloat16)
    pos = jnp.asarray(np.stack([np.arange(300) + 200, np.where(np.arange(300) < 260, np.arange(300), -1)]),
                      jnp.int32)
    kv_len = jnp.asarray([500, 260], jnp.int32)
    ref = attention_reference(q, k, v, pos, kv_len, scale=0.07, window=128)
    out = mgpu_prefill_attention(q, k, v, pos, kv_len, scale=0.07, window=128)
    again = mgpu_prefill_attention(q, k, v, pos, kv_len, scale=0.07, window=128)
    assert rel_err(out, ref) < BF16_TOL
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(again, np.float32))


@pytest.mark.gpu
def test_prefill_float32_ragged():
    q, k, v = make_gpu(1, 2, 300, 8, 2, 333, 64, jnp.float32)
    pos = jnp.asarray(np.stack([np.arange(300) + 33, np.arange(300)]), jnp.int32)
    kv_len = jnp.asarray([333, 250], jnp.int32)
    ref = attention_reference(q, k, v, pos, kv_len, scale=0.125, window=100)
    assert rel_err(prefill_attention(q, k, v, pos, kv_len, scale=0.125, window=100), ref) < GPU_F32_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 8])
@pytest.mark.parametrize("D,window", [(128, None), (128, 1000), (256, None)])
def test_decode_matches_reference(T, D, window):
    B, Hq, Hkv, S = 8, 32, 8, 4096
    q, k, v = make_gpu(T + D, B, T, Hq, Hkv, S, D, jnp.bfloat16)
    lens = np.array([4096, 4000, 3001, 2048, 1500, 700, 33, 0])
    pos = np.maximum(lens[:, None] - T + np.arange(T)[None], -1)
    pos[-1] = -1
    pos, kv_len = jnp.asarray(pos, jnp.int32), jnp.asarray(lens, jnp.int32)
    ref = attention_reference(q, k, v, pos, kv_len, scale=D ** -0.5, window=window)
    for splits in (None, 1):
        out = decode_attention(q, k, v, pos, kv_len, scale=D ** -0.5, window=window, num_splits=splits)
        assert rel_err(out, ref) < BF16_TOL
        assert not np.any(np.asarray(out[-1], np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [9, 12, 16])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_takes_a_verification(T, paged):
    """9-16 query positions per sequence (llama-8b heads: up to 64 rows of 128) on the decode
    kernels, contiguous and paged."""
    B, Hq, Hkv, S, D = 3, 32, 8, 2048, 128
    q, k, v = make_gpu(T, B, T, Hq, Hkv, S, D, jnp.bfloat16)
    lens = np.array([2048, 1000, 40])
    pos = jnp.asarray(lens[:, None] - T + np.arange(T)[None], jnp.int32)
    kv_len = jnp.asarray(lens, jnp.int32)
    ref = attention_reference(q, k, v, pos, kv_len, scale=D ** -0.5)
    if paged:
        kp, table = paginate_spare(k, 64, seed=T)
        vp, _ = paginate_spare(v, 64, seed=T)
        out = paged_decode_attention(q, kp, vp, table, pos, kv_len, scale=D ** -0.5)
    else:
        out = decode_attention(q, k, v, pos, kv_len, scale=D ** -0.5)
    assert rel_err(out, ref) < BF16_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_one_token_merged_in_kernel_is_exact_every_call(paged):
    """One token over 16 splits, merged by whichever program arrives last: 50 calls match the
    reference and each other bit for bit (a missing ordering between a program's partials and
    its arrival would show as a call that differs)."""
    B, Hq, Hkv, S, D = 2, 9, 3, 2048, 64
    q, k, v = make_gpu(11, B, 1, Hq, Hkv, S, D, jnp.bfloat16)
    lens = np.array([2048, 777])
    pos, kv_len = jnp.asarray(lens[:, None] - 1, jnp.int32), jnp.asarray(lens, jnp.int32)
    ref = attention_reference(q, k, v, pos, kv_len, scale=D ** -0.5)
    if paged:
        kp, table = paginate_spare(k, 64, seed=5)
        vp, _ = paginate_spare(v, 64, seed=5)
        call = lambda q: paged_decode_attention(q, kp, vp, table, pos, kv_len, scale=D ** -0.5,  # noqa: E731
                                                num_splits=16)
    else:
        call = lambda q: decode_attention(q, k, v, pos, kv_len, scale=D ** -0.5, num_splits=16)  # noqa: E731
    call = jax.jit(call)
    outs = np.stack([np.asarray(call(q).astype(jnp.float32)) for _ in range(50)])
    assert rel_err(outs[0], ref) < BF16_TOL
    np.testing.assert_array_equal(outs, np.broadcast_to(outs[0], outs.shape))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_paged_decode_and_prefill_match_reference(page_size):
    B, Hq, Hkv, S, D = 4, 32, 8, 2048, 128
    q, k, v = make_gpu(page_size, B, 8, Hq, Hkv, S, D, jnp.bfloat16)
    kp, table = paginate_spare(k, page_size, seed=3)
    vp, _ = paginate_spare(v, page_size, seed=3)
    lens = np.array([2048, 1111, 520, 9])
    pos = jnp.asarray(lens[:, None] - 8 + np.arange(8)[None], jnp.int32)
    pos = jnp.maximum(pos, -1)
    kv_len = jnp.asarray(lens, jnp.int32)
    ref = attention_reference(q, k, v, pos, kv_len, scale=D ** -0.5, window=512)
    out = paged_decode_attention(q, kp, vp, table, pos, kv_len, scale=D ** -0.5, window=512)
    assert rel_err(out, ref) < BF16_TOL
    # Prefill over the paged cache: 256 queries ending at each sequence's length.
    qp, _, _ = make_gpu(7, B, 256, Hq, Hkv, 16, D, jnp.bfloat16)
    ppos = jnp.asarray(lens[:, None] - 256 + np.arange(256)[None], jnp.int32)
    ppos = jnp.where(ppos < 0, -1, ppos)
    ref = attention_reference(qp, k, v, ppos, kv_len, scale=D ** -0.5)
    out = paged_prefill_attention(qp, kp, vp, table, ppos, kv_len, scale=D ** -0.5)
    assert rel_err(out, ref) < BF16_TOL


@pytest.mark.gpu
def test_entry_points_pick_the_kernels_on_gpu():
    q, k, v = make_gpu(5, 2, 32, 8, 2, 512, 128, jnp.bfloat16)  # 32 positions: past the decode kernel's 16
    pos = jnp.asarray(np.stack([np.arange(32) + 400, np.arange(32)]), jnp.int32)
    kv_len = jnp.asarray([432, 32], jnp.int32)
    ref = attention_reference(q, k, v, pos, kv_len, scale=0.1)
    step = jax.jit(lambda *a: attention(*a, scale=0.1))
    assert rel_err(step(q, k, v, pos, kv_len), ref) < BF16_TOL  # prefill kernel (Mosaic GPU)
    assert "mosaic_gpu" in step.lower(q, k, v, pos, kv_len).as_text()
    assert rel_err(step(q[:, -1:], k, v, pos[:, -1:], kv_len), ref[:, -1:]) < BF16_TOL  # decode kernel
    kp, table = paginate_spare(k, 32, seed=4)
    vp, _ = paginate_spare(v, 32, seed=4)
    paged = paged_attention(q, kp, vp, table, pos, kv_len, scale=0.1)
    assert rel_err(paged, ref) < BF16_TOL
    lowered = step.lower(q[:, -1:], k, v, pos[:, -1:], kv_len).as_text()
    assert pltriton.CUSTOM_CALL_TARGET_NAME in lowered  # a Pallas kernel, not the reference
