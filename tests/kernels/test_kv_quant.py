"""Quantized KV caches (int8 per entry, fp8 e4m3 per head) on the CPU: the formats' error, the
attention reference and the Pallas kernels (interpret mode) on quantized K/V, the contiguous and
paged caches that store them, and (slow) the default model and gemma3-270m decoding over an
int8 cache against the float32 cache.

Error bounds, and why:
- Quantization, per value: int8 |x - x^| <= max|row| / 254 (half a step of max|row| / 127);
  fp8 |x - x^| <= 2^-4 |x| for |x| / scale >= 2^-6 (3 mantissa bits: half an ulp is at most
  2^-4 of the value), else <= 2^-10 scale (the subnormal step 2^-9, halved).
- Attention on quantized K/V against the float32 reference, relative Frobenius norm, on rows of
  standard normal values (D = 64, max|row| about 2.5 sigma): int8's step is about 0.02 sigma,
  an error of about 0.6% of sigma per value (uniform: step / sqrt(12)); it perturbs the scores
  and V by that much, measured 0.8%: bound 2e-2. fp8's relative error per value is up to 2^-4,
  about 2.5% RMS over the mantissas; measured 3.8%: bound 8e-2.
- A kernel against the reference on the same quantized K/V: the dequantization is exact (int8
  and e4m3 values are exact in float32, the scales are applied to float32 scores and weights),
  so only the summation order differs: 1e-5, as for the float kernels (test_attention.py).
- On the GPU (tests marked `gpu`, model-sized shapes, bf16 queries) against the reference on the
  same quantized cache on the same GPU: 1e-2, as for bf16 caches. The int8 and e4m3 values are
  exact in float16, which the kernels compute in for bf16 queries, so what differs is the queries'
  rounding (bf16, ~2^-9), the float16 probabilities before the product with V (~2^-11) and the
  bf16 output (~2^-9).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import (
    attention, attention_reference, decode_attention, paged_attention, paged_attention_reference,
    paged_decode_attention, paged_prefill_attention, prefill_attention,
)
from pallas_kernels.kv_quant import FP8_MAX, dequantize, quantize_fp8, quantize_int8
from rjax.engine import steps
from rjax.math.cache import check_kv_dtype, init_cache, restore, snapshot
from rjax.math.paged_cache import init_paged_cache, set_block_tables

QUANT_TOL = {"int8": 2e-2, "fp8": 8e-2}
KERNEL_TOL = 1e-5


def rel_err(out, ref):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    assert np.isfinite(out).all(), "output has NaN/inf"
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def quantize(x, kind, head_scale=None):
    """A contiguous or paged cache array x [N, Hkv, S, D] -> (values, scale) in `kind`."""
    if kind == "int8":
        return quantize_int8(x)
    scale = jnp.asarray(head_scale if head_scale is not None else np.linspace(0.5, 2.0, x.shape[1]), jnp.float32)
    return quantize_fp8(x, scale, head_axis=1), scale


def case(seed, B, T, Hq, Hkv, S, D, pos_start):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, Hq, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), jnp.float32)
    pos = jnp.asarray(np.asarray(pos_start)[:, None] + np.arange(T)[None, :], jnp.int32)
    return q, k, v, pos, pos[:, -1] + 1


def paginate(x, page_size, seed):
    """[B, Hkv, S, ...] -> a shuffled pool [P, Hkv, page_size, ...] (7 spare pages) and tables."""
    B, Hkv, S = x.shape[:3]
    n = S // page_size
    order = np.random.default_rng(seed).permutation(B * n + 7)[: B * n].reshape(B, n)
    pool = jnp.zeros((B * n + 7, Hkv, page_size) + x.shape[3:], x.dtype)
    pages = x.reshape(B, Hkv, n, page_size, *x.shape[3:]).swapaxes(1, 2).reshape(B * n, Hkv, page_size,
                                                                                *x.shape[3:])
    return pool.at[order.reshape(-1)].set(pages), jnp.asarray(order, jnp.int32)


# ---- the formats ----------------------------------------------------------------------------------

def test_int8_error_is_at_most_half_a_step_of_the_row():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3, 50, 64)) * 3, jnp.float32)
    x = x.at[0, 0, 0].set(0.0)  # an all-zero row: scale 0, values 0, no NaN
    q, s = quantize_int8(x)
    assert q.dtype == jnp.int8 and s.shape == x.shape[:-1]
    err = np.abs(np.asarray(dequantize(q, s)) - np.asarray(x))
    bound = np.abs(np.asarray(x)).max(-1, keepdims=True) / 254
    assert (err <= bound * (1 + 1e-6) + 1e-12).all()
    assert float(jnp.abs(dequantize(q, s)[0, 0, 0]).max()) == 0.0
    assert int(jnp.abs(q).max()) == 127


def test_fp8_error_relative_above_the_subnormals_and_saturates():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 40, 64)) * np.exp(rng.uniform(-6, 4, (2, 4, 40, 1)))
    x = jnp.asarray(x, jnp.float32)
    scale = jnp.asarray([0.25, 1.0, 2.0, 8.0], jnp.float32)
    q = quantize_fp8(x, scale, head_axis=1)
    assert q.dtype == jnp.float8_e4m3fn
    x_, xq = np.asarray(x), np.asarray(dequantize(q, scale))
    s = np.asarray(scale)[None, :, None, None]
    normal = np.abs(x_) / s >= 2.0 ** -6
    inside = np.abs(x_) / s <= FP8_MAX
    err = np.abs(xq - x_)
    assert (err[normal & inside] <= 2.0 ** -4 * np.abs(x_)[normal & inside] * (1 + 1e-6)).all()
    assert (err[~normal] <= 2.0 ** -10 * np.broadcast_to(s, x_.shape)[~normal] * (1 + 1e-6)).all()
    np.testing.assert_array_equal(np.abs(xq[~inside]), np.broadcast_to(s * FP8_MAX, x_.shape)[~inside])


def _run_ptx(asm: str, word: np.ndarray) -> list[np.ndarray]:
    """Execute the few PTX instructions of a packed widening on uint32 words in numpy: `$2` is the
    input register, `$0` and `$1` the outputs (as Triton's inline asm numbers them)."""
    regs = {"$2": word.astype(np.uint64)}

    def val(x):
        return regs[x] if x in regs else np.uint64(int(x, 0))

    def lanes(x):
        return x.astype(np.uint32).view(np.uint16).view(np.float16).astype(np.float32)

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        a = [val(x) for x in src]
        if op == "mov.b32":
            out = a[0] + 0 * regs["$2"]
        elif op == "xor.b32":
            out = a[0] ^ a[1]
        elif op == "and.b32":
            out = a[0] & a[1]
        elif op == "shl.b32":
            out = (a[0] << a[1]) & np.uint64(0xFFFFFFFF)
        elif op == "prmt.b32":  # bytes of {b, a}; selector nibble bit 3 replicates the byte's sign
            pool = a[0] | (a[1] << np.uint64(32))
            out = np.zeros_like(pool)
            for i in range(4):
                nib = (int(a[2]) >> (4 * i)) & 0xF
                byte = (pool >> np.uint64(8 * (nib & 7))) & np.uint64(0xFF)
                if nib & 8:
                    byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
                out = out | (byte << np.uint64(8 * i))
        elif op == "sub.f16x2":
            diff = (lanes(a[0]) - lanes(a[1])).astype(np.float16)
            out = diff.view(np.uint16).view(np.uint32).astype(np.uint64)
        else:
            raise AssertionError(f"unknown instruction {op}")
        regs[d] = out
    return [lanes(regs["$0"]), lanes(regs["$1"])]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_packed_widening_ptx_gives_every_value(kind):
    """The kernels' packed int8 / e4m3 -> float16 conversions (kv_blocks' inline PTX), run
    instruction by instruction in numpy over all 256 byte values in each of the four positions
    of a word: each lane is the value times `widened_unit` (e4m3's NaN codes aside)."""
    from pallas_kernels.attention import kv_blocks

    dtype = jnp.int8 if kind == "int8" else jnp.float8_e4m3fn
    asm = kv_blocks._by_asm(dtype, jnp.float16, interpret=False)
    unit = kv_blocks.widened_unit(dtype, jnp.float16, interpret=False)
    codes = np.arange(256, dtype=np.uint8)
    for shift in range(4):
        word_bytes = np.roll(np.stack([codes, codes[::-1], codes ^ 0x80, codes ^ 0x7F], -1), shift, axis=-1)
        lo, hi = _run_ptx(asm, np.ascontiguousarray(word_bytes).view("<u4")[:, 0])
        got = np.concatenate([lo.reshape(-1, 2), hi.reshape(-1, 2)], axis=-1)  # $0: bytes 0, 1; $1: 2, 3
        want = np.asarray(jnp.asarray(word_bytes.view(np.int8 if kind == "int8" else jnp.float8_e4m3fn))
                          .astype(jnp.float32)) * unit
        real = ~np.isnan(want)
        np.testing.assert_array_equal(got[real], want[real])


# ---- attention: reference and kernels -------------------------------------------------------------

@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("T", [1, 4, 40])
def test_reference_on_quantized_kv_against_float(kind, T):
    q, k, v, pos, kv_len = case(2, B=2, T=T, Hq=6, Hkv=2, S=256, D=64, pos_start=[180, 60])
    ref = attention_reference(q, k, v, pos, kv_len, scale=0.125)
    (kq, ks), (vq, vs) = quantize(k, kind), quantize(v, kind)
    out = attention_reference(q, kq, vq, pos, kv_len, scale=0.125, k_scale=ks, v_scale=vs)
    err = rel_err(out, ref)
    print(f"{kind} T={T}: relative error against the float32 cache {err:.2e}")
    assert err < QUANT_TOL[kind]
    # ... and it is the float reference on the dequantized cache.
    deq = attention_reference(q, dequantize(kq, ks), dequantize(vq, vs), pos, kv_len, scale=0.125)
    assert rel_err(out, deq) < 1e-6


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("T,splits,window", [(1, None, None), (1, 1, None), (1, 3, 50), (3, None, None)])
def test_decode_kernel_on_quantized_kv(kind, T, splits, window):
    q, k, v, pos, kv_len = case(3, B=2, T=T, Hq=4, Hkv=2, S=384, D=64, pos_start=[300, 17])
    (kq, ks), (vq, vs) = quantize(k, kind), quantize(v, kind)
    ref = attention_reference(q, kq, vq, pos, kv_len, scale=0.125, window=window, k_scale=ks, v_scale=vs)
    out = decode_attention(q, kq, vq, pos, kv_len, scale=0.125, window=window, num_splits=splits, interpret=True,
                           k_scale=ks, v_scale=vs)
    assert rel_err(out, ref) < KERNEL_TOL


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_decode_kernel_default_tiles_at_head_dim_128(kind):
    """llama-8b's group of 4 query heads per KV head at head dim 128, one token: the default
    tiles of a contiguous cache take 64-key blocks and merge up to 32 splits in the kernel (the
    H100's batch-1 launch); a paged cache's take 3 stages, and 128-key blocks and 16 splits
    except fp8 at batch 1; the output is the reference's on the same cache, contiguous and
    paged."""
    from pallas_kernels.attention import decode_tiling as decode_mod

    S, D = 2048, 128
    assert decode_mod.default_tiles(D, kind) == dict(block_k=64, num_warps=4, num_stages=4)
    paged = {n: decode_mod.default_tiles(D, kind, paged_programs=n) for n in (8, 16)}
    assert paged[8] == dict(block_k=64 if kind == "fp8" else 128, num_warps=4, num_stages=3)
    assert paged[16] == dict(block_k=128, num_warps=4, num_stages=3)
    assert decode_mod.default_tiles(D)["block_k"] == 128
    limit = decode_mod.merged_split_limit(True, 4, D, 64)
    assert limit == 32 and decode_mod.merged_split_limit(False, 4, D, 64) == 16
    assert decode_mod.merged_split_limit(True, 4, D, 128) == 16
    assert decode_mod.stages_for(8, D, True, 8, paged=True) == 3 and decode_mod.stages_for(8, D, True, 8) == 4
    assert decode_mod.merges_in_kernel(1, 2, S, 64, limit)
    assert decode_mod.default_num_splits(1, 2, S, 64, merged_in_kernel=True, quantized=True, limit=limit) == 32
    q, k, v, pos, kv_len = case(9, B=1, T=1, Hq=8, Hkv=2, S=S, D=D, pos_start=[S - 5])
    (kq, ks), (vq, vs) = quantize(k, kind), quantize(v, kind)
    ref = attention_reference(q, kq, vq, pos, kv_len, scale=D ** -0.5, k_scale=ks, v_scale=vs)
    out = decode_attention(q, kq, vq, pos, kv_len, scale=D ** -0.5, interpret=True, k_scale=ks, v_scale=vs)
    assert rel_err(out, ref) < KERNEL_TOL
    (kp, table), (vp, _) = paginate(kq, 16, 3), paginate(vq, 16, 3)
    scales = [paginate(x, 16, 3)[0] for x in (ks, vs)] if kind == "int8" else [ks, vs]
    out = paged_decode_attention(q, kp, vp, table, pos, kv_len, scale=D ** -0.5, interpret=True,
                                 k_scale=scales[0], v_scale=scales[1])
    assert rel_err(out, ref) < KERNEL_TOL


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("window", [None, 70])
def test_prefill_kernel_on_quantized_kv(kind, window):
    q, k, v, pos, kv_len = case(4, B=2, T=40, Hq=4, Hkv=2, S=256, D=64, pos_start=[150, 0])
    (kq, ks), (vq, vs) = quantize(k, kind), quantize(v, kind)
    ref = attention_reference(q, kq, vq, pos, kv_len, scale=0.125, window=window, k_scale=ks, v_scale=vs)
    out = prefill_attention(q, kq, vq, pos, kv_len, scale=0.125, window=window, interpret=True, k_scale=ks,
                            v_scale=vs)
    assert rel_err(out, ref) < KERNEL_TOL


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("T,page_size,block_k", [(1, 16, 32), (1, 64, None), (2, 32, None), (24, 16, 32)])
def test_paged_kernels_on_quantized_kv(kind, T, page_size, block_k):
    q, k, v, pos, kv_len = case(5, B=2, T=T, Hq=4, Hkv=2, S=256, D=64, pos_start=[200, 31])
    (kq, ks), (vq, vs) = quantize(k, kind), quantize(v, kind)
    k_pool, tables = paginate(kq, page_size, 7)
    v_pool, _ = paginate(vq, page_size, 7)
    if kind == "int8":
        ks, _ = paginate(ks, page_size, 7)
        vs, _ = paginate(vs, page_size, 7)
    ref = attention_reference(q, kq, vq, pos, kv_len, scale=0.125, k_scale=quantize(k, kind)[1],
                              v_scale=quantize(v, kind)[1])
    paged_ref = paged_attention_reference(q, k_pool, v_pool, tables, pos, kv_len, scale=0.125, k_scale=ks,
                                          v_scale=vs)
    assert rel_err(paged_ref, ref) < 1e-6
    kernel = paged_prefill_attention if T > 8 else paged_decode_attention
    out = kernel(q, k_pool, v_pool, tables, pos, kv_len, scale=0.125, block_k=block_k, interpret=True, k_scale=ks,
                 v_scale=vs)
    assert rel_err(out, ref) < KERNEL_TOL


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("name,T,splits", [("decode", 1, None), ("decode", 1, 2), ("decode", 2, None),
                                           ("prefill", 32, None), ("paged_decode", 1, None),
                                           ("paged_prefill", 32, None)])
def test_quantized_kernels_lower_to_triton_for_h100(kind, name, T, splits):
    """Each kernel on a quantized cache lowers for sm_90 (int8 and e4m3 loads and casts) without a GPU."""
    import warnings
    from unittest import mock

    from jax._src.pallas.triton import gpu_info

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    S = jax.ShapeDtypeStruct
    dt = jnp.int8 if kind == "int8" else jnp.float8_e4m3fn
    paged = name.startswith("paged")
    kv = S((40, 3, 16, 64), dt) if paged else S((1, 3, 640, 64), dt)
    scale = S(kv.shape[:-1], jnp.float32) if kind == "int8" else S((3,), jnp.float32)
    fn = {"decode": decode_attention, "prefill": prefill_attention, "paged_decode": paged_decode_attention,
          "paged_prefill": paged_prefill_attention}[name]
    args = (S((1, T, 9, 64), jnp.bfloat16), kv, kv) + ((S((1, 40), jnp.int32),) if paged else ())
    args += (S((1, T), jnp.int32), S((1,), jnp.int32))
    kw = dict(num_splits=splits) if splits else {}
    with warnings.catch_warnings(), mock.patch.object(gpu_info, "get_gpu_info", lambda: h100):
        warnings.simplefilter("ignore")
        lowered = fn.trace(*args, scale=0.125, k_scale=scale, v_scale=scale, **kw).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


def test_scale_errors_name_the_argument():
    q, k, v, pos, kv_len = case(6, B=1, T=1, Hq=2, Hkv=1, S=32, D=16, pos_start=[5])
    kq, ks = quantize_int8(k)
    with pytest.raises(ValueError, match="int8 k cache needs its scale"):
        attention_reference(q, kq, quantize_int8(v)[0], pos, kv_len, scale=1.0)
    with pytest.raises(ValueError, match="int8 v scale must have shape"):
        attention_reference(q, kq, quantize_int8(v)[0], pos, kv_len, scale=1.0, k_scale=ks, v_scale=ks[0])
    with pytest.raises(ValueError, match="scale given for a float32 cache"):
        attention_reference(q, k, v, pos, kv_len, scale=1.0, k_scale=ks, v_scale=ks)
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        check_kv_dtype("int4")


@pytest.mark.parametrize("S", [32768, 131072])
def test_long_context_decode_int8(S):
    """One token at the last of S positions (a real 32k / 128k cache), int8 against float32, and
    the decode kernel against the reference on the same int8 cache."""
    q, k, v, pos, kv_len = case(8, B=1, T=1, Hq=2, Hkv=1, S=S, D=64, pos_start=[S - 1])
    # Keys that matter far back: a spike at position 3 the query attends to strongly.
    k = k.at[0, 0, 3].set(q[0, 0, 0] * 2.0)
    ref = attention_reference(q, k, v, pos, kv_len, scale=0.125)
    (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
    out = attention_reference(q, kq, vq, pos, kv_len, scale=0.125, k_scale=ks, v_scale=vs)
    assert rel_err(out, ref) < QUANT_TOL["int8"]
    kern = decode_attention(q, kq, vq, pos, kv_len, scale=0.125, interpret=True, k_scale=ks, v_scale=vs,
                            block_k=4096 if S > 32768 else 1024, num_splits=4)
    assert rel_err(kern, out) < KERNEL_TOL


@pytest.mark.parametrize("S,T", [(32768, 1024), (131072, 256)])
def test_long_prefill_reference_needs_no_full_score_matrix(S, T):
    """The last T positions of a 32k / 128k-position prompt: the reference attends in query chunks
    ([chunk, S] scores, never [T, S] at once) and gives what one pass over all queries gives."""
    from pallas_kernels.attention import reference

    assert reference.query_chunk(T, S) * S <= 1 << 22 and reference.query_chunk(T, S) < T
    q, k, v, pos, kv_len = case(9, B=1, T=T, Hq=2, Hkv=1, S=S, D=32, pos_start=[S - T])
    (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
    out = attention_reference(q, kq, vq, pos, kv_len, scale=0.2, k_scale=ks, v_scale=vs)
    rows = np.r_[0:4, T - 4:T]
    whole = reference._attend(q[:, rows], dequantize(kq, ks), dequantize(vq, vs), pos[:, rows], kv_len, 0.2, None)
    assert rel_err(out[:, rows], whole) < 1e-6
    assert rel_err(out, attention_reference(q, k, v, pos, kv_len, scale=0.2)) < QUANT_TOL["int8"]


# ---- the caches --------------------------------------------------------------------------------------

def _cache(cfg, paged, kv_dtype, n_slots=3, max_len=64):
    if not paged:
        return init_cache(cfg, n_slots, max_len, kv_dtype=kv_dtype)
    cache = init_paged_cache(cfg, n_slots, n_pages=n_slots * max_len // 8, page_size=8, max_len=max_len,
                             kv_dtype=kv_dtype)
    pages = np.random.default_rng(0).permutation(cache.n_pages).reshape(n_slots, -1).astype(np.int32)
    return set_block_tables(cache, jnp.arange(n_slots), jnp.asarray(pages))


def _run(cfg, params, cache, prompts, n_steps, feed=None):
    """Prefill `prompts` into slots 0.., then n_steps decode steps fed the greedy tokens (or those
    of `feed`, another run's logits, so that two runs see the same tokens); -> (logits per step,
    cache)."""
    tokens, lengths = steps.pad_prompts(prompts)
    logits, cache = steps.prefill(cfg, params, cache, jnp.asarray(tokens), jnp.asarray(lengths),
                                   jnp.arange(len(prompts), dtype=jnp.int32))
    out = [logits]
    active = jnp.arange(cache.n_slots) < len(prompts)
    for i in range(n_steps):
        prev = (feed or out)[i]
        ids = jnp.zeros(cache.n_slots, jnp.int32).at[: len(prompts)].set(jnp.argmax(prev, -1)[: len(prompts)])
        logits, cache = steps.decode_step(cfg, params, cache, ids, active)
        out.append(logits[: len(prompts)])
    return out, cache


PROMPTS = [[7, 3, 99, 41, 5, 18, 250, 6, 77, 12, 9], [300, 2, 2, 8, 501, 44]]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_cache_stores_quantized_attends_close_to_float_and_snapshots_exactly(tiny, paged, kv_dtype):
    cfg, params = tiny
    cache = _cache(cfg, paged, kv_dtype)
    assert cache.quantized and cache.kv_dtype == kv_dtype and cache.dtype == jnp.float32
    assert cache.storage_dtype == {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[kv_dtype]
    ref, ref_cache = _run(cfg, params, _cache(cfg, paged, None), PROMPTS, 3)
    got, cache = _run(cfg, params, cache, PROMPTS, 3, feed=ref)
    errs = [rel_err(a, b) for a, b in zip(got, ref)]
    print(f"{kv_dtype} {'paged' if paged else 'contiguous'}: logits' relative error per step {np.round(errs, 4)}")
    # Two layers of attention error reach the logits (measured int8 1.1-1.2%, fp8 4-6%).
    assert max(errs) < QUANT_TOL[kv_dtype] * 1.5
    # What is stored is the float cache's K quantized when written (layer 0: the same inputs;
    # later layers' keys differ by the earlier layers' quantized attention, compared loosely).
    k, _ = cache.row(0)
    k_ref = np.asarray(ref_cache.row(0)[0])
    n = len(PROMPTS[0]) + 3
    ks, _ = cache.row_scales(0)
    if kv_dtype == "int8":
        deq = np.asarray(k[:, :, :n], np.float32) * np.asarray(ks[:, :, :n])[..., None]
        step = np.abs(k_ref[0, :, :n]).max(-1, keepdims=True) / 127
        assert (np.abs(deq[0] - k_ref[0, :, :n]) <= step / 2 * (1 + 1e-5) + 1e-7).all()
        assert np.abs(deq - k_ref[:, :, :n]).max() < 0.05 * np.abs(k_ref[:, :, :n]).max()
    else:
        assert ks is None
    # snapshot / restore of the quantized slot: exact, scales included, and it continues alike.
    snap = snapshot(cache, 0)
    assert snap.k.dtype == cache.storage_dtype and (snap.k_scale is not None) == (kv_dtype == "int8")
    moved = restore(cache, 2, snap)
    again = snapshot(moved, 2)
    n = int(snap.length)
    for a, b in ((again.k, snap.k), (again.v, snap.v)) + (((again.k_scale, snap.k_scale),) if ks is not None else ()):
        np.testing.assert_array_equal(np.asarray(a[:, :, :n], np.float32), np.asarray(b[:, :, :n], np.float32))
    a, _ = _greedy(cfg, params, cache, 0, 4)
    b, _ = _greedy(cfg, params, moved, 2, 4)
    assert a == b


def _greedy(cfg, params, cache, slot, n):
    out, tok = [], 65
    for _ in range(n):
        logits, cache = steps.decode_step(cfg, params, cache, jnp.zeros(cache.n_slots, jnp.int32).at[slot].set(tok),
                                           jnp.zeros(cache.n_slots, bool).at[slot].set(True))
        tok = int(jnp.argmax(logits[slot]))
        out.append(tok)
    return out, cache


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("fused", [True, False], ids=["rope_attention", "rope_append"])
def test_quantized_decode_step_through_the_kernels(tmp_path, monkeypatch, kv_dtype, fused):
    """A GPU plan's one-token step over a quantized cache rotates, quantizes and appends in one
    kernel that also attends (rope_attention), or in kv_append's kernel before the attention
    (rope_append, for batches past Tuning.fused_rope_max_rows): run in interpret mode, the same
    logits and cache as the plan that rotates in XLA and quantizes in KVCache.write (attention
    "xla"), up to an entry landing one quantum away (the two sum the QKV product in another
    order)."""
    import dataclasses

    import pallas_kernels.attention as attention
    import pallas_kernels.kv_append as kv_append
    from pallas_kernels.attention import AttentionKernel
    from pallas_kernels.quant_matmul import TUNING
    from rjax.cli.bench import load_for_bench
    from rjax.loading.synth import write_synthetic
    from rjax.math.layout import fuse_projections
    from rjax.math.model import forward
    from rjax.math.plan import Attention, Norm, plan_for

    path = write_synthetic(tmp_path / "m.gguf", "smollm2-135m", "q4_1", n_layers=2, vocab_size=512,
                           tokenizer_from="builtin")
    cfg, params, _ = load_for_bench(path, progress=False)
    params = fuse_projections(params)  # as on a GPU: the kernels take the fused QKV product
    tuning = TUNING.replace(fused_rope_max_rows=256 if fused else 0, quantized_attention_out=False)
    plan = plan_for(cfg, params, 2, 1, jnp.float32, gpu=True, implementation="interpret", tuning=tuning)
    assert {lp.attention for lp in plan.layers} == {"rope_attention" if fused else "rope_append"}

    calls = []
    if fused:
        kernel = attention.rope_attention
        monkeypatch.setattr("rjax.math.cache.rope_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    else:
        kernel = kv_append.rope_append_kernel
        monkeypatch.setattr(kv_append, "rope_append_kernel", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    in_xla = dataclasses.replace(plan, layers=tuple(
        dataclasses.replace(lp, attention=Attention.XLA, out_norm=Norm.NORM, attend=AttentionKernel.DECODE)
        for lp in plan.layers))
    tokens, lengths = steps.pad_prompts([[5, 6, 7, 8, 9], [11, 12]])
    cache = init_cache(cfg, 2, 64, kv_dtype=kv_dtype)
    _, cache = steps.prefill(cfg, params, cache, jnp.asarray(tokens), jnp.asarray(lengths))
    step, pos = jnp.asarray([[3], [4]], jnp.int32), jnp.asarray(lengths)[:, None]
    got_logits, got = forward(cfg, params, cache, step, pos, plan=plan)
    assert len(calls) == cfg.n_layers, "the kernel did not run"
    want_logits, want = forward(cfg, params, cache, step, pos, plan=in_xla)
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), rtol=1e-4, atol=1e-4)
    for layer in range(cfg.n_layers):
        for g, w, gs, ws in ((got.k[layer], want.k[layer], got.k_scale[layer], want.k_scale[layer]),
                             (got.v[layer], want.v[layer], got.v_scale[layer], want.v_scale[layer])):
            x, y = np.asarray(dequantize(g, gs)), np.asarray(dequantize(w, ws))
            quantum = np.abs(y).max(-1, keepdims=True) / 127 if kv_dtype == "int8" else np.abs(y) / 8 + 2 ** -9
            assert np.all(np.abs(x - y) <= quantum * 1.001)


# ---- the real models (slow) ----------------------------------------------------------------------

PROMPTS_TEXT = ["Name three primes and say why each is prime.",
                "Write a short story about a lighthouse keeper who finds a message in a bottle.",
                "Explain what a hash table is to a ten-year-old.",
                "List the planets of the solar system in order, with one fact about each."]
GREEN_TOKENS = 64
# A near-tie: the float cache's two best logits within 0.5, i.e. the two tokens' probabilities
# within a factor e^0.5 = 1.65 of each other. int8's largest logit moves per step are 0.4 (median;
# smollm2) to 0.9 (gemma3), printed by the test, so such ties can flip; a divergence at a wider
# margin would be a real error.
NEAR_TIE = 0.5


def _greedy_float(cfg, params, prompts):
    """GREEN_TOKENS greedy tokens per prompt from the float32 cache (prefill, then decode steps),
    and the logits [B, GREEN_TOKENS, V] that chose them."""
    tokens, lengths = steps.pad_prompts(prompts)
    cache = init_cache(cfg, len(prompts), 256, jnp.float32)
    logits, cache = steps.prefill(cfg, params, cache, jnp.asarray(tokens), jnp.asarray(lengths))
    out, ids = [logits], []
    for _ in range(GREEN_TOKENS - 1):
        ids.append(jnp.argmax(logits, -1).astype(jnp.int32))
        logits, cache = steps.decode_step(cfg, params, cache, ids[-1])
        out.append(logits)
    ids.append(jnp.argmax(logits, -1).astype(jnp.int32))
    return np.asarray(jnp.stack(ids, 1)), jnp.stack(out, 1)


def _forced_logits(cfg, params, prompts, generated, kv_dtype):
    """Logits [B, GREEN_TOKENS, V] predicting each generated token, from one forward pass over
    prompt + generated tokens (teacher forcing): each position attends to the cache's keys and
    values of the positions up to it, written (and, for int8, quantized) before it reads them,
    exactly what a decode step at that position sees."""
    from rjax.math.model import hidden_states, logits_from_hidden

    seqs = [list(p) + [int(t) for t in g] for p, g in zip(prompts, generated)]
    tokens, lengths = steps.pad_prompts(seqs)
    T = tokens.shape[1]
    pos = np.where(np.arange(T)[None, :] < np.asarray(lengths)[:, None], np.arange(T)[None, :], -1)
    # Position len(p) - 1 + t predicts generated token t: only those rows go through the LM head.
    rows = np.stack([np.arange(GREEN_TOKENS) + len(p) - 1 for p in prompts])

    @jax.jit
    def run(params, cache, tokens, pos, rows):
        h, _ = hidden_states(cfg, params, cache, tokens, pos, None, jnp.float32)
        return logits_from_hidden(params, jnp.take_along_axis(h, rows[..., None], axis=1))

    cache = init_cache(cfg, len(seqs), T, jnp.float32, kv_dtype)
    return run(params, cache, jnp.asarray(tokens), jnp.asarray(pos, jnp.int32), jnp.asarray(rows, jnp.int32))


@jax.jit
def _top2(logits):
    top = jax.lax.top_k(logits, 2)[0]
    return jnp.argmax(logits, -1), top[..., 0] - top[..., 1]


def _dense(params):
    """Every quantized weight dequantized once to float32: the values the CPU path dequantizes at
    every step (the KV cache is what is compared), without paying for it at every step."""
    from gguf_blocks.qtensor import QTensor
    from gguf_blocks.reference import dequantize

    return jax.tree.map(lambda w: jax.jit(dequantize)(w) if isinstance(w, QTensor) else w, params,
                        is_leaf=lambda w: isinstance(w, QTensor))


def _compare_greedy(model, kv_dtype):
    cfg, params, tok = model.config, _dense(model.params), model.tokenizer
    # a base model (gemma3-270m has no chat template) continues the raw text
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) if tok.chat_template is not None else tok.encode(p)
               for p in PROMPTS_TEXT]
    ref_tokens, ref_logits = _greedy_float(cfg, params, prompts)
    got_logits = _forced_logits(cfg, params, prompts, ref_tokens, kv_dtype)
    margin = np.asarray(_top2(ref_logits)[1])
    got_tokens = np.asarray(_top2(got_logits)[0])
    delta = np.asarray(jnp.max(jnp.abs(got_logits - ref_logits), -1))
    divergences = [(b, t, round(float(margin[b, t]), 4)) for b in range(len(prompts)) for t in range(GREEN_TOKENS)
                   if got_tokens[b, t] != ref_tokens[b, t]]
    print(f"\n{model.name} {kv_dtype}: {GREEN_TOKENS} greedy tokens x {len(prompts)} prompts; max |Δ logit| per "
          f"step: median {np.median(delta):.3f}, max {delta.max():.3f}; divergences (prompt, step, float cache's "
          f"top-2 margin): {divergences or 'none'}")
    return divergences


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_int8_greedy_continuations_equal_the_float_cache_up_to_near_ties(name, request):
    """Every step of 64-token greedy continuations of four chat prompts, fed the float32
    cache's tokens: the int8 cache's argmax is the float cache's, except where the float
    cache's two best logits are within NEAR_TIE (every divergence is printed with its margin).
    (Free-running, a divergence at a near-tie changes the rest of the text, so the comparison
    is made on the float cache's tokens.)"""
    import rjax

    path = request.getfixturevalue(f"{name}_path")
    model = rjax.load(path, progress=False)
    divergences = _compare_greedy(model, "int8")
    assert all(m < NEAR_TIE for _, _, m in divergences), divergences


@pytest.mark.slow
def test_int8_perplexity_within_half_a_percent_of_the_float_cache(smollm2):
    import rjax

    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "data" / "perplexity.txt").read_text(encoding="utf-8")
    kw = dict(ctx=128, stride=64, batch=4, progress=False)
    ref = rjax.perplexity(smollm2, text, **kw)
    out = rjax.perplexity(smollm2, text, kv_dtype="int8", **kw)
    print(f"\nperplexity ({ref.n_scored} tokens scored): float32 cache {ref.ppl:.4f}, int8 {out.ppl:.4f} "
          f"(ratio {out.ppl / ref.ppl:.5f})")
    assert abs(out.ppl / ref.ppl - 1) < 0.005


# ---- serving and the memory planner ---------------------------------------------------------------

def test_serving_engine_on_an_int8_cache_equals_each_prompt_alone(tiny):
    """The paged engine (prefix cache on: the second prompt shares the first's full pages, whose
    int8 scales travel with them) decodes each prompt as a contiguous int8 cache does alone."""
    from rjax.runtime.serving import ServingConfig, ServingEngine

    cfg, params = tiny
    shared = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155, 166, 177]
    prompts = [shared + [3, 4], shared + [5], [9, 8, 7]]
    config = ServingConfig(n_slots=4, max_len=64, page_size=8, steps_per_dispatch=4, prefill_buckets=(1, 2),
                           kv_dtype="int8")
    eng = ServingEngine(cfg, params, config)
    assert eng.cache.kv_dtype == "int8" and eng.cache.dtype == jnp.float32
    ids = [eng.submit(p, max_new_tokens=6) for p in prompts[:1]]
    done = {}
    for e in eng.run():
        if e.finished:
            done[e.request_id] = e.completion.tokens
        if len(done) == 1 and len(ids) == 1:
            ids += [eng.submit(p, max_new_tokens=6) for p in prompts[1:]]
    assert eng.prefix_stats.pages_reused >= 2
    for rid, p in zip(ids, prompts):
        cache = init_cache(cfg, 1, 64, kv_dtype="int8")
        out, _ = _run(cfg, params, cache, [p], 5)
        assert done[rid] == [int(jnp.argmax(x[0])) for x in out]


def test_memory_planner_counts_the_smaller_cache(tiny):
    from rjax.engine.memory import kv_bytes_per_position, plan_memory, workspace_bytes
    from rjax.runtime.serving import ServingConfig

    cfg, _ = tiny
    L, H, D = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    assert kv_bytes_per_position(cfg, "bfloat16") == 2 * L * H * D * 2
    assert kv_bytes_per_position(cfg, "int8") == 2 * L * H * (D + 4)   # values + a float32 scale per token and head
    assert kv_bytes_per_position(cfg, "fp8") == 2 * L * H * D
    # The same memory for pages holds about twice the pages of a bf16 cache.
    kw = dict(max_len=2048, page_size=16, n_slots=8, prefill_tokens=64, prefill_prompts=1, reserve_bytes=0)
    pages = {}
    for kv in ("bfloat16", "int8", "fp8"):
        ws = workspace_bytes(cfg, n_slots=8, max_len=2048, prefill_tokens=64, prefill_prompts=1, dtype=kv)
        pages[kv] = plan_memory(cfg, dtype=kv, available=ws + (12 << 20), **kw).n_pages
    assert pages["int8"] > 1.7 * pages["bfloat16"] and pages["fp8"] >= pages["int8"], pages
    # What the engine allocates is what the planner counted (scales included).
    config = ServingConfig(n_slots=2, max_len=64, page_size=8, kv_dtype="int8")
    from rjax.math.paged_cache import init_paged_cache

    cache = init_paged_cache(cfg, 2, config.pool_pages, 8, 64, jnp.float32, kv_dtype="int8")
    leaves = (cache.k, cache.v, cache.k_scale, cache.v_scale)
    assert sum(x.size * x.dtype.itemsize for x in leaves) == config.pool_pages * 8 * kv_bytes_per_position(cfg, "int8")
    with pytest.raises(ValueError, match="ServingConfig.kv_dtype must be"):
        ServingConfig(kv_dtype="int4")


def test_cli_kv_dtype_generates_as_the_python_api(tiny_path, capsys):
    """`rjax generate --kv-dtype int8 --json` gives what rjax.generate(kv_dtype="int8") gives;
    an unknown KV dtype is refused by the parser, and by the Python API naming the parameter."""
    import json

    import rjax
    from rjax.cli.main import main

    assert main(["generate", "-m", str(tiny_path), "--raw", "--json", "--max-new-tokens", "6", "--kv-dtype", "int8",
                 "hello"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = rjax.load(tiny_path, progress=False)
    ref = rjax.generate(model, "hello", raw=True, max_new_tokens=6, kv_dtype="int8")
    assert out["tokens"] == ref.tokens
    with pytest.raises(SystemExit):
        main(["generate", "-m", str(tiny_path), "--kv-dtype", "int4", "hello"])
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        rjax.generate(model, "hello", raw=True, max_new_tokens=2, kv_dtype="int4")


# ---- on the GPU at model-sized shapes, against the reference on the same quantized cache on the same GPU ----

BF16_TOL = 1e-2


def make_gpu(seed, B, T, Hq, Hkv, S, D):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, T, Hq, D), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (B, Hkv, S, D), jnp.float32)
    v = jax.random.normal(kv, (B, Hkv, S, D), jnp.float32)
    return q, k, v


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("D,window", [(128, None), (128, 1000), (256, None)])
def test_decode_on_quantized_cache_matches_reference(kind, T, D, window):
    B, Hq, Hkv, S = 8, 32, 8, 4096
    q, k, v = make_gpu(T + D, B, T, Hq, Hkv, S, D)
    lens = np.array([4096, 4000, 3001, 2048, 1500, 700, 33, 0])
    pos = np.maximum(lens[:, None] - T + np.arange(T)[None], -1)
    pos[-1] = -1
    pos, kv_len = jnp.asarray(pos, jnp.int32), jnp.asarray(lens, jnp.int32)
    (kq, ks), (vq, vs) = quantize(k, kind), quantize(v, kind)
    ref = attention_reference(q, kq, vq, pos, kv_len, scale=D ** -0.5, window=window, k_scale=ks, v_scale=vs)
    for splits in (None, 1, 16):
        out = decode_attention(q, kq, vq, pos, kv_len, scale=D ** -0.5, window=window, num_splits=splits,
                               k_scale=ks, v_scale=vs)
        assert rel_err(out, ref) < BF16_TOL
        assert not np.any(np.asarray(out[-1], np.float32))
    flt = attention_reference(q, k, v, pos, kv_len, scale=D ** -0.5, window=window)
    assert rel_err(out, flt) < QUANT_TOL[kind]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_prefill_on_quantized_cache_matches_reference(kind):
    B, T, Hq, Hkv, S, D = 3, 1024, 32, 8, 1536, 128
    q, k, v = make_gpu(9, B, T, Hq, Hkv, S, D)
    pos = np.stack([np.arange(T), np.where(np.arange(T) < 700, 500 + np.arange(T), -1), -np.ones(T, int)])
    pos, kv_len = jnp.asarray(pos, jnp.int32), jnp.asarray([1024, 1200, 0], jnp.int32)
    (kq, ks), (vq, vs) = quantize(k, kind), quantize(v, kind)
    ref = attention_reference(q, kq, vq, pos, kv_len, scale=D ** -0.5, k_scale=ks, v_scale=vs)
    out = prefill_attention(q, kq, vq, pos, kv_len, scale=D ** -0.5, k_scale=ks, v_scale=vs)
    assert rel_err(out, ref) < BF16_TOL
    # The entry point sends a quantized cache to this (Triton) kernel, not the Mosaic one.
    step = jax.jit(lambda *a: attention(*a, scale=D ** -0.5, k_scale=ks, v_scale=vs))
    assert rel_err(step(q, kq, vq, pos, kv_len), ref) < BF16_TOL
    assert "mosaic_gpu" not in step.lower(q, kq, vq, pos, kv_len).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_paged_on_quantized_cache_matches_reference(kind, page_size):
    B, Hq, Hkv, S, D = 4, 32, 8, 2048, 128
    q, k, v = make_gpu(page_size, B, 8, Hq, Hkv, S, D)
    (kq, ks), (vq, vs) = quantize(k, kind), quantize(v, kind)
    kp, table = paginate(kq, page_size, 3)
    vp, _ = paginate(vq, page_size, 3)
    pks, pvs = (paginate(ks, page_size, 3)[0], paginate(vs, page_size, 3)[0]) if kind == "int8" else (ks, vs)
    lens = np.array([2048, 1111, 520, 9])
    pos = jnp.maximum(jnp.asarray(lens[:, None] - 8 + np.arange(8)[None], jnp.int32), -1)
    kv_len = jnp.asarray(lens, jnp.int32)
    ref = attention_reference(q, kq, vq, pos, kv_len, scale=D ** -0.5, window=512, k_scale=ks, v_scale=vs)
    out = paged_decode_attention(q, kp, vp, table, pos, kv_len, scale=D ** -0.5, window=512, k_scale=pks,
                                 v_scale=pvs)
    assert rel_err(out, ref) < BF16_TOL
    one = paged_attention(q[:, -1:], kp, vp, table, pos[:, -1:], kv_len, scale=D ** -0.5, window=512,
                          k_scale=pks, v_scale=pvs)
    assert rel_err(one, ref[:, -1:]) < BF16_TOL
    qp, _, _ = make_gpu(7, B, 256, Hq, Hkv, 16, D)
    ppos = jnp.asarray(lens[:, None] - 256 + np.arange(256)[None], jnp.int32)
    ppos = jnp.where(ppos < 0, -1, ppos)
    ref = attention_reference(qp, kq, vq, ppos, kv_len, scale=D ** -0.5, k_scale=ks, v_scale=vs)
    out = paged_prefill_attention(qp, kp, vp, table, ppos, kv_len, scale=D ** -0.5, k_scale=pks, v_scale=pvs)
    assert rel_err(out, ref) < BF16_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_packed_widening_in_kernel_is_exact(kind):
    """Every int8 / e4m3 value through the kernels' packed conversion to float16 (byte permutes,
    then a paired subtraction or a shift and mask), in every position of a block, equals a
    plain cast times `widened_unit` (e4m3's two NaN codes aside, which no cache holds)."""
    from jax.experimental import pallas as pl

    from pallas_kernels.attention.kv_blocks import widen, widened_unit

    codes = np.random.default_rng(0).permutation(np.tile(np.arange(256, dtype=np.uint8), 64)).reshape(128, 128)
    x = jnp.asarray(codes.view(np.int8) if kind == "int8" else codes.view(jnp.float8_e4m3fn))

    def kernel(x_ref, o_ref):
        o_ref[...] = widen(x_ref[...], jnp.float16, False)

    out = np.asarray(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float16))(x))
    unit = widened_unit(x.dtype, jnp.float16, False)
    assert unit == (1.0 if kind == "int8" else 2.0 ** -8)
    want = np.asarray(x).astype(np.float32) * unit
    real = ~np.isnan(want)
    np.testing.assert_array_equal(out[real].astype(np.float32), want[real])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_one_token_merged_in_kernel_is_exact_every_call(kind):
    """16 splits merged by whichever program arrives last, 50 calls: equal bit for bit."""
    B, Hq, Hkv, S, D = 2, 9, 3, 2048, 64
    q, k, v = make_gpu(11, B, 1, Hq, Hkv, S, D)
    (kq, ks), (vq, vs) = quantize(k, kind), quantize(v, kind)
    lens = np.array([2048, 777])
    pos, kv_len = jnp.asarray(lens[:, None] - 1, jnp.int32), jnp.asarray(lens, jnp.int32)
    ref = attention_reference(q, kq, vq, pos, kv_len, scale=D ** -0.5, k_scale=ks, v_scale=vs)
    call = jax.jit(lambda q: decode_attention(q, kq, vq, pos, kv_len, scale=D ** -0.5, num_splits=16, k_scale=ks,
                                              v_scale=vs))
    outs = np.stack([np.asarray(call(q).astype(jnp.float32)) for _ in range(50)])
    assert rel_err(outs[0], ref) < BF16_TOL
    np.testing.assert_array_equal(outs, np.broadcast_to(outs[0], outs.shape))


@pytest.mark.gpu
def test_long_context_decode_int8_at_128k():
    """One token at position 131071 of an int8 cache (llama-8b's KV heads): kernel against the
    reference on the same cache, and against the float cache."""
    B, Hq, Hkv, S, D = 1, 32, 8, 131072, 128
    q, k, v = make_gpu(12, B, 1, Hq, Hkv, S, D)
    (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
    pos, kv_len = jnp.asarray([[S - 1]], jnp.int32), jnp.asarray([S], jnp.int32)
    ref = attention_reference(q, kq, vq, pos, kv_len, scale=D ** -0.5, k_scale=ks, v_scale=vs)
    out = decode_attention(q, kq, vq, pos, kv_len, scale=D ** -0.5, k_scale=ks, v_scale=vs)
    assert rel_err(out, ref) < BF16_TOL
    deq = attention_reference(q, dequantize(kq, ks), dequantize(vq, vs), pos, kv_len, scale=D ** -0.5)
    assert rel_err(ref, deq) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_engine_decodes_over_a_quantized_cache(tmp_path, kv_dtype):
    """A synthetic llama of the default model's shape (4 layers) on the GPU plan (bf16
    activations, for_backend's layout; a quantized cache is written by kv_append's kernel and read
    by the decode attention kernel), prefill
    and 16 decode steps fed the bf16 cache's greedy tokens: the quantized cache's logits within
    5% (int8) / 15% (fp8) of max |logit| of the bf16 cache's (on the CPU, 2 layers: 1.2% and 6%,
    test_kv_quant.py), and the same argmax wherever the bf16 cache's top-2 margin exceeds 0.5."""
    from rjax.engine import steps
    from rjax.loading.loaders import for_backend
    from rjax.loading.loaders.gguf import load_gguf
    from rjax.loading.synth import write_synthetic
    from rjax.math.cache import init_cache

    path = write_synthetic(tmp_path / "tiny.gguf", "smollm2-135m", "q8_0", seed=3, n_layers=4, vocab_size=512,
                           tokenizer_from="builtin")
    cfg, params, _ = load_gguf(path, progress=False)
    params = for_backend(params)
    prompts = [[7, 3, 99, 41, 5, 18, 250, 6, 77, 12, 9], [300, 2, 2, 8, 501, 44]]
    tokens, lengths = steps.pad_prompts(prompts)

    def run(kv, feed=None):
        cache = init_cache(cfg, 2, 128, jnp.bfloat16, kv)
        logits, cache = steps.prefill(cfg, params, cache, jnp.asarray(tokens), jnp.asarray(lengths))
        out = [np.asarray(logits, np.float32)]
        for i in range(16):
            ids = jnp.argmax(logits, -1).astype(jnp.int32) if feed is None else jnp.asarray(feed[:, i])
            logits, cache = steps.decode_step(cfg, params, cache, ids)
            out.append(np.asarray(logits, np.float32))
        return np.stack(out, 1)

    ref = run("bf16")
    got = run(kv_dtype, feed=ref.argmax(-1))
    rel = np.abs(got - ref).max(-1) / np.abs(ref).max(-1)
    top2 = np.sort(ref, -1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 0.5
    print(f"{kv_dtype}: logits max |Δ| / max |logit| {rel.max():.4f}; argmax agreement "
          f"{(got.argmax(-1) == ref.argmax(-1)).mean():.3f}")
    assert rel.max() < (5e-2 if kv_dtype == "int8" else 1.5e-1)
    assert (got.argmax(-1) == ref.argmax(-1))[clear].all()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("S,T", [(32768, 2048), (131072, 1024)])
def test_long_prompt_chunk(kind, S, T):
    """The last T positions of a 32k / 128k prompt prefilled over the cache (the entry point's
    prefill kernel) against the reference, which attends in query chunks (no [T, S] matrix)."""
    B, Hq, Hkv, D = 1, 32, 8, 128
    q, k, v = make_gpu(13, B, T, Hq, Hkv, S, D)
    pos = jnp.asarray(S - T + np.arange(T)[None], jnp.int32)
    kv_len = jnp.asarray([S], jnp.int32)
    if kind == "bf16":
        k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
        ks = vs = None
    else:
        (k, ks), (v, vs) = quantize_int8(k), quantize_int8(v)
    ref = attention_reference(q, k, v, pos, kv_len, scale=D ** -0.5, k_scale=ks, v_scale=vs)
    out = attention(q, k, v, pos, kv_len, scale=D ** -0.5, k_scale=ks, v_scale=vs)
    assert rel_err(out, ref) < BF16_TOL
