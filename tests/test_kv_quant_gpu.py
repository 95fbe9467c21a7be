"""Attention kernels on a quantized KV cache (int8 per entry, fp8 e4m3 per head) on the GPU, at
model-sized shapes, against the reference on the same quantized cache computed on the same GPU
(float32, HIGHEST precision products), and the engine decoding over an int8 cache. Skipped
without a GPU.

Error bounds (relative Frobenius norm): 1e-2, as for bf16 caches (test_attention_gpu.py): the
int8 and e4m3 values are exact in float16, which the kernels compute in for bf16 queries, so
what differs from the float32 reference is the queries' rounding (bf16, ~2^-9), the float16
probabilities before the product with V (~2^-11) and the bf16 output (~2^-9). Against the float cache the formats' own error comes on top (test_kv_quant.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU", allow_module_level=True)

from pallas_kernels.attention import (  # noqa: E402
    attention, attention_reference, decode_attention, paged_attention, paged_decode_attention,
    paged_prefill_attention, prefill_attention,
)
from pallas_kernels.kv_quant import dequantize, quantize_fp8, quantize_int8  # noqa: E402

BF16_TOL = 1e-2
QUANT_TOL = {"int8": 2e-2, "fp8": 8e-2}  # against the float cache: test_kv_quant.py's bounds


def rel_err(out, ref):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    assert np.isfinite(out).all(), "kernel output has NaN/inf"
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def make(seed, B, T, Hq, Hkv, S, D):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, T, Hq, D), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (B, Hkv, S, D), jnp.float32)
    v = jax.random.normal(kv, (B, Hkv, S, D), jnp.float32)
    return q, k, v


def quantize(x, kind):
    if kind == "int8":
        return quantize_int8(x)
    scale = jnp.linspace(0.5, 2.0, x.shape[1]).astype(jnp.float32)
    return quantize_fp8(x, scale, head_axis=1), scale


def paginate(x, page_size, seed):
    """[B, Hkv, S, ...] -> a shuffled pool [P, Hkv, page_size, ...] (7 spare pages) and tables."""
    B, Hkv, S = x.shape[:3]
    n = S // page_size
    order = np.random.default_rng(seed).permutation(B * n + 7)[: B * n].reshape(B, n)
    pool = jnp.zeros((B * n + 7, Hkv, page_size) + x.shape[3:], x.dtype)
    pages = x.reshape(B, Hkv, n, page_size, *x.shape[3:]).swapaxes(1, 2).reshape(B * n, Hkv, page_size,
                                                                                *x.shape[3:])
    return pool.at[order.reshape(-1)].set(pages), jnp.asarray(order, jnp.int32)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("D,window", [(128, None), (128, 1000), (256, None)])
def test_decode_on_quantized_cache_matches_reference(kind, T, D, window):
    B, Hq, Hkv, S = 8, 32, 8, 4096
    q, k, v = make(T + D, B, T, Hq, Hkv, S, D)
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


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_prefill_on_quantized_cache_matches_reference(kind):
    B, T, Hq, Hkv, S, D = 3, 1024, 32, 8, 1536, 128
    q, k, v = make(9, B, T, Hq, Hkv, S, D)
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


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_paged_on_quantized_cache_matches_reference(kind, page_size):
    B, Hq, Hkv, S, D = 4, 32, 8, 2048, 128
    q, k, v = make(page_size, B, 8, Hq, Hkv, S, D)
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
    qp, _, _ = make(7, B, 256, Hq, Hkv, 16, D)
    ppos = jnp.asarray(lens[:, None] - 256 + np.arange(256)[None], jnp.int32)
    ppos = jnp.where(ppos < 0, -1, ppos)
    ref = attention_reference(qp, kq, vq, ppos, kv_len, scale=D ** -0.5, k_scale=ks, v_scale=vs)
    out = paged_prefill_attention(qp, kp, vp, table, ppos, kv_len, scale=D ** -0.5, k_scale=pks, v_scale=pvs)
    assert rel_err(out, ref) < BF16_TOL


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


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_one_token_merged_in_kernel_is_exact_every_call(kind):
    """16 splits merged by whichever program arrives last, 50 calls: equal bit for bit."""
    B, Hq, Hkv, S, D = 2, 9, 3, 2048, 64
    q, k, v = make(11, B, 1, Hq, Hkv, S, D)
    (kq, ks), (vq, vs) = quantize(k, kind), quantize(v, kind)
    lens = np.array([2048, 777])
    pos, kv_len = jnp.asarray(lens[:, None] - 1, jnp.int32), jnp.asarray(lens, jnp.int32)
    ref = attention_reference(q, kq, vq, pos, kv_len, scale=D ** -0.5, k_scale=ks, v_scale=vs)
    call = jax.jit(lambda q: decode_attention(q, kq, vq, pos, kv_len, scale=D ** -0.5, num_splits=16, k_scale=ks,
                                              v_scale=vs))
    outs = np.stack([np.asarray(call(q).astype(jnp.float32)) for _ in range(50)])
    assert rel_err(outs[0], ref) < BF16_TOL
    np.testing.assert_array_equal(outs, np.broadcast_to(outs[0], outs.shape))


def test_long_context_decode_int8_at_128k():
    """One token at position 131071 of an int8 cache (llama-8b's KV heads): kernel against the
    reference on the same cache, and against the float cache."""
    B, Hq, Hkv, S, D = 1, 32, 8, 131072, 128
    q, k, v = make(12, B, 1, Hq, Hkv, S, D)
    (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
    pos, kv_len = jnp.asarray([[S - 1]], jnp.int32), jnp.asarray([S], jnp.int32)
    ref = attention_reference(q, kq, vq, pos, kv_len, scale=D ** -0.5, k_scale=ks, v_scale=vs)
    out = decode_attention(q, kq, vq, pos, kv_len, scale=D ** -0.5, k_scale=ks, v_scale=vs)
    assert rel_err(out, ref) < BF16_TOL
    deq = attention_reference(q, dequantize(kq, ks), dequantize(vq, vs), pos, kv_len, scale=D ** -0.5)
    assert rel_err(ref, deq) < 1e-5


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_engine_decodes_over_a_quantized_cache(tmp_path, kv_dtype):
    """A synthetic llama of the default model's shape (4 layers) on the GPU plan (bf16
    activations, for_backend's layout; a quantized cache is written by kv_append's kernel and read
    by the decode attention kernel), prefill
    and 16 decode steps fed the bf16 cache's greedy tokens: the quantized cache's logits within
    5% (int8) / 15% (fp8) of max |logit| of the bf16 cache's (on the CPU, 2 layers: 1.2% and 6%,
    test_kv_quant.py), and the same argmax wherever the bf16 cache's top-2 margin exceeds 0.5."""
    from rjax import engine
    from rjax.cache import init_cache
    from rjax.loaders import for_backend
    from rjax.loaders.gguf import load_gguf
    from rjax.synth import write_synthetic

    path = write_synthetic(tmp_path / "tiny.gguf", "smollm2-135m", "q8_0", seed=3, n_layers=4, vocab_size=512,
                           tokenizer_from="builtin")
    cfg, params, _ = load_gguf(path, progress=False)
    params = for_backend(params)
    prompts = [[7, 3, 99, 41, 5, 18, 250, 6, 77, 12, 9], [300, 2, 2, 8, 501, 44]]
    tokens, lengths = engine.pad_prompts(prompts)

    def run(kv, feed=None):
        cache = init_cache(cfg, 2, 128, jnp.bfloat16, kv)
        logits, cache = engine.prefill(cfg, params, cache, jnp.asarray(tokens), jnp.asarray(lengths))
        out = [np.asarray(logits, np.float32)]
        for i in range(16):
            ids = jnp.argmax(logits, -1).astype(jnp.int32) if feed is None else jnp.asarray(feed[:, i])
            logits, cache = engine.decode_step(cfg, params, cache, ids)
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


@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("S,T", [(32768, 2048), (131072, 1024)])
def test_long_prompt_chunk(kind, S, T):
    """The last T positions of a 32k / 128k prompt prefilled over the cache (the entry point's
    prefill kernel) against the reference, which attends in query chunks (no [T, S] matrix)."""
    B, Hq, Hkv, D = 1, 32, 8, 128
    q, k, v = make(13, B, T, Hq, Hkv, S, D)
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
