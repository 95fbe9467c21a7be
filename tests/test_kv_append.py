"""pallas_kernels.kv_append: rotary embedding + cache append at decode, kernel against reference,
and the reference against rotation written as complex multiplication in numpy."""
from __future__ import annotations

import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_append import rope_append, rope_append_kernel, rope_append_reference

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
    q, k2, v2 = rope_append_reference(qkv, bias, pos, kc, vc, inv, rows, n_heads=hq, pairing=pairing,
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
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)


def test_dispatch_and_errors():
    qkv, pos, kc, vc, inv, rows = _inputs(2, 4, 2, 32, 2, 8, jnp.float32)
    kw = dict(n_heads=4, pairing="pairs", dtype=jnp.float32)
    got = rope_append(qkv, None, pos, kc, vc, inv, rows, **kw)  # CPU: the reference
    want = rope_append_reference(qkv, None, pos, kc, vc, inv, rows, **kw)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    two = jnp.concatenate([qkv, qkv], axis=2)
    with pytest.raises(ValueError, match="one token per sequence, got T=2"):
        rope_append(two, None, jnp.concatenate([pos, pos], 1), kc, vc, inv, rows, **kw, implementation="interpret")
    with pytest.raises(ValueError, match="head dim 24"):
        q24, _, k24, v24, inv24, _ = _inputs(2, 4, 2, 24, 2, 8, jnp.float32)
        rope_append_kernel(q24[:, :, 0], None, pos[:, 0], k24, v24, inv24, rows, **kw, interpret=True)
    with pytest.raises(ValueError, match="a product of 256 columns is not q, k, v of 6 \\+ 2 x 2 heads"):
        rope_append_kernel(qkv[:, :, 0], None, pos[:, 0], kc, vc, inv, rows, n_heads=6, pairing="pairs",
                           dtype=jnp.float32, interpret=True)


def test_lowers_to_triton_for_h100():
    from jax._src.pallas.triton import gpu_info

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    S = jax.ShapeDtypeStruct
    n = (9 + 6) * 64
    args = (S((3, 1, n), jnp.float32), S((n,), jnp.float32), S((1,), jnp.int32), S((2, 3, 640, 64), jnp.bfloat16),
            S((2, 3, 640, 64), jnp.bfloat16), S((32,), jnp.float32), S((1,), jnp.int32))
    with warnings.catch_warnings(), mock.patch.object(gpu_info, "get_gpu_info", lambda: h100):
        warnings.simplefilter("ignore")
        for pairing in ("pairs", "halves"):
            lowered = rope_append_kernel.trace(*args, n_heads=9, pairing=pairing, dtype=jnp.bfloat16).lower(
                lowering_platforms=("cuda",))
            assert "__gpu$xla.gpu.triton" in lowered.as_text()


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
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-2)
