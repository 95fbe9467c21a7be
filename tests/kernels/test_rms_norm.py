"""Residual add + RMS norm (pallas_kernels.rms_norm): the Mosaic GPU kernel against the
plain-JAX reference, in Mosaic GPU's CPU interpreter and (marked gpu) compiled on the GPU; the
reference against a float64 numpy oracle."""
from __future__ import annotations

import unittest.mock as mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rms_norm import add_rms_norm, add_rms_norm_kernel

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
EPS = 1e-5


def _inputs(m, k, s, parts_dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)) * 3, jnp.float32)
    parts = jnp.asarray(rng.standard_normal((s, m, k)), parts_dtype) if s else None
    w = jnp.asarray(rng.standard_normal(k), jnp.float32)
    return x, parts, w


def _oracle(x, parts, w):
    x = np.asarray(x, np.float64)
    if parts is not None:
        x = x + np.asarray(jnp.asarray(parts, jnp.float32), np.float64).sum(0)
    return x, x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * np.asarray(w, np.float64)


@pytest.mark.parametrize("k", [576, 2048, 192])
@pytest.mark.parametrize("s", [0, 1, 3])
def test_kernel_matches_reference_and_oracle(k, s):
    """K a multiple of 128 (strided over the warpgroup) or of 64 only (the replicated (K / 64,
    64) view); no partials, one, several (a split-K matmul's)."""
    x, parts, w = _inputs(3, k, s, seed=k + s)
    got_x, got_y = add_rms_norm(x, parts, w, EPS, jnp.float32, implementation="interpret")
    ref_x, ref_y = add_rms_norm(x, parts, w, EPS, jnp.float32, implementation="reference")
    want_x, want_y = _oracle(x, parts, w)
    assert got_x.dtype == jnp.float32 and got_y.shape == (3, k)
    np.testing.assert_allclose(np.asarray(got_x), np.asarray(ref_x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_y), np.asarray(ref_y), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ref_y), want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_x), want_x, rtol=1e-6, atol=1e-6)


def test_leading_axes_bf16_output_and_bf16_partials():
    x, parts, w = _inputs(4, 256, 2, parts_dtype=jnp.bfloat16, seed=3)
    x3, parts3 = x.reshape(2, 2, 256), parts.reshape(2, 2, 2, 256)
    got_x, got_y = add_rms_norm(x3, parts3, w, EPS, jnp.bfloat16, implementation="interpret")
    assert got_x.shape == (2, 2, 256) and got_y.dtype == jnp.bfloat16
    want_x, want_y = _oracle(x, parts, w)
    np.testing.assert_allclose(np.asarray(got_x).reshape(4, 256), want_x, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_y, np.float32).reshape(4, 256), want_y, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("k,s", [(576, 2), (2048, 0)])
def test_quantizing_kernel_matches_reference(k, s):
    """quantize=True: the normed row comes as int8 groups, the same q as the reference rounds
    the float32 normed row to (the residual as above)."""
    from pallas_kernels.int8_activations import dequantize_x

    x, parts, w = _inputs(2, k, s, seed=k)
    got_x, got_q = add_rms_norm(x, parts, w, EPS, jnp.bfloat16, quantize=True, implementation="interpret")
    ref_x, ref_q = add_rms_norm(x, parts, w, EPS, jnp.bfloat16, quantize=True, implementation="reference")
    np.testing.assert_allclose(np.asarray(got_x), np.asarray(ref_x), rtol=1e-6, atol=1e-6)
    assert got_q.dtype == jnp.bfloat16 and got_q.shape == (2, k)
    np.testing.assert_array_equal(np.asarray(got_q.words), np.asarray(ref_q.words))
    np.testing.assert_allclose(np.asarray(got_q.dsum16), np.asarray(ref_q.dsum16), rtol=1e-5, atol=1e-6)
    _, want_y = _oracle(x, parts, w)
    np.testing.assert_allclose(np.asarray(dequantize_x(got_q)), want_y, atol=np.abs(want_y).max() / 127)


def test_dispatch_and_errors():
    x, parts, w = _inputs(2, 64, 1)
    # CPU backend: the reference, whatever the row count.
    got = add_rms_norm(x, parts, w, EPS, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(
        add_rms_norm(x, parts, w, EPS, jnp.float32, implementation="reference")[1]))
    with pytest.raises(ValueError, match="implementation='triton'"):
        add_rms_norm(x, parts, w, EPS, jnp.float32, implementation="triton")
    with pytest.raises(ValueError, match="needs K a multiple of 64"):
        add_rms_norm_kernel(_inputs(1, 96, 0)[0], None, _inputs(1, 96, 0)[2], EPS, jnp.bfloat16, quantize=True,
                            interpret=True)
    with pytest.raises(ValueError, match=r"weight \(32,\) do not match x \(2, 64\)"):
        add_rms_norm_kernel(x, parts, w[:32], EPS, jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="needs K a multiple of 64"):
        add_rms_norm_kernel(_inputs(1, 96, 0)[0], None, _inputs(1, 96, 0)[2], EPS, jnp.float32, interpret=True)


@pytest.mark.parametrize("rows,s,k,want", [(1, 0, 576, "pallas"), (8, 0, 576, "reference"), (8, 1, 576, "pallas"),
                                           (1, 1, 96, "reference"), (65, 1, 576, "reference")])
def test_gpu_dispatch(rows, s, k, want):
    """On a GPU backend: the kernel for decode rows, XLA for the plain norm without partials at
    8 rows or more, for K not a multiple of 64, and past MAX_ROWS."""
    from pallas_kernels.rms_norm import add_norm

    x, parts, w = _inputs(rows, k, s)
    got = []
    fake = lambda *a, **kw: got.append("pallas") or (a[0], a[0])  # noqa: E731
    with mock.patch.object(jax, "default_backend", lambda: "gpu"), \
            mock.patch.object(add_norm, "add_rms_norm_kernel", fake):
        add_rms_norm(x, parts, w, EPS, jnp.float32)
    assert (got[0] if got else "reference") == want


@pytest.mark.parametrize("k", [2048, 576])
def test_lowers_to_mosaic_gpu(k):
    """Without a GPU: the plain and the quantizing norm lower to Mosaic GPU modules, for both
    row layouts (strided, replicated view) and both chunk sizes."""
    args = (jax.ShapeDtypeStruct((1, k), jnp.float32), jax.ShapeDtypeStruct((2, 1, k), jnp.float32),
            jax.ShapeDtypeStruct((k,), jnp.float32))
    for quantize in (False, True):
        text = add_rms_norm_kernel.trace(*args, EPS, jnp.bfloat16, quantize=quantize).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text and "triton" not in text


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,s", [(1, 2048, 1), (3, 576, 4), (8, 4096, 0), (32, 576, 2)])
def test_kernel_on_gpu(m, k, s):
    from pallas_kernels.int8_activations import dequantize_x

    x, parts, w = _inputs(m, k, s, seed=m)
    qx, q = jax.jit(add_rms_norm, static_argnames=("eps", "out_dtype", "quantize"))(
        x, parts, w, eps=EPS, out_dtype=jnp.bfloat16, quantize=True)
    got_x, got_y = jax.jit(add_rms_norm, static_argnames=("eps", "out_dtype", "implementation"))(
        x, parts, w, eps=EPS, out_dtype=jnp.float32, implementation="pallas")
    want_x, want_y = _oracle(x, parts, w)
    np.testing.assert_allclose(np.asarray(got_x), want_x, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_y), want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(qx), want_x, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dequantize_x(q)), want_y, atol=np.abs(want_y).max() / 127)
