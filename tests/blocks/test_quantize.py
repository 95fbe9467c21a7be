"""Quantize on load: bit-exact with gguf-py where it has a quantizer, error-bounded Q4_K."""
import jax
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import quants

from gguf_blocks import formats, quantize, reference
from gguf_blocks.qtensor import QTensor


def weights(rows, cols, seed=0, kind="gauss"):
    rng = np.random.default_rng(seed)
    if kind == "gauss":
        return rng.standard_normal((rows, cols)).astype(np.float32)
    if kind == "heavy":  # Student-t tails, small magnitudes like real weights
        return (rng.standard_t(2, (rows, cols)) * 0.02).astype(np.float32)
    if kind == "outliers":
        x = rng.standard_normal((rows, cols))
        return (x * np.where(rng.random((rows, cols)) < 0.01, 50.0, 1.0)).astype(np.float32)
    if kind == "block_scales":  # every 32-value group at its own scale, 1e-3 .. 1e3
        x = rng.standard_normal((rows, cols))
        return (x * np.repeat(np.exp(rng.uniform(-7, 7, (rows, cols // 32))), 32, axis=1)).astype(np.float32)
    if kind == "positive":
        return (rng.random((rows, cols)) + 3).astype(np.float32)
    if kind == "negative":
        return (-rng.random((rows, cols)) - 3).astype(np.float32)
    raise ValueError(kind)


@pytest.mark.parametrize("qtype", quantize.GGUF_QUANTIZED, ids=lambda t: t.name)
@pytest.mark.parametrize("kind", ["gauss", "heavy", "block_scales"])
def test_bit_exact_with_gguf_quantizer(qtype, kind, monkeypatch):
    monkeypatch.setattr(quantize, "_CHUNK_VALUES", 3 * 256)  # several row chunks
    w = weights(10, 256, seed=int(qtype), kind=kind)
    w[3, :32] = 0.0  # an all-zero block
    qt = quantize.quantize(w, qtype)
    assert isinstance(qt, QTensor) and qt.qtype == qtype and qt.shape == w.shape
    np.testing.assert_array_equal(formats.join_planes(qtype, qt.planes), quants.quantize(w, qtype))


@pytest.mark.parametrize("qtype", quantize.QUANTIZE_TYPES, ids=lambda t: t.name)
def test_input_dtypes_and_shapes(qtype):
    w = weights(2 * 3, 512, seed=1).reshape(2, 3, 512)
    ref = quantize.quantize(w, qtype)
    assert ref.shape == (2, 3, 512)
    assert ref.nbytes == formats.tensor_nbytes(qtype, w.shape)
    for p, f in zip(ref.planes, formats.LAYOUTS[qtype][1]):
        assert p.dtype == f.dtype and p.shape == (6, 512 // (32 if qtype != QType.Q4_K else 256), *f.shape)
    # f16 and bf16 inputs quantize like their exact f32 values
    for dt in (np.float16, ml_dtypes.bfloat16):
        lo = w.astype(dt)
        a, b = quantize.quantize(lo, qtype), quantize.quantize(lo.astype(np.float32), qtype)
        assert all(np.array_equal(x, y) for x, y in zip(a.planes, b.planes))
    # the planes round-trip through the loader path and dequantize to the input's shape
    again = formats.to_host_weight("w", qtype, formats.join_planes(qtype, ref.planes), w.shape)
    assert all(np.array_equal(x, y) for x, y in zip(again.planes, ref.planes))
    assert jax.jit(reference.dequantize)(ref).shape == w.shape


def q4_k_roundtrip(w):
    qt = quantize.quantize(w, QType.Q4_K)
    # dequantized by gguf-py from the file bytes: checks our packing independently of reference.py
    deq = quants.dequantize(formats.join_planes(QType.Q4_K, qt.planes), QType.Q4_K)
    np.testing.assert_array_equal(np.asarray(jax.jit(reference.dequantize)(qt)), deq)
    return qt, deq


def rel_rms(deq, w):
    return float(np.sqrt(np.mean((deq - w) ** 2) / np.mean(w ** 2)))


def test_q4_k_gaussian_error_beats_q4_0_and_q4_1():
    w = weights(64, 2048, seed=2)
    _, deq = q4_k_roundtrip(w)
    err = rel_rms(deq, w)
    assert err < 0.08  # measured 0.072
    # 4.5 bits/weight Q4_K must beat gguf's Q4_0 (4.5) and Q4_1 (5.0) on the same weights
    for other in (QType.Q4_0, QType.Q4_1):
        assert err < rel_rms(quants.dequantize(quants.quantize(w, other), other), w)


@pytest.mark.parametrize("kind", ["gauss", "heavy", "outliers", "block_scales", "positive", "negative"])
def test_q4_k_error_bounds(kind):
    w = weights(32, 1024, seed=3, kind=kind)
    qt, deq = q4_k_roundtrip(w)
    p = qt.planes
    xs = w.reshape(32, -1, 8, 32)
    err = np.abs(deq - w).reshape(xs.shape)

    # values inside their sub-block's grid are within half a grid step (plus f32 rounding)
    sc, mn = (np.asarray(a) for a in reference._k_scale_min(p.scales))
    step = (p.d.astype(np.float32)[..., None] * sc)[..., None]
    low = -(p.dmin.astype(np.float32)[..., None] * mn)[..., None]
    inside = (xs >= low - step / 2) & (xs <= low + 15.5 * step)
    assert np.all(err[inside] <= 0.5 * step.repeat(32, -1)[inside] + 1e-6 * np.abs(xs[inside]))
    if kind != "block_scales":  # there 6-bit sub-block scales of small groups are coarse or 0 by design
        assert inside.mean() > 0.97

    # every value is within 10% of its super-block's range (max - min(min, 0)); measured <= 8.6%
    sb = w.reshape(32, -1, 256)
    span = sb.max(-1) - np.minimum(sb.min(-1), 0)
    assert np.all(err.reshape(sb.shape).max(-1) <= 0.10 * span)
    assert rel_rms(deq, w) < 0.12


def test_q4_k_special_blocks_exact():
    w = np.zeros((3, 256), np.float32)
    w[1] = 0.75            # constant positive: 15 * scale with scale = 0.05
    w[2, :128] = -2.0      # constant negative sub-blocks (the min), zeros elsewhere
    _, deq = q4_k_roundtrip(w)
    np.testing.assert_array_equal(deq[0], 0.0)
    np.testing.assert_allclose(deq[1], 0.75, rtol=2e-3)
    np.testing.assert_allclose(deq[2], w[2], rtol=2e-3, atol=0)


def test_errors():
    w = weights(2, 256)
    with pytest.raises(formats.TensorFormatError, match=r"'blk\.0\.attn_q\.weight'.*cannot quantize to Q6_K"):
        quantize.quantize(w, QType.Q6_K, name="blk.0.attn_q.weight")
    with pytest.raises(formats.TensorFormatError, match=r"'w'.*row length 100 .*Q8_0 block size 32"):
        quantize.quantize(w[:, :100], QType.Q8_0, name="w")
    with pytest.raises(formats.TensorFormatError, match=r"'w'.*expected a float array, got dtype int32"):
        quantize.quantize(w.astype(np.int32), QType.Q4_0, name="w")
    bad = w.copy()
    bad[1, 7] = np.nan
    with pytest.raises(formats.TensorFormatError, match=r"'w'.*non-finite values"):
        quantize.quantize(bad, QType.Q4_K, name="w")
    with pytest.raises(formats.TensorFormatError, match=r"'w'.*too large for Q8_0"):
        quantize.quantize(w * 1e7, QType.Q8_0, name="w")
    with pytest.raises(formats.TensorFormatError, match=r"'w'.*unknown GGML type 77"):
        quantize.quantize(w, 77, name="w")
