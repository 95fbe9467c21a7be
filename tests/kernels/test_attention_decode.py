"""pallas_kernels.attention.decode_rope_attention: the rotation and K/V append of one decode token
and its attention in one kernel, against the two references in sequence (kv_append's
rope_append_reference, then attention_reference), in interpret mode, lowered for sm_90, and on
the GPU against the two kernels it replaces."""
from __future__ import annotations

import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import attention_reference, decode_attention, decode_rope_attention
from pallas_kernels.kv_append import rope_append_kernel, rope_append_reference

THETA = 10000.0


def _assert_same_entries(got, want, kind, n_new: int):
    """The fused kernel's cache against kv_append's (Mosaic GPU) kernel's: the two rotate and
    quantize in different code, so one of the n_new entries written may round to a neighbouring
    value (a bf16 ulp, an int8 code, an e4m3 step); no other entry differs."""
    g, w = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    step = {None: np.abs(w) * 2.0 ** -7, "int8": 1.0, "fp8": np.abs(w) / 8 + 2.0 ** -9}[kind]
    assert np.all(np.abs(g - w) <= step), np.argwhere(np.abs(g - w) > step)[:5]
    assert np.count_nonzero(g != w) <= n_new


def _inputs(B, hq, hkv, d, S, dtype, seed, n_parts, bias, fill):
    """Partial sums of a QKV product, caches holding `fill` random positions per sequence, the
    new token's positions (right after them; the last sequence inactive when B > 1)."""
    r = np.random.default_rng(seed)
    n = (hq + 2 * hkv) * d
    parts = jnp.asarray(r.standard_normal((n_parts, B, n)) / n_parts, jnp.float32)
    kc = jnp.asarray(r.standard_normal((B, hkv, S, d)), dtype)
    vc = jnp.asarray(r.standard_normal((B, hkv, S, d)), dtype)
    pos = jnp.asarray(fill, jnp.int32)
    if B > 1:
        pos = pos.at[-1].set(-1)
    inv = 1.0 / THETA ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    b = jnp.asarray(r.standard_normal(n), jnp.float32) if bias else None
    return parts, b, pos, kc, vc, inv


def _reference(parts, bias, pos, kc, vc, inv, *, n_heads, pairing, dtype, scale, window, qk_norm=None, eps=0.0):
    B = parts.shape[1]
    q, k2, v2, _, _ = rope_append_reference(parts[:, :, None], bias, pos[:, None], kc, vc, inv, jnp.arange(B),
                                            n_heads=n_heads, pairing=pairing, dtype=dtype, qk_norm=qk_norm, eps=eps)
    out = attention_reference(q, k2, v2, pos[:, None], pos + 1, scale=scale, window=window)
    return out.astype(dtype), k2, v2


CASES = [  # B, hq, hkv, d, S, dtype, n_parts, bias, fill, window, num_splits
    (2, 9, 3, 64, 64, jnp.float32, 1, False, [37, 0], None, 1),
    (3, 8, 8, 32, 96, jnp.bfloat16, 3, True, [95, 40, 0], None, 2),
    (1, 32, 8, 128, 128, jnp.bfloat16, 2, False, [70], None, 3),
    (2, 12, 2, 64, 160, jnp.float32, 2, True, [150, 5], 32, 2),
    (2, 4, 4, 64, 48, jnp.float32, 1, False, [16, 47], None, 4),   # the token opens a block / ends the cache
    (2, 4, 4, 64, 48, jnp.float32, 1, False, [48, 10], None, 2),   # past the cache: nothing written
]


@pytest.mark.parametrize("pairing", ["pairs", "halves"])
@pytest.mark.parametrize("B,hq,hkv,d,S,dtype,n_parts,bias,fill,window,splits", CASES)
def test_matches_the_references_interpret(pairing, B, hq, hkv, d, S, dtype, n_parts, bias, fill, window, splits):
    parts, b, pos, kc, vc, inv = _inputs(B, hq, hkv, d, S, dtype, B + d, n_parts, bias, fill)
    kw = dict(n_heads=hq, pairing=pairing, dtype=dtype, scale=d ** -0.5, window=window)
    want = _reference(parts, b, pos, kc, vc, inv, **kw)
    got = decode_rope_attention(parts, b, pos, kc, vc, inv, **kw, block_k=16, num_splits=splits, interpret=True,
                                arrivals=jnp.zeros((B, hkv), jnp.int32))
    assert got[0].shape == (B, 1, hq, d) and got[0].dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(got[3]), 0)  # the merge's counts, left zero for the next call
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), rtol=tol, atol=tol)
    for g, w in zip(got[1:], want[1:]):   # the caches: the new rows written, nothing else changed
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)
    if B > 1:  # the inactive sequence: output zeros, its cache rows untouched
        assert not np.asarray(got[0][-1], np.float32).any()
        np.testing.assert_array_equal(np.asarray(got[1][-1]), np.asarray(kc[-1]))


@pytest.mark.parametrize("pairing", ["pairs", "halves"])
@pytest.mark.parametrize("S,window,merged", [(2048, None, False), (2048, 40, True), (128, None, True)])
def test_query_key_norms_and_the_merge_interpret(pairing, S, window, merged):
    """Gemma's shape: q and k RMS-normed per head before the rotation, one KV head at batch 1.
    Over many blocks the splits' partials go to XLA's combine (`merges_in_kernel`), over a
    window or a short cache the kernel merges them; either way the references' output and caches."""
    from pallas_kernels.attention import decode_tiling as decode_mod

    hq, hkv, d, dtype, eps, block_k = 4, 1, 64, jnp.float32, 1e-6, 16
    visible = decode_mod.visible_keys(S, window, block_k)
    assert decode_mod.merges_in_kernel(1, hkv, visible, block_k) == merged
    parts, b, pos, kc, vc, inv = _inputs(1, hq, hkv, d, S, dtype, 7, 2, False, [S - 60])
    r = np.random.default_rng(8)
    norms = tuple(jnp.asarray(1 + 0.5 * r.standard_normal(d), jnp.float32) for _ in range(2))
    kw = dict(n_heads=hq, pairing=pairing, dtype=dtype, scale=d ** -0.5, window=window, qk_norm=norms, eps=eps)
    want = _reference(parts, b, pos, kc, vc, inv, **kw)
    arrivals = jnp.zeros((1, hkv), jnp.int32)
    got = decode_rope_attention(parts, b, pos, kc, vc, inv, **kw, block_k=block_k, interpret=True, arrivals=arrivals)
    np.testing.assert_array_equal(np.asarray(got[3]), 0)
    for g, w in zip(got[:3], want):
        np.testing.assert_allclose(np.asarray(g, np.float32).reshape(w.shape), np.asarray(w, np.float32),
                                   rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("pairing", ["pairs", "halves"])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("B,hq,hkv,S,window,norm", [(3, 8, 2, 96, None, False), (1, 4, 1, 2048, None, True),
                                                    (1, 4, 1, 2048, 40, False)])
def test_quantized_cache_interpret(pairing, kind, B, hq, hkv, S, window, norm):
    """An int8 or fp8 cache: the token's key and value written quantized as kv_append writes them
    (an int8 entry's scale beside it), the attention over the quantized cache with the token's
    own entry as the cache then holds it; against kv_append's reference, then the attention
    reference, on the same quantized caches. (1, 4, 1, 2048): the splits merged by XLA."""
    from pallas_kernels.kv_quant import FP8, dequantize, quantize_int8

    d, dtype = 64, jnp.float32
    fill = [S - 30, 17, 0][:B]
    parts, b, pos, kc, vc, inv = _inputs(B, hq, hkv, d, S, dtype, 11, 2, True, fill)
    if kind == "int8":
        (kc, ks), (vc, vs) = quantize_int8(kc), quantize_int8(vc)
    else:
        ks, vs = jnp.full((hkv,), 0.5, jnp.float32), jnp.linspace(1.0, 2.0, hkv, dtype=jnp.float32)
        kc, vc = (kc / ks[:, None, None]).astype(FP8), (vc / vs[:, None, None]).astype(FP8)
    r = np.random.default_rng(12)
    norms = tuple(jnp.asarray(1 + 0.5 * r.standard_normal(d), jnp.float32) for _ in range(2)) if norm else None
    kw = dict(n_heads=hq, pairing=pairing, dtype=dtype, qk_norm=norms, eps=1e-6)
    q, kw_, vw, ksw, vsw = rope_append_reference(parts[:, :, None], b, pos[:, None], kc, vc, inv, jnp.arange(B), **kw,
                                                 k_scale=ks, v_scale=vs)
    want = attention_reference(q, kw_, vw, pos[:, None], pos + 1, scale=d ** -0.5, window=window, k_scale=ksw,
                               v_scale=vsw)
    got = decode_rope_attention(parts, b, pos, kc, vc, inv, **kw, scale=d ** -0.5, window=window, block_k=16,
                                interpret=True, arrivals=jnp.zeros((B, hkv), jnp.int32), k_scale=ks, v_scale=vs)
    np.testing.assert_array_equal(np.asarray(got[3]), 0)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want), rtol=2e-3, atol=2e-3)
    for g, gs, w, ws in ((got[1], got[4], kw_, ksw), (got[2], got[5], vw, vsw)):
        x, y = np.asarray(dequantize(g, gs)), np.asarray(dequantize(w, ws))
        quantum = np.abs(y).max(-1, keepdims=True) / 127 if kind == "int8" else np.abs(y) / 8 + 2 ** -9
        assert np.all(np.abs(x - y) <= quantum * 1.001)


@pytest.mark.parametrize("pairing", ["pairs", "halves"])
@pytest.mark.parametrize("case", [1, 2, 3])
def test_quantized_output_interpret(pairing, case):
    """With quantize_out and its splits merged in the kernel, the output comes rounded to int8 per
    32 values (QuantizedX [B, 1]), as quantize_x rounds the float32 output; with one split it
    stays an array."""
    from pallas_kernels.int8_activations import QuantizedX, dequantize_x, quantize_x

    B, hq, hkv, d, S, dtype, n_parts, bias, fill, window, splits = CASES[case]
    parts, b, pos, kc, vc, inv = _inputs(B, hq, hkv, d, S, dtype, B + d, n_parts, bias, fill)
    kw = dict(n_heads=hq, pairing=pairing, dtype=dtype, scale=d ** -0.5, window=window, block_k=16,
              interpret=True)
    plain = decode_rope_attention(parts, b, pos, kc, vc, inv, **kw, num_splits=splits)
    got = decode_rope_attention(parts, b, pos, kc, vc, inv, **kw, num_splits=splits, quantize_out=True)
    assert isinstance(got[0], QuantizedX) and got[0].shape == (B, 1, hq * d) and got[0].dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(got[3]), 0)
    for g, w in zip(got[1:3], plain[1:3]):  # the caches as without rounding
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    want = np.asarray(_reference(parts, b, pos, kc, vc, inv, **{k: kw[k] for k in ("n_heads", "pairing", "scale",
                                                                                     "window")},
                                 dtype=jnp.float32)[0], np.float32).reshape(B, 1, hq * d)
    ref_q = quantize_x(jnp.asarray(want))
    tol = 2e-5 if dtype == jnp.float32 else 2e-2  # as the unrounded output against the references
    np.testing.assert_allclose(np.asarray(got[0].d), np.asarray(ref_q.d), rtol=tol, atol=1e-7)
    np.testing.assert_allclose(np.asarray(dequantize_x(got[0])), want,
                               atol=float(np.asarray(ref_q.d).max()) + tol * float(np.abs(want).max()))
    for a, ref in ((got[0].dsum32, ref_q.dsum32), (got[0].dsum16, ref_q.dsum16)):  # sums of the q it holds
        q = np.asarray(jax.lax.bitcast_convert_type(got[0].words, jnp.int8)).astype(np.float64)
        np.testing.assert_allclose(np.asarray(a), np.asarray(got[0].d).repeat(a.shape[-1] // got[0].d.shape[-1], -1)
                                   * q.reshape(*a.shape, -1).sum(-1), rtol=1e-5, atol=1e-6)
    one = decode_rope_attention(parts, b, pos, kc, vc, inv, **kw, num_splits=1, quantize_out=True)
    assert not isinstance(one[0], QuantizedX) and one[0].shape == (B, 1, hq, d)


def test_errors():
    parts, b, pos, kc, vc, inv = _inputs(2, 4, 2, 32, 32, jnp.float32, 0, 1, False, [3, 4])
    kw = dict(pairing="pairs", dtype=jnp.float32, scale=0.2, interpret=True)
    with pytest.raises(ValueError, match="does not match 6 query heads"):
        decode_rope_attention(parts, b, pos, kc, vc, inv, n_heads=6, **kw)
    with pytest.raises(ValueError, match="for 2 sequences"):
        decode_rope_attention(parts, b, pos, kc[:1], vc[:1], inv, n_heads=4, **kw)


def test_lowers_to_triton_for_h100():
    from jax._src.pallas.triton import gpu_info

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    S = jax.ShapeDtypeStruct
    n = (32 + 16) * 128
    kv = S((1, 8, 1024, 128), jnp.bfloat16)
    with warnings.catch_warnings(), mock.patch.object(gpu_info, "get_gpu_info", lambda: h100):
        warnings.simplefilter("ignore")
        for pairing, splits, bias, quantized in (("pairs", 1, None, False), ("halves", 2, S((n,), jnp.float32), False),
                                                 ("pairs", 4, None, True)):
            lowered = decode_rope_attention.trace(
                S((4, 1, n), jnp.float32), bias, S((1,), jnp.int32), kv, kv, S((64,), jnp.float32), n_heads=32,
                pairing=pairing, dtype=jnp.bfloat16, scale=0.088, num_splits=splits,
                quantize_out=quantized).lower(lowering_platforms=("cuda",))
            assert "__gpu$xla.gpu.triton" in lowered.as_text()


def test_quantized_and_normed_lower_to_triton_for_h100():
    """int8 and fp8 caches, q/k norms, and the XLA-merged splits of one KV head over 32k keys."""
    from jax._src.pallas.triton import gpu_info

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    S = jax.ShapeDtypeStruct
    with warnings.catch_warnings(), mock.patch.object(gpu_info, "get_gpu_info", lambda: h100):
        warnings.simplefilter("ignore")
        for kind, hkv, d, keys, pairing in (("int8", 8, 128, 1024, "pairs"), ("fp8", 8, 128, 1024, "halves"),
                                            ("int8", 1, 256, 32768, "halves")):
            n = (4 * hkv + 2 * hkv) * d
            dt = jnp.int8 if kind == "int8" else jnp.float8_e4m3fn
            kv = S((1, hkv, keys, d), dt)
            scale = S((1, hkv, keys) if kind == "int8" else (hkv,), jnp.float32)
            norm = (S((d,), jnp.float32), S((d,), jnp.float32))
            lowered = decode_rope_attention.trace(
                S((2, 1, n), jnp.float32), None, S((1,), jnp.int32), kv, kv, S((d // 2,), jnp.float32),
                n_heads=4 * hkv, pairing=pairing, dtype=jnp.bfloat16, scale=0.088, qk_norm=norm, eps=1e-6,
                k_scale=scale, v_scale=scale).lower(lowering_platforms=("cuda",))
            assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("pairing", ["pairs", "halves"])
@pytest.mark.parametrize("B,hq,hkv,d,splits", [(1, 9, 3, 64, None), (1, 32, 8, 128, None), (8, 32, 8, 128, 3)])
def test_gpu_matches_the_two_kernels(pairing, B, hq, hkv, d, splits):
    S = 1024
    fill = [577 + 61 * i for i in range(B)]
    parts, b, pos, kc, vc, inv = _inputs(B, hq, hkv, d, S, jnp.bfloat16, 7, 4, True, fill)
    kw = dict(n_heads=hq, pairing=pairing, dtype=jnp.bfloat16)
    q, k2, v2, _, _ = rope_append_kernel(parts, b, pos, kc, vc, inv, jnp.arange(B), **kw)
    want = decode_attention(q[:, None], k2, v2, pos[:, None], pos + 1, scale=d ** -0.5, num_splits=splits)
    got = decode_rope_attention(parts, b, pos, kc, vc, inv, **kw, scale=d ** -0.5, num_splits=splits)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
    _assert_same_entries(got[1], k2, None, B * hkv * d)
    _assert_same_entries(got[2], v2, None, B * hkv * d)
    # The output rounded to int8 by the merge (QuantizedX): within a rounding step of the above.
    from pallas_kernels.int8_activations import QuantizedX, dequantize_x

    xq = decode_rope_attention(parts, b, pos, kc, vc, inv, **kw, scale=d ** -0.5, num_splits=splits,
                               quantize_out=True)[0]
    assert isinstance(xq, QuantizedX)
    np.testing.assert_allclose(np.asarray(dequantize_x(xq)), np.asarray(want, np.float32).reshape(B, 1, hq * d),
                               rtol=0, atol=float(np.asarray(xq.d).max()) + 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("pairing", ["pairs", "halves"])
@pytest.mark.parametrize("B,hq,hkv,d,S", [(1, 32, 8, 128, 1024), (8, 32, 8, 128, 8192), (1, 4, 1, 256, 32768)])
def test_gpu_quantized_matches_the_two_kernels(kind, pairing, B, hq, hkv, d, S):
    """A quantized cache: the same entries, scales and (up to the order of the sums) output as
    kv_append's kernel followed by the decode attention kernel."""
    from pallas_kernels.kv_quant import FP8, quantize_int8

    fill = [S - 100 - 61 * i for i in range(B)]
    parts, b, pos, kc, vc, inv = _inputs(B, hq, hkv, d, S, jnp.float32, 13, 4, False, fill)
    if kind == "int8":
        (kc, ks), (vc, vs) = quantize_int8(kc), quantize_int8(vc)
    else:
        ks, vs = jnp.full((hkv,), 0.5, jnp.float32), jnp.full((hkv,), 1.5, jnp.float32)
        kc, vc = (kc / 0.5).astype(FP8), (vc / 1.5).astype(FP8)
    kw = dict(n_heads=hq, pairing=pairing, dtype=jnp.bfloat16)
    q, k2, v2, ks2, vs2 = rope_append_kernel(parts, b, pos, kc, vc, inv, jnp.arange(B), **kw, k_scale=ks, v_scale=vs)
    want = decode_attention(q[:, None], k2, v2, pos[:, None], pos + 1, scale=d ** -0.5, k_scale=ks2, v_scale=vs2)
    got = decode_rope_attention(parts, b, pos, kc, vc, inv, **kw, scale=d ** -0.5, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
    _assert_same_entries(got[1], k2, kind, B * hkv * d)
    _assert_same_entries(got[2], v2, kind, B * hkv * d)
    for g, w in zip(got[4:], (ks2, vs2)):  # an int8 row's scale: its largest value / 127
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2.0 ** -7)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("kernels", ["reference", "interpret"])
def test_model_decode_step_takes_it_when_planned(tmp_path, monkeypatch, kernels, paged):
    """The model's one-token step under a GPU plan with the fused path (Tuning.fused_rope_max_rows
    256) against the same plan without it (0): the same logits and caches as with rope_append +
    attention (both through references, or both through the kernels in interpret mode), and the
    fused path was taken; over a contiguous cache, and over a paged one (its pages in random
    order, as the serving engine's)."""
    import pallas_kernels.attention as attention
    from pallas_kernels.quant_matmul import TUNING
    from rjax.cli.bench import load_for_bench
    from rjax.engine import steps
    from rjax.loading.synth import write_synthetic
    from rjax.math.cache import init_cache
    from rjax.math.layout import fuse_projections
    from rjax.math.model import forward
    from rjax.math.plan import plan_for

    path = write_synthetic(tmp_path / "m.gguf", "smollm2-135m", "q4_1", n_layers=2, vocab_size=512,
                           tokenizer_from="builtin")
    cfg, params, _ = load_for_bench(path, progress=False)
    params = fuse_projections(params)  # as on a GPU: the path needs the fused QKV weight
    calls = []
    name = "paged_rope_attention" if paged else "rope_attention"
    fused = getattr(attention, name)
    monkeypatch.setattr(f"rjax.math.{'paged_cache' if paged else 'cache'}.{name}",
                        lambda *a, **k: calls.append(1) or fused(*a, **k))
    tokens, lengths = steps.pad_prompts([[5, 6, 7, 8, 9], [11, 12]])
    step = jnp.asarray([[3], [4]], jnp.int32)

    def run(max_rows):
        # The attention output stays float either way, so that only the fusion differs.
        tuning = TUNING.replace(fused_rope_max_rows=max_rows, quantized_attention_out=False)
        plan = plan_for(cfg, params, 2, 1, jnp.float32, gpu=True, implementation=kernels, tuning=tuning,
                        paged=paged)
        assert {lp.attention for lp in plan.layers} == {"rope_attention" if max_rows else "rope_append"}
        if paged:
            from rjax.math.paged_cache import init_paged_cache, set_block_tables

            cache = init_paged_cache(cfg, 2, 10, 16, 64)
            tables = np.random.default_rng(0).permutation(10)[:8].reshape(2, 4)
            cache = set_block_tables(cache, jnp.arange(2), jnp.asarray(tables, jnp.int32))
        else:
            cache = init_cache(cfg, 2, 64)
        _, cache = steps.prefill(cfg, params, cache, jnp.asarray(tokens), jnp.asarray(lengths))
        return forward(cfg, params, cache, step, jnp.asarray(lengths)[:, None], plan=plan)

    want = run(0)
    assert not calls
    got = run(256)
    assert calls, "the fused path was not taken"
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("S,window", [(32768, None), (32768, 512), (1024, None)])
def test_gpu_gemma_heads_with_norms(S, window):
    """gemma3-1b's heads (4 query, 1 KV, head dim 256) with q/k norms at batch 1: over 32k keys
    the splits go to XLA's combine, over a window or 1k keys the kernel merges them; the output
    and the written rows against the references in float32."""
    hq, hkv, d, dtype = 4, 1, 256, jnp.bfloat16
    parts, b, pos, kc, vc, inv = _inputs(1, hq, hkv, d, S, dtype, 9, 1, False, [S - 100])
    r = np.random.default_rng(10)
    norms = tuple(jnp.asarray(1 + 0.5 * r.standard_normal(d), jnp.float32) for _ in range(2))
    kw = dict(n_heads=hq, pairing="halves", scale=d ** -0.5, window=window, qk_norm=norms, eps=1e-6)
    want = _reference(parts, b, pos, kc.astype(jnp.float32), vc.astype(jnp.float32), inv, dtype=jnp.float32, **kw)
    got = decode_rope_attention(parts, b, pos, kc, vc, inv, dtype=dtype, **kw, arrivals=jnp.zeros((1, hkv), jnp.int32))
    np.testing.assert_array_equal(np.asarray(got[3]), 0)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0]), rtol=0, atol=3e-2)
    p = S - 100
    for g, w in zip(got[1:3], want[1:]):
        np.testing.assert_allclose(np.asarray(g[0, :, p], np.float32), np.asarray(w[0, :, p]), rtol=2e-2, atol=2e-2)


def _paged(kc, vc, page_size, seed, ks=None, vs=None):
    """The contiguous caches [B, Hkv, S, D] (and int8 scales [B, Hkv, S]) as a page pool in
    random order with two spare pages, and each sequence's block table."""
    B, hkv, S, d = kc.shape
    M = S // page_size
    perm = np.random.default_rng(seed).permutation(B * M + 2)
    table = jnp.asarray(perm[:B * M].reshape(B, M), jnp.int32)

    def pool(x):
        pages = x.reshape(B, hkv, M, page_size, *x.shape[3:]).transpose(0, 2, 1, 3, *range(4, x.ndim + 1))
        out = jnp.zeros((B * M + 2, *pages.shape[2:]), x.dtype)
        return out.at[table.reshape(-1)].set(pages.reshape(B * M, *pages.shape[2:]))

    scales = [pool(s) if s is not None and s.ndim == 3 else s for s in (ks, vs)]
    return pool(kc), pool(vc), table, *scales


PAGED_CASES = [  # B, hq, hkv, S, kind, page_size, block_k, splits, window, norm
    (2, 9, 3, 64, None, 16, 16, 1, None, False),
    (3, 8, 2, 128, None, 16, 32, 3, None, False),    # blocks span two pages
    (2, 12, 2, 160, None, 32, 16, 2, 32, True),
    (1, 4, 1, 2048, None, 16, 16, None, None, True),  # one KV head over many blocks: XLA merges the splits
    (3, 8, 2, 96, "int8", 16, 32, 2, None, False),
    (2, 8, 2, 96, "fp8", 16, 16, 3, None, True),
]


@pytest.mark.parametrize("pairing", ["pairs", "halves"])
@pytest.mark.parametrize("B,hq,hkv,S,kind,page_size,block_k,splits,window,norm", PAGED_CASES)
def test_paged_matches_the_references_interpret(pairing, B, hq, hkv, S, kind, page_size, block_k, splits, window,
                                                norm):
    """Over a page pool in random order: the kernel's output, pool and scales against the paged
    references (kv_append's reference writing on the pages, then the paged attention reference),
    and a float cache's output against the contiguous fused kernel's over the same cache. Each
    active sequence's token lands on its page at its offset and nowhere else; the last sequence
    is inactive (nothing written, zeros out). A sequence that owns no page at its position
    writes nothing."""
    from pallas_kernels.attention import paged_decode_rope_attention, paged_rope_attention
    from pallas_kernels.kv_quant import FP8, quantize_int8

    d, dtype = 64, jnp.float32
    fill = [S - 30, 17, 0][:B]
    parts, b, pos, kc, vc, inv = _inputs(B, hq, hkv, d, S, dtype, 5 + B, 2, True, fill)
    ks = vs = None
    if kind == "int8":
        (kc, ks), (vc, vs) = quantize_int8(kc), quantize_int8(vc)
    elif kind == "fp8":
        ks, vs = jnp.full((hkv,), 0.5, jnp.float32), jnp.linspace(1.0, 2.0, hkv, dtype=jnp.float32)
        kc, vc = (kc / ks[:, None, None]).astype(FP8), (vc / vs[:, None, None]).astype(FP8)
    kp, vp, table, kps, vps = _paged(kc, vc, page_size, 3, ks, vs)
    r = np.random.default_rng(12)
    norms = tuple(jnp.asarray(1 + 0.5 * r.standard_normal(d), jnp.float32) for _ in range(2)) if norm else None
    kw = dict(n_heads=hq, pairing=pairing, dtype=dtype, scale=d ** -0.5, window=window, qk_norm=norms, eps=1e-6)
    kernel = dict(block_k=block_k, num_splits=splits, interpret=True, k_scale=kps, v_scale=vps)
    tol = 2e-5 if kind is None else 2e-3

    def check_pools(got, want):
        for g, w in zip(got[1:3] + got[4:], want[1:3] + want[4:]):
            # an int8 code may round the other way (a value on a half step, summed in another order)
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol,
                                       atol=tol if kind != "int8" or g.dtype != jnp.int8 else 1.0)

    want = paged_rope_attention(parts, b, pos, kp, vp, table, inv, **kw, implementation="reference",
                                k_scale=kps, v_scale=vps)
    arrivals = jnp.zeros((B + 1, hkv), jnp.int32)  # a row more than the call runs, as a cache's slots
    got = paged_decode_rope_attention(parts, b, pos, kp, vp, table, inv, **kw, **kernel, arrivals=arrivals)
    assert got[0].shape == (B, 1, hq, d)
    np.testing.assert_array_equal(np.asarray(got[3]), 0)  # the merge's counts, left zero for the next call
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=tol, atol=tol)
    check_pools(got, want)
    changed = {(int(p), int(o)) for p, _, o in np.argwhere(np.asarray(got[1] != kp).any(-1))}
    assert changed == {(int(table[i, fill[i] // page_size]), fill[i] % page_size) for i in range(B)
                       if B == 1 or i < B - 1}
    if B > 1:
        assert not np.asarray(got[0][-1]).any()
    if kind is None:  # against the contiguous kernel over the same cache
        cont = decode_rope_attention(parts, b, pos, kc, vc, inv, **kw, **kernel)
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(cont[0]), rtol=2e-5, atol=2e-5)
    unowned = table.at[0, fill[0] // page_size].set(-1)
    got = paged_decode_rope_attention(parts, b, pos, kp, vp, unowned, inv, **kw, **kernel)
    want = paged_rope_attention(parts, b, pos, kp, vp, unowned, inv, **kw, implementation="reference",
                                k_scale=kps, v_scale=vps)
    check_pools(got, want)
    assert not np.asarray(got[1][int(table[0, fill[0] // page_size])] != kp[int(table[0, fill[0] // page_size])]).any()


def test_paged_lowers_to_triton_for_h100():
    """The paged fused kernel: float, int8 and fp8 pools, both pairings, merged in the kernel and
    by XLA (one KV head over 32k positions)."""
    from jax._src.pallas.triton import gpu_info

    from pallas_kernels.attention import paged_decode_rope_attention

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    S = jax.ShapeDtypeStruct
    with warnings.catch_warnings(), mock.patch.object(gpu_info, "get_gpu_info", lambda: h100):
        warnings.simplefilter("ignore")
        for kind, hkv, d, keys, pairing in ((None, 8, 128, 8192, "pairs"), ("int8", 8, 128, 8192, "halves"),
                                            ("fp8", 8, 128, 1024, "pairs"), ("int8", 1, 256, 32768, "halves")):
            n = (4 * hkv + 2 * hkv) * d
            dt = {None: jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[kind]
            P = 2 * keys // 16
            pool = S((P, hkv, 16, d), dt)
            scale = None if kind is None else S((P, hkv, 16) if kind == "int8" else (hkv,), jnp.float32)
            lowered = paged_decode_rope_attention.trace(
                S((2, 2, n), jnp.float32), None, S((2,), jnp.int32), pool, pool, S((2, keys // 16), jnp.int32),
                S((d // 2,), jnp.float32), n_heads=4 * hkv, pairing=pairing, dtype=jnp.bfloat16, scale=0.088,
                k_scale=scale, v_scale=scale, arrivals=S((4, hkv), jnp.int32),
                quantize_out=kind == "int8").lower(lowering_platforms=("cuda",))
            assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [None, "int8", "fp8"])
@pytest.mark.parametrize("pairing", ["pairs", "halves"])
@pytest.mark.parametrize("B,hq,hkv,d,S", [(1, 9, 3, 64, 1024), (1, 32, 8, 128, 8192), (4, 32, 8, 128, 2048)])
def test_gpu_paged_matches_the_two_kernels(kind, pairing, B, hq, hkv, d, S):
    """On the GPU over 16-position pages in random order: the paged fused kernel against
    kv_append's kernel writing on the pages, then the paged decode kernel (the path it replaces)."""
    from pallas_kernels.attention import paged_decode_attention, paged_decode_rope_attention
    from pallas_kernels.kv_quant import FP8, quantize_int8

    fill = [S - 61 - 97 * i for i in range(B)]
    parts, b, pos, kc, vc, inv = _inputs(B, hq, hkv, d, S, jnp.bfloat16, 9, 4, True, fill)
    ks = vs = None
    if kind == "int8":
        (kc, ks), (vc, vs) = quantize_int8(kc), quantize_int8(vc)
    elif kind == "fp8":
        ks, vs = jnp.full((hkv,), 0.5, jnp.float32), jnp.linspace(1.0, 2.0, hkv, dtype=jnp.float32)
        kc, vc = ((x.astype(jnp.float32) / s[:, None, None]).astype(FP8) for x, s in ((kc, ks), (vc, vs)))
    kp, vp, table, kps, vps = _paged(kc, vc, 16, 4, ks, vs)
    kw = dict(n_heads=hq, pairing=pairing, dtype=jnp.bfloat16)
    ps = 16
    page = table[jnp.arange(B), jnp.maximum(pos, 0) // ps]
    at = jnp.where(pos >= 0, pos % ps, -1)
    q, k2, v2, ks2, vs2 = rope_append_kernel(parts, b, pos, kp, vp, inv, page, **kw, k_scale=kps, v_scale=vps, at=at)
    want = paged_decode_attention(q[:, None], k2, v2, table, pos[:, None], pos + 1, scale=d ** -0.5, k_scale=ks2,
                                  v_scale=vs2)
    got = paged_decode_rope_attention(parts, b, pos, kp, vp, table, inv, **kw, scale=d ** -0.5, k_scale=kps,
                                      v_scale=vps)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    _assert_same_entries(got[1], k2, kind, B * hkv * d)
    _assert_same_entries(got[2], v2, kind, B * hkv * d)
    if kind == "int8":
        np.testing.assert_allclose(np.asarray(got[4]), np.asarray(ks2), rtol=2.0 ** -7)


def test_prologue_rounds_to_nearest_even():
    """The Triton prologue's rounding of int8 codes (Triton lowers no round) is jnp.round's: ties
    go to the even integer."""
    from pallas_kernels.attention.decode_prologue import _rne

    x = jnp.asarray([-127.0, -2.5, -1.5, -0.5, -0.49, 0.0, 0.5, 0.51, 1.5, 2.5, 3.5, 126.5, 127.0], jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(_rne)(x)), np.asarray(jnp.round(x)))
