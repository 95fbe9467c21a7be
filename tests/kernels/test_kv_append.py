"""pallas_kernels.kv_append: rotary embedding + cache append at decode, the Mosaic GPU kernel
(in Mosaic GPU's interpreter on the CPU, and on the GPU) against the reference, and the
reference against rotation written as complex multiplication in numpy."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_append import rope_append, rope_append_kernel, rope_append_reference
from pallas_kernels.kv_quant import FP8, dequantize, quantize_int8

THETA = 10000.0


def _inputs(B, hq, hkv, d, n_slots, S, dtype, seed=0, n_parts=1):
    """Split-K partial sums of a QKV product (float32), caches in `dtype`, positions, rows."""
    r = np.random.default_rng(seed)
    qkv = jnp.asarray(r.standard_normal((n_parts, B, 1, (hq + 2 * hkv) * d)) / n_parts, jnp.float32)
    kc = jnp.asarray(r.standard_normal((n_slots, hkv, S, d)), dtype)
    vc = jnp.asarray(r.standard_normal((n_slots, hkv, S, d)), dtype)
    pos = jnp.asarray(r.integers(0, S, (B, 1)), jnp.int32).at[-1, 0].set(-1)  # last sequence inactive
    rows = jnp.asarray(r.permutation(n_slots)[:B], jnp.int32)
    inv = 1.0 / THETA ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    return qkv, pos, kc, vc, inv, rows


def _numpy_rope(x, pos, inv, pairing):
    """x [..., D] float64 rotated by pos * inv as complex numbers."""
    d = x.shape[-1]
    if pairing == "pairs":
        z = x[..., 0::2] + 1j * x[..., 1::2]
    else:
        z = x[..., : d // 2] + 1j * x[..., d // 2:]
    z = z * np.exp(1j * pos * inv)
    if pairing == "pairs":
        return np.stack([z.real, z.imag], axis=-1).reshape(x.shape)
    return np.concatenate([z.real, z.imag], axis=-1)


@pytest.mark.parametrize("pairing", ["pairs", "halves"])
def test_reference_against_numpy(pairing):
    B, hq, hkv, d = 3, 6, 2, 32
    qkv, pos, kc, vc, inv, rows = _inputs(B, hq, hkv, d, 4, 16, jnp.float32, n_parts=3)
    bias = jnp.linspace(-1, 1, (hq + 2 * hkv) * d, dtype=jnp.float32)
    q, k2, v2, _, _ = rope_append_reference(qkv, bias, pos, kc, vc, inv, rows, n_heads=hq, pairing=pairing,
                                            dtype=jnp.float32)
    heads = (np.asarray(qkv, np.float64).sum(0) + np.asarray(bias, np.float64)).reshape(B, hq + 2 * hkv, d)
    inv64 = np.asarray(inv, np.float64)
    for b in range(B):
        p = int(pos[b, 0])
        want_q = _numpy_rope(heads[b, :hq], p, inv64, pairing)
        np.testing.assert_allclose(np.asarray(q[b, 0]), want_q, rtol=1e-5, atol=1e-5)
        want_k = np.asarray(kc, np.float64).copy()
        want_v = np.asarray(vc, np.float64).copy()
        if p >= 0:
            want_k[int(rows[b]), :, p] = _numpy_rope(heads[b, hq:hq + hkv], p, inv64, pairing)
            want_v[int(rows[b]), :, p] = heads[b, hq + hkv:]
        # Rows of the other sequences are checked in their turn; this row holds only this write.
        np.testing.assert_allclose(np.asarray(k2)[int(rows[b])], want_k[int(rows[b])], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(v2)[int(rows[b])], want_v[int(rows[b])], rtol=1e-6, atol=1e-6)
    untouched = np.setdiff1d(np.arange(4), np.asarray(rows))
    np.testing.assert_array_equal(np.asarray(k2)[untouched], np.asarray(kc)[untouched])


@pytest.mark.parametrize("pairing", ["pairs", "halves"])
@pytest.mark.parametrize("B,hq,hkv,d,dtype,n_parts,bias", [(2, 9, 3, 64, jnp.float32, 1, False),
                                                           (3, 8, 8, 32, jnp.bfloat16, 3, True),
                                                           (1, 32, 8, 128, jnp.bfloat16, 2, False)])
def test_kernel_matches_reference_interpret(pairing, B, hq, hkv, d, dtype, n_parts, bias):
    qkv, pos, kc, vc, inv, rows = _inputs(B, hq, hkv, d, B + 1, 24, dtype, seed=B, n_parts=n_parts)
    b = jnp.linspace(-2, 2, qkv.shape[-1], dtype=jnp.float32) if bias else None
    want = rope_append_reference(qkv, b, pos, kc, vc, inv, rows, n_heads=hq, pairing=pairing, dtype=dtype)
    got = rope_append(qkv, b, pos, kc, vc, inv, rows, n_heads=hq, pairing=pairing, dtype=dtype,
                      implementation="interpret")
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), rtol=tol, atol=tol)
    for g, w in zip(got[1:3], want[1:3]):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)
    assert got[3:] == want[3:] == (None, None)  # a float cache has no scales


@pytest.mark.parametrize("kind", [None, "int8"])
def test_several_tokens_per_sequence_interpret(kind):
    """A verification's T positions per sequence (some padding) in one kernel call: the
    reference's queries, and its cache, each token at its own position of its sequence's row."""
    B, T, hq, hkv, d, S = 2, 5, 8, 2, 64, 32
    r = np.random.default_rng(3)
    qkv = jnp.asarray(r.standard_normal((2, B, T, (hq + 2 * hkv) * d)) / 2, jnp.float32)
    kc = jnp.asarray(r.standard_normal((3, hkv, S, d)), jnp.float32)
    vc = jnp.asarray(r.standard_normal((3, hkv, S, d)), jnp.float32)
    pos = jnp.asarray([[10, 11, 12, 13, 14], [3, 4, 5, -1, -1]], jnp.int32)
    rows = jnp.asarray([2, 0], jnp.int32)
    inv = 1.0 / THETA ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    scales = {}
    if kind == "int8":
        kc, vc, ks, vs = _quantized(kc, vc, kind)
        scales = dict(k_scale=ks, v_scale=vs)
    kw = dict(n_heads=hq, pairing="halves", dtype=jnp.float32, **scales)
    want = rope_append_reference(qkv, None, pos, kc, vc, inv, rows, **kw)
    got = rope_append(qkv, None, pos, kc, vc, inv, rows, **kw, implementation="interpret")
    assert got[0].shape == (B, T, hq, d)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=1e-6)
    for g, w in zip(got[1:3], want[1:3]):
        np.testing.assert_allclose(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)),
                                   rtol=1e-6, atol=1.0 if kind else 1e-6)  # int8: a code apart at most
    if kind:
        np.testing.assert_allclose(np.asarray(got[3]), np.asarray(want[3]), rtol=1e-6)
    untouched = np.asarray(got[1].astype(jnp.float32))[0, :, 6:]  # row 0 past position 5: unwritten
    np.testing.assert_array_equal(untouched, np.asarray(kc.astype(jnp.float32))[0, :, 6:])


@pytest.mark.parametrize("kind", [None, "int8"])
def test_paged_pool_interpret(kind):
    """A paged cache: the pool's pages as the rows, one per token, and each token's offset in its
    page as `at` (-1: not written), two tokens sharing a page: the kernel writes what the
    reference writes and nothing else."""
    B, T, hq, hkv, d, P, ps = 2, 3, 4, 2, 32, 5, 4
    r = np.random.default_rng(11)
    qkv = jnp.asarray(r.standard_normal((2, B, T, (hq + 2 * hkv) * d)) / 2, jnp.float32)
    kc = jnp.asarray(r.standard_normal((P, hkv, ps, d)), jnp.float32)
    vc = jnp.asarray(r.standard_normal((P, hkv, ps, d)), jnp.float32)
    pos = jnp.asarray([[6, 7, 8], [1, 2, -1]], jnp.int32)
    pages = jnp.asarray([[3, 3, 0], [4, 4, 2]], jnp.int32)
    at = jnp.where(pos >= 0, pos % ps, -1)
    inv = 1.0 / THETA ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    scales = {}
    if kind == "int8":
        kc, vc, ks, vs = _quantized(kc, vc, kind)
        scales = dict(k_scale=ks, v_scale=vs)
    kw = dict(n_heads=hq, pairing="pairs", dtype=jnp.float32, at=at, **scales)
    want = rope_append_reference(qkv, None, pos, kc, vc, inv, pages, **kw)
    got = rope_append(qkv, None, pos, kc, vc, inv, pages, **kw, implementation="interpret")
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=1e-6)
    for g, w in zip(got[1:], want[1:]):
        if w is not None:
            np.testing.assert_allclose(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)),
                                       rtol=1e-6, atol=1.0 if kind and g.dtype == jnp.int8 else 1e-6)
    untouched = [1]  # no token's page
    np.testing.assert_array_equal(np.asarray(got[1].astype(jnp.float32))[untouched],
                                  np.asarray(kc.astype(jnp.float32))[untouched])


@pytest.mark.parametrize("pairing", ["pairs", "halves"])
@pytest.mark.parametrize("kind", [None, "int8", "fp8"])
def test_query_and_key_norms(pairing, kind):
    """Gemma's per-head RMS norms of q and k before the rotation: the reference against numpy
    (norm, then rotation), and the kernel (interpret mode) against the reference, into float and
    quantized caches."""
    B, hq, hkv, d, eps = 3, 4, 1, 64, 1e-6
    qkv, pos, kc, vc, inv, rows = _inputs(B, hq, hkv, d, 4, 16, jnp.float32, seed=5, n_parts=2)
    r = np.random.default_rng(6)
    norms = tuple(jnp.asarray(1 + 0.5 * r.standard_normal(d), jnp.float32) for _ in range(2))
    kw = dict(n_heads=hq, pairing=pairing, dtype=jnp.float32, qk_norm=norms, eps=eps)
    if kind is None:
        q, k2, _, _, _ = rope_append_reference(qkv, None, pos, kc, vc, inv, rows, **kw)
        heads = np.asarray(qkv, np.float64).sum(0).reshape(B, hq + 2 * hkv, d)
        inv64 = np.asarray(inv, np.float64)
        for b in range(B):
            p = int(pos[b, 0])
            x = heads[b, :hq + hkv]
            x = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
            x[:hq] *= np.asarray(norms[0], np.float64)
            x[hq:] *= np.asarray(norms[1], np.float64)
            np.testing.assert_allclose(np.asarray(q[b, 0]), _numpy_rope(x[:hq], p, inv64, pairing), rtol=1e-5,
                                       atol=1e-5)
            if p >= 0:
                np.testing.assert_allclose(np.asarray(k2)[int(rows[b]), :, p], _numpy_rope(x[hq:], p, inv64, pairing),
                                           rtol=1e-5, atol=1e-5)
    scales = {}
    if kind is not None:
        kc, vc, ks, vs = _quantized(kc, vc, kind)
        scales = dict(k_scale=ks, v_scale=vs)
    want = rope_append_reference(qkv, None, pos, kc, vc, inv, rows, **kw, **scales)
    got = rope_append(qkv, None, pos, kc, vc, inv, rows, **kw, **scales, implementation="interpret")
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
    for g, w in zip(got[1:3], want[1:3]):
        np.testing.assert_allclose(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)),
                                   rtol=1e-5, atol={None: 1e-5, "int8": 1.0, "fp8": 0.07}[kind])
    with pytest.raises(ValueError, match="norm weights must be \\[64\\]"):
        rope_append_kernel(qkv[:, :, 0], None, pos[:, 0], kc, vc, inv, rows, n_heads=hq, pairing=pairing,
                           dtype=jnp.float32, qk_norm=(norms[0][:32], norms[1]), interpret=True, **scales)


def test_dispatch_and_errors():
    qkv, pos, kc, vc, inv, rows = _inputs(2, 4, 2, 32, 2, 8, jnp.float32)
    kw = dict(n_heads=4, pairing="pairs", dtype=jnp.float32)
    got = rope_append(qkv, None, pos, kc, vc, inv, rows, **kw)  # CPU: the reference
    want = rope_append_reference(qkv, None, pos, kc, vc, inv, rows, **kw)
    for g, w in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(ValueError, match="head dim 24"):
        q24, _, k24, v24, inv24, _ = _inputs(2, 4, 2, 24, 2, 8, jnp.float32)
        rope_append_kernel(q24[:, :, 0], None, pos[:, 0], k24, v24, inv24, rows, **kw, interpret=True)
    with pytest.raises(ValueError, match="a product of 256 columns is not q, k, v of 6 \\+ 2 x 2 heads"):
        rope_append_kernel(qkv[:, :, 0], None, pos[:, 0], kc, vc, inv, rows, n_heads=6, pairing="pairs",
                           dtype=jnp.float32, interpret=True)


def _quantized(kc, vc, kind, n_heads=None):
    """Float caches as a `kind` cache stores them, with their scales (fp8: per-head scales 0.5 / 2)."""
    if kind == "int8":
        (kq, ks), (vq, vs) = quantize_int8(kc), quantize_int8(vc)
        return kq, vq, ks, vs
    hkv = kc.shape[1]
    ks, vs = jnp.full((hkv,), 0.5, jnp.float32), jnp.linspace(1.0, 2.0, hkv, dtype=jnp.float32)
    return ((kc.astype(jnp.float32) / ks[:, None, None]).astype(FP8),
            (vc.astype(jnp.float32) / vs[:, None, None]).astype(FP8), ks, vs)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("pairing,dtype,bias", [("pairs", jnp.float32, False), ("halves", jnp.bfloat16, True)])
def test_quantized_append_interpret(kind, pairing, dtype, bias):
    """Into an int8 or fp8 cache the kernel writes what the reference writes: the float
    reference's key and value quantized (pallas_kernels/kv_quant.py), int8 scales beside them;
    an inactive sequence writes nothing, values or scales."""
    B, hq, hkv, d, S = 3, 8, 2, 64, 24
    qkv, pos, kc, vc, inv, rows = _inputs(B, hq, hkv, d, B + 1, S, dtype, seed=7, n_parts=2)
    b = jnp.linspace(-2, 2, qkv.shape[-1], dtype=jnp.float32) if bias else None
    kq, vq, ks, vs = _quantized(kc, vc, kind)
    kw = dict(n_heads=hq, pairing=pairing, dtype=dtype)
    want = rope_append_reference(qkv, b, pos, kq, vq, inv, rows, **kw, k_scale=ks, v_scale=vs)
    got = rope_append(qkv, b, pos, kq, vq, inv, rows, **kw, implementation="interpret", k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), rtol=1e-6, atol=1e-6)
    # The kernel evaluates the rotation in another order than XLA, so a key may differ in its last
    # float32 bit and land one quantum away; values and scales are otherwise the reference's.
    for g, w, gs, ws in ((got[1], want[1], got[3], want[3]), (got[2], want[2], got[4], want[4])):
        assert g.dtype == w.dtype and g.shape == w.shape
        gi, wi = np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32))
        assert np.mean(gi != wi) < 0.01
        np.testing.assert_allclose(np.asarray(gs), np.asarray(ws), rtol=1e-6)
        x, y = np.asarray(dequantize(g, gs)), np.asarray(dequantize(w, ws))
        step = np.abs(y).max(axis=-1, keepdims=True) / 127 if kind == "int8" else np.abs(y) / 8 + 1e-3
        assert np.all(np.abs(x - y) <= step * 1.001)
    # The reference's entries are the float reference's, quantized: against the float write.
    _, kf, vf, _, _ = rope_append_reference(qkv, b, pos, kc, vc, inv, rows, **kw)
    for new, scale, flt in ((got[1], got[3], kf), (got[2], got[4], vf)):
        for i in range(B):
            p, r = int(pos[i, 0]), int(rows[i])
            deq = np.asarray(dequantize(new, scale))[r, :, p]
            ref = np.asarray(flt[r, :, p], np.float32)
            if p < 0:
                continue
            # int8: half a quantum; e4m3: 2^-4 relative, 2^-10 x its scale (<= 2) below the normals.
            bound = (np.abs(ref).max(axis=-1, keepdims=True) / 254 if kind == "int8"
                     else np.abs(ref) / 16 + 2 * 2 ** -10)
            assert np.all(np.abs(deq - ref) <= bound + 1e-6)
    inactive = int(rows[-1])  # pos -1: its row unchanged
    np.testing.assert_array_equal(np.asarray(got[1].astype(jnp.float32))[inactive],
                                  np.asarray(kq.astype(jnp.float32))[inactive])
    if kind == "int8":
        np.testing.assert_array_equal(np.asarray(got[3])[inactive], np.asarray(ks)[inactive])
    else:
        assert got[3] is ks and got[4] is vs or np.array_equal(np.asarray(got[3]), np.asarray(ks))


def test_quantized_errors():
    qkv, pos, kc, vc, inv, rows = _inputs(2, 4, 2, 32, 2, 8, jnp.float32)
    kq, vq, ks, vs = _quantized(kc, vc, "int8")
    kw = dict(n_heads=4, pairing="pairs", dtype=jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="a int8 k cache needs its scale"):
        rope_append_kernel(qkv[:, :, 0], None, pos[:, 0], kq, vq, inv, rows, **kw)
    with pytest.raises(ValueError, match="int8 k scale must have shape"):
        rope_append_kernel(qkv[:, :, 0], None, pos[:, 0], kq, vq, inv, rows, **kw, k_scale=ks[0], v_scale=vs)


@pytest.mark.parametrize("kind", [None, "int8", "fp8"])
def test_lowers_to_mosaic_gpu(kind):
    """Every cache format and both pairings lower to a Mosaic GPU kernel, none to Triton, that
    writes the caches in place: each cache array (and an int8 cache's scales) is an operand the
    kernel's call aliases to an output."""
    S = jax.ShapeDtypeStruct
    n = (9 + 6) * 64
    dt = {None: jnp.bfloat16, "int8": jnp.int8, "fp8": FP8}[kind]
    scale = {None: None, "int8": S((2, 3, 640), jnp.float32), "fp8": S((3,), jnp.float32)}[kind]
    cache = S((2, 3, 640, 64), dt)
    args = (S((3, 1, n), jnp.float32), S((n,), jnp.float32), S((1,), jnp.int32), cache, cache, S((32,), jnp.float32),
            S((1,), jnp.int32))
    for pairing in ("pairs", "halves"):
        text = rope_append_kernel.trace(*args, n_heads=9, pairing=pairing, dtype=jnp.bfloat16, k_scale=scale,
                                        v_scale=scale).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text and "triton" not in text, (kind, pairing)
        aliases = text[text.index("output_operand_aliases"):].split("result_layouts")[0]
        assert aliases.count("output_operand_alias<") == (4 if kind == "int8" else 2), aliases


@pytest.mark.gpu
@pytest.mark.parametrize("pairing", ["pairs", "halves"])
@pytest.mark.parametrize("B,hq,hkv,d", [(1, 9, 3, 64), (8, 32, 8, 64), (4, 32, 8, 128)])
def test_kernel_on_gpu(pairing, B, hq, hkv, d):
    qkv, pos, kc, vc, inv, rows = _inputs(B, hq, hkv, d, B + 2, 640, jnp.bfloat16, seed=d, n_parts=2)
    bias = jnp.linspace(-1, 1, qkv.shape[-1], dtype=jnp.float32)
    kw = dict(n_heads=hq, pairing=pairing, dtype=jnp.bfloat16)
    want = rope_append_reference(qkv, bias, pos, kc, vc, inv, rows, **kw)
    got = jax.jit(rope_append, static_argnames=("n_heads", "pairing", "dtype"))(qkv, bias, pos, kc, vc, inv,
                                                                                 rows, **kw)
    for g, w in zip(got[:3], want[:3]):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("B,hq,hkv,d", [(1, 32, 8, 128), (8, 32, 8, 64)])
def test_quantized_kernel_on_gpu(kind, B, hq, hkv, d):
    """On the GPU the kernel's division and rotation may differ from XLA's in the last bit, so an
    entry may land one quantum (int8) or one e4m3 step away from the reference's."""
    qkv, pos, kc, vc, inv, rows = _inputs(B, hq, hkv, d, B + 2, 640, jnp.bfloat16, seed=d, n_parts=2)
    kq, vq, ks, vs = _quantized(kc, vc, kind)
    kw = dict(n_heads=hq, pairing="halves", dtype=jnp.bfloat16)
    want = rope_append_reference(qkv, None, pos, kq, vq, inv, rows, **kw, k_scale=ks, v_scale=vs)
    got = jax.jit(rope_append, static_argnames=("n_heads", "pairing", "dtype"))(qkv, None, pos, kq, vq, inv, rows,
                                                                                 **kw, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), rtol=1e-2, atol=1e-2)
    for g, w, gs, ws in ((got[1], want[1], got[3], want[3]), (got[2], want[2], got[4], want[4])):
        a, b = np.asarray(dequantize(g, gs)), np.asarray(dequantize(w, ws))
        step = np.abs(b).max(axis=-1, keepdims=True) / 127 if kind == "int8" else np.abs(b) / 8 + 2 ** -9
        assert np.all(np.abs(a - b) <= step * 1.01 + 1e-2 * np.abs(b))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [2, 5, 9])
def test_several_tokens_on_gpu(T):
    """A verification's K + 1 positions of one sequence (llama-8b heads) through the kernel."""
    hq, hkv, d = 32, 8, 128
    r = np.random.default_rng(T)
    qkv = jnp.asarray(r.standard_normal((2, 1, T, (hq + 2 * hkv) * d)) / 2, jnp.float32)
    kc = jnp.asarray(r.standard_normal((2, hkv, 640, d)), jnp.bfloat16)
    vc = jnp.asarray(r.standard_normal((2, hkv, 640, d)), jnp.bfloat16)
    pos = 300 + jnp.arange(T, dtype=jnp.int32)[None]
    rows, inv = jnp.asarray([1], jnp.int32), 1.0 / THETA ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    kw = dict(n_heads=hq, pairing="halves", dtype=jnp.bfloat16)
    want = rope_append_reference(qkv, None, pos, kc, vc, inv, rows, **kw)
    got = jax.jit(rope_append, static_argnames=("n_heads", "pairing", "dtype"))(qkv, None, pos, kc, vc, inv, rows,
                                                                                 **kw)
    for g, w in zip(got[:3], want[:3]):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-2)
