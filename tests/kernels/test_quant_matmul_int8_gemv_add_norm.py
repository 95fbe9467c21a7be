"""The int8 decode GEMV that adds its product to the residual stream and rounds the RMS-normed
result for the next product (`int8_gemv_add_norm`), and the consumer that applies the norm it
leaves pending: in Pallas' interpreter against plain JAX (`quantize_normed`, the dequantized
product), lowered for sm_90, and on the GPU."""
from __future__ import annotations

import unittest.mock as mock
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from pallas_kernels.int8_activations import dequantize_x, quantize_normed, quantize_x
from pallas_kernels.quant_matmul import int8_gemv
from pallas_kernels.quant_matmul.int8_gemv import Int8GemvConfig, as_words
from pallas_kernels.quant_matmul.testing import dequantized_product, random_qtensor, rel_error
from gguf_blocks.reference import q4_k_chunks

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
EPS = 1e-5


def _rows(m, k, seed, dtype=jnp.float32, scale=1.0):
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal((m, k)), dtype)


def _expected(x, w, residual, norm_w, cfg):
    """Residual + the product the kernel computes (x rounded per 32 values as it rounds it)."""
    xq = x if not isinstance(x, jax.Array) else quantize_x(x)
    return residual + dequantized_product(dequantize_x(xq), w)


@pytest.mark.parametrize("qtype,m,cfg", [
    (QType.Q4_K, 1, Int8GemvConfig(8, 1)),
    (QType.Q4_K, 2, Int8GemvConfig(4, 1, split_k=3)),
    (QType.Q8_0, 1, Int8GemvConfig(16, 2, split_k=2)),
    (QType.Q8_0, 3, Int8GemvConfig(32, 4)),
], ids=lambda v: v.name if isinstance(v, QType) else str(v))
def test_add_norm_matches_plain_jax(qtype, m, cfg):
    """New residual exact to float32 rounding; the rounded normed rows as quantize_normed rounds
    the same sums (one step of difference at most where a value sits on a rounding edge); the
    counts come back zeroed, and a second call with them gives the same result."""
    n, k = 96, 3 * 256 if qtype == QType.Q4_K else 9 * 32
    w = jax.tree.map(jnp.asarray, random_qtensor(qtype, n, k, seed=m))
    w_gpu = q4_k_chunks(as_words(w)) if qtype == QType.Q4_K else w
    x = _rows(m, k, seed=m + 1, dtype=jnp.bfloat16)
    residual, norm_w = _rows(m, n, seed=m + 2, scale=3.0), _rows(1, n, seed=m + 3)[0]
    counts = jnp.zeros((n // 32,), jnp.int32)
    x_out, xq, counts = int8_gemv.int8_gemv_add_norm(x, w_gpu, residual, norm_w, counts, cfg, EPS, interpret=True)
    want_x = _expected(x if m <= int8_gemv.ROUNDS_IN_KERNEL_MAX_M else quantize_x(x), w, residual, norm_w, cfg)
    np.testing.assert_allclose(np.asarray(x_out), np.asarray(want_x), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(counts), 0)
    want = quantize_normed(x_out, norm_w, EPS)
    np.testing.assert_allclose(np.asarray(xq.ss), np.asarray(want.ss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(xq.d), np.asarray(want.d), rtol=1e-6)
    q, q_want = (np.asarray(jax.lax.bitcast_convert_type(a.words, jnp.int8)).astype(int) for a in (xq, want))
    assert np.abs(q - q_want).max() <= 1 and (q != q_want).mean() < 0.01
    normed = x_out * jax.lax.rsqrt(jnp.mean(x_out * x_out, axis=-1, keepdims=True) + EPS) * norm_w
    assert rel_error(dequantize_x(xq), normed) < 1e-2
    again = int8_gemv.int8_gemv_add_norm(x, w_gpu, residual, norm_w, counts, cfg, EPS, interpret=True)
    np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(x_out))
    np.testing.assert_array_equal(np.asarray(again[1].words), np.asarray(xq.words))


@pytest.mark.parametrize("qtype,cfg", [(QType.Q4_K, Int8GemvConfig(8, 1, split_k=2)),
                                       (QType.Q8_0, Int8GemvConfig(16, 2)),
                                       (QType.Q6_K, Int8GemvConfig(32, 1))], ids=lambda v: getattr(v, "name", ""))
def test_consumer_applies_pending_norm(qtype, cfg):
    """A QuantizedX with a pending norm multiplies as its dequantized (normed) values do."""
    k = 512
    h, norm_w = _rows(2, k, seed=7, scale=5.0), _rows(1, k, seed=8)[0]
    xq = quantize_normed(h, norm_w, EPS)
    w = jax.tree.map(jnp.asarray, random_qtensor(qtype, 40, k, seed=9))
    got = int8_gemv.int8_gemv(xq, w, cfg, interpret=True, partials=True).sum(0)
    assert rel_error(got, dequantized_product(dequantize_x(xq), w)) < 1e-5
    normed = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + EPS) * norm_w
    assert rel_error(got, dequantized_product(normed, w)) < 2e-2


def test_add_norm_rejects_bad_shapes():
    w = jax.tree.map(jnp.asarray, random_qtensor(QType.Q8_0, 48, 64, seed=1))
    x, res = _rows(1, 64, seed=1, dtype=jnp.bfloat16), _rows(1, 48, seed=2)
    with pytest.raises(ValueError, match="N must be a multiple of 32"):
        int8_gemv.int8_gemv_add_norm(x, w, res, res[0], jnp.zeros((1,), jnp.int32), Int8GemvConfig(16, 1), EPS,
                                     interpret=True)


def test_add_norm_lowers_to_triton_for_h100():
    from jax._src.pallas.triton import gpu_info

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    n, k = 4096, 4096
    w = q4_k_chunks(as_words(jax.tree.map(jnp.asarray, random_qtensor(QType.Q4_K, 1, k))))
    w = type(w)(jax.tree.map(lambda a: jax.ShapeDtypeStruct((n,) + a.shape[1:], a.dtype), w.planes), w.qtype, (n, k))
    args = (jax.ShapeDtypeStruct((1, k), jnp.bfloat16), w, jax.ShapeDtypeStruct((1, n), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((n // 32,), jnp.int32))
    with warnings.catch_warnings(), mock.patch.object(gpu_info, "get_gpu_info", lambda: h100):
        warnings.simplefilter("ignore")
        lowered = jax.jit(lambda *a: int8_gemv.int8_gemv_add_norm(*a, Int8GemvConfig(8, 4), EPS)).trace(
            *args).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("qtype,n,k", [(QType.Q4_K, 4096, 4096), (QType.Q4_K, 2048, 8192), (QType.Q8_0, 576, 1536)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_add_norm_on_gpu(qtype, n, k):
    """The production tiles on the GPU against plain JAX, 20 calls passing the counts on; then a
    consumer product of the normed rows."""
    from pallas_kernels.quant_matmul.gemv import default_int8_config

    def gpu_layout(w):
        return q4_k_chunks(as_words(w)) if w.qtype == QType.Q4_K else w

    w_file = jax.tree.map(jnp.asarray, random_qtensor(qtype, n, k, seed=3))
    w, cfg = gpu_layout(w_file), default_int8_config(qtype, 1, n, k)
    x, residual, norm_w = _rows(1, k, 4, jnp.bfloat16), _rows(1, n, 5, scale=3.0), _rows(1, n, 6)[0]
    counts = jnp.zeros((n // 32,), jnp.int32)
    fn = jax.jit(lambda x, r, c: int8_gemv.int8_gemv_add_norm(x, w, r, norm_w, c, cfg, EPS))
    first = None
    for _ in range(20):
        x_out, xq, counts = fn(x, residual, counts)
        if first is None:
            first = (np.asarray(x_out), np.asarray(xq.words))
        np.testing.assert_array_equal(np.asarray(x_out), first[0])
        np.testing.assert_array_equal(np.asarray(xq.words), first[1])
    np.testing.assert_array_equal(np.asarray(counts), 0)
    # The product as the plain int8 kernel computes it (bit for bit the same sums), and as
    # gguf-py's dequantized weight gives it (float32 differences of a few 1e-4 on the GPU).
    product = jax.jit(lambda x: int8_gemv.int8_gemv(x, w, cfg, partials=True))(x).sum(0)
    assert rel_error(first[0], residual + product) < 1e-6
    want_x = residual + dequantized_product(dequantize_x(quantize_x(x)), w_file)
    assert rel_error(first[0], want_x) < 1e-3
    normed = want_x * jax.lax.rsqrt(jnp.mean(want_x * want_x, axis=-1, keepdims=True) + EPS) * norm_w
    assert rel_error(dequantize_x(xq), normed) < 1e-2
    w2_file = jax.tree.map(jnp.asarray, random_qtensor(QType.Q8_0, 256, n, seed=7))
    y = jax.jit(lambda xq: int8_gemv.int8_gemv(xq, w2_file, default_int8_config(QType.Q8_0, 1, 256, n)))(xq)
    assert rel_error(y, dequantized_product(normed, w2_file)) < 2e-2
