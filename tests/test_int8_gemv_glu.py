"""The int8 decode GEMV that multiplies the FFN's [gate; up] weight and rounds act(gate) * up to
int8 for the down product in the same kernel (`int8_gemv_glu`): in Pallas' interpreter against
plain JAX (gguf-py's dequantized weight, `glu`, `quantize_x`), lowered for sm_90, and on the
GPU against the two-kernel path it replaces."""
from __future__ import annotations

import unittest.mock as mock
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from pallas_kernels.int8_activations import dequantize_x, glu, quantize, quantize_normed, quantize_x
from pallas_kernels.quant_matmul import int8_gemv
from pallas_kernels.quant_matmul.int8_gemv import Int8GemvConfig, as_words
from pallas_kernels.quant_matmul.testing import dequantized_product, random_qtensor, rel_error
from rjax.quant.reference import q4_k_chunks

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _rows(m, k, seed, dtype=jnp.float32, scale=1.0):
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal((m, k)), dtype)


def _gpu_layout(w):
    return q4_k_chunks(as_words(w)) if w.qtype == QType.Q4_K else w


def _check_rounded(xq, want):
    """Same scales; quants equal but for one step where a value sits on a rounding edge."""
    np.testing.assert_allclose(np.asarray(xq.d), np.asarray(want.d), rtol=1e-5, atol=1e-9)
    q, q_want = (np.asarray(jax.lax.bitcast_convert_type(a.words, jnp.int8)).astype(int) for a in (xq, want))
    assert np.abs(q - q_want).max() <= 1 and (q != q_want).mean() < 0.01
    np.testing.assert_allclose(np.asarray(xq.dsum32), np.asarray(want.dsum32), rtol=1e-4, atol=1e-3 * float(want.d.max()))


@pytest.mark.parametrize("qtype,m,cfg,activation,normed", [
    (QType.Q4_K, 1, Int8GemvConfig(32, 1), "silu", True),
    (QType.Q4_K, 2, Int8GemvConfig(64, 2, prefetch=False), "gelu_tanh", False),
    (QType.Q8_0, 1, Int8GemvConfig(32, 4), "silu", False),
    (QType.Q4_1, 3, Int8GemvConfig(32, 2), "silu", True),
], ids=lambda v: v.name if isinstance(v, QType) else str(v))
def test_glu_matches_plain_jax(qtype, m, cfg, activation, normed):
    """act(gate) * up of the product of rounded x (with a pending norm or without) and the
    gguf-py dequantized weight, rounded per 32 values as quantize_x rounds it."""
    f, k = 128, 2 * 256 if qtype == QType.Q4_K else 9 * 32
    w = jax.tree.map(jnp.asarray, random_qtensor(qtype, 2 * f, k, seed=m))
    h = _rows(m, k, seed=m + 1, scale=3.0)
    xq = quantize_normed(h, _rows(1, k, seed=m + 2)[0], 1e-5) if normed else quantize_x(h)
    got = int8_gemv.int8_gemv_glu(xq, _gpu_layout(w), cfg, activation, interpret=True)
    assert got.words.shape == (m, f // 4) and got.d.shape == (m, f // 32) and got.ss is None
    want_f = glu(jnp.asarray(dequantized_product(dequantize_x(xq), w), jnp.float32), activation)
    _check_rounded(got, quantize_x(want_f))
    assert rel_error(dequantize_x(got), np.asarray(want_f, np.float64)) < 1e-2


def test_glu_takes_raw_rows():
    """Plain activations are rounded once, before the kernel, as the other paths round them."""
    qtype, f, k = QType.Q8_0, 64, 64
    w = jax.tree.map(jnp.asarray, random_qtensor(qtype, 2 * f, k, seed=5))
    x = _rows(1, k, seed=6, dtype=jnp.bfloat16)
    got = int8_gemv.int8_gemv_glu(x, w, Int8GemvConfig(32, 2), "silu", interpret=True)
    want_f = glu(jnp.asarray(dequantized_product(dequantize_x(quantize_x(x)), w), jnp.float32), "silu")
    _check_rounded(got, quantize_x(want_f))


@pytest.mark.parametrize("shape,cfg,match", [
    ((96, 64), Int8GemvConfig(32, 1), "multiple of 32"),
    ((128, 64), Int8GemvConfig(16, 1), "block_n"),
    ((128, 64), Int8GemvConfig(32, 1, split_k=2), "split_k 1"),
])
def test_glu_rejects_bad_tiles(shape, cfg, match):
    w = jax.tree.map(jnp.asarray, random_qtensor(QType.Q8_0, *shape, seed=1))
    with pytest.raises(ValueError, match=match):
        int8_gemv.int8_gemv_glu(_rows(1, shape[1], seed=1), w, cfg, "silu", interpret=True)
    good = jax.tree.map(jnp.asarray, random_qtensor(QType.Q8_0, 128, 64, seed=1))
    with pytest.raises(ValueError, match="activation"):
        int8_gemv.int8_gemv_glu(_rows(1, 64, seed=1), good, Int8GemvConfig(32, 1), "relu", interpret=True)


def test_glu_lowers_to_triton_for_h100():
    from jax._src.pallas.triton import gpu_info

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    n, k = 28672, 4096
    w = q4_k_chunks(as_words(jax.tree.map(jnp.asarray, random_qtensor(QType.Q4_K, 1, k))))
    w = type(w)(jax.tree.map(lambda a: jax.ShapeDtypeStruct((n,) + a.shape[1:], a.dtype), w.planes), w.qtype, (n, k))
    xq = jax.eval_shape(lambda h: quantize_normed(h, h[0], 1e-5), jax.ShapeDtypeStruct((1, k), jnp.float32))
    with warnings.catch_warnings(), mock.patch.object(gpu_info, "get_gpu_info", lambda: h100):
        warnings.simplefilter("ignore")
        lowered = jax.jit(lambda xq, w: int8_gemv.int8_gemv_glu(xq, w, Int8GemvConfig(32, 1), "silu")).trace(
            xq, w).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("qtype,f,k", [(QType.Q4_K, 14336, 4096), (QType.Q4_K, 8192, 2048), (QType.Q8_0, 8192, 2048)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_glu_on_gpu(qtype, f, k):
    """The production tiles against the two kernels they replace (the int8 product, then the
    GLU's rounding pass), and against gguf-py's dequantized weight."""
    from pallas_kernels.quant_matmul.gemv import default_glu_config, default_int8_config

    w_file = jax.tree.map(jnp.asarray, random_qtensor(qtype, 2 * f, k, seed=3))
    w = _gpu_layout(w_file)
    xq = quantize_normed(_rows(1, k, 4, scale=3.0), _rows(1, k, 5)[0], 1e-5)
    got = jax.jit(lambda xq: int8_gemv.int8_gemv_glu(xq, w, default_glu_config(qtype, 1, 2 * f, k), "silu"))(xq)
    gate_up = jax.jit(lambda xq: int8_gemv.int8_gemv(xq, w, default_int8_config(qtype, 1, 2 * f, k),
                                                     partials=True).sum(0))(xq)
    _check_rounded(got, quantize(gate_up, "silu", implementation="reference"))
    want_f = glu(jnp.asarray(dequantized_product(dequantize_x(xq), w_file), jnp.float32), "silu")
    assert rel_error(dequantize_x(got), np.asarray(want_f, np.float64)) < 1e-2
