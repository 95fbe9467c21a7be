"""Fused quantized matmul compiled for the GPU (Triton lowering), against the reference.

Skipped without a GPU backend. Shapes are small but use the production tile choices
(decode GEMV at M = 1, 16, 64; prefill GEMM at M = 300) plus edge tiles, every type, bf16
and f32 activations. Bounds as in test_quant_matmul.py: f32 <= 1e-5, bf16 <= 1e-2 relative.
"""
from __future__ import annotations

import unittest.mock as mock

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from pallas_kernels.quant_matmul import qmatmul
from pallas_kernels.quant_matmul.gemm import qmatmul_gemm
from pallas_kernels.quant_matmul.kernel import TileConfig, fused_qmatmul
from pallas_kernels.quant_matmul.testing import random_qtensor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU backend"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

TYPES = [QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q4_K, QType.Q6_K]


def _ref(x, w):
    from gguf_blocks.reference import dequantize
    wd = np.asarray(dequantize(w), np.float64)
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64) @ wd.T


def _rel(out, ref):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert np.all(np.isfinite(out))
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _dev(w):
    return jax.tree.map(jnp.asarray, w)


def _layouts(w):
    """w as the file has it, and as a GPU model holds it (rjax.layout.gpu_weight_layout: Q4_K
    scales per quant chunk, quant planes as int32 words)."""
    from gguf_blocks.reference import q4_k_chunks
    from gguf_blocks.words import as_words
    return [w, as_words(q4_k_chunks(w))]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 16, 64, 300])
def test_qmatmul_gpu_bf16(qtype, m):
    bs = gguf.GGML_QUANT_SIZES[qtype][0]
    k, n = 6 * 256 if bs == 256 else 576, 600
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.bfloat16)
    for w in _layouts(_dev(random_qtensor(qtype, n, k, seed=m))):
        out = jax.jit(qmatmul)(x, w)
        assert out.shape == (m, n) and out.dtype == jnp.bfloat16
        assert _rel(out, _ref(x, w)) < 1e-2
        if m > 64:  # both prefill paths
            assert _rel(qmatmul_gemm(x, w, path="fused"), _ref(x, w)) < 1e-2
            assert _rel(qmatmul_gemm(x, w, path="dequant_dot"), _ref(x, w)) < 1e-2


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("cfg,m", [(TileConfig(16, 32, 2, split_k=3), 5),
                                   (TileConfig(1, 32, 2, method="fma"), 1),
                                   (TileConfig(4, 16, 1, split_k=2, method="fma"), 3),
                                   (TileConfig(64, 64, 1, num_warps=4), 70)])
def test_fused_kernel_gpu_f32(qtype, cfg, m):
    bs = gguf.GGML_QUANT_SIZES[qtype][0]
    k, n = 3 * bs, 72
    x = jnp.asarray(np.random.default_rng(8).standard_normal((m, k)), jnp.float32)
    for w in _layouts(_dev(random_qtensor(qtype, n, k, seed=7))):
        assert _rel(fused_qmatmul(x, w, cfg), _ref(x, w)) < 1e-5


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q6_K],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3])
def test_int8_gemv_gpu(qtype, m):
    """The int8 kernel with its dp4a PTX: exact against the rounded activations it multiplies
    (edge tiles, split K), and through qmatmul at a production shape with production tiles."""
    from pallas_kernels.quant_matmul import gemv
    from pallas_kernels.quant_matmul.int8_gemv import Int8GemvConfig, dequantize_x, int8_gemv, quantize_x

    bs = gguf.GGML_QUANT_SIZES[qtype][0]
    k = 3 * bs if bs == 256 else 9 * bs
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.float32)
    for w in _layouts(_dev(random_qtensor(qtype, 40, k, seed=m))):
        for prefetch in (False, True):
            out = int8_gemv(x, w, Int8GemvConfig(16, 2, split_k=2, prefetch=prefetch))
            assert _rel(out, _ref(dequantize_x(quantize_x(x)), w)) < 1e-6
    if qtype in gemv.INT8_TILES and m <= gemv.Tuning.get(gemv.TUNING.int8_max_m, qtype, 0):
        n, k = (32768, 4096) if qtype == QType.Q6_K else (4096, 4096)  # Q6_K: the output layers' sizes only
        xb = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.bfloat16)
        assert gemv.uses_int8(qtype, m, n, k, xb.dtype)
        for w in _layouts(_dev(random_qtensor(qtype, n, k, seed=m))):
            out = jax.jit(qmatmul)(xb, w)
            assert _rel(out, _ref(dequantize_x(quantize_x(xb)), w)) < 5e-3   # bf16 output rounding
            assert _rel(out, _ref(xb, w)) < 1.5e-2


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q4_0, QType.Q4_1], ids=lambda t: t.name)
@pytest.mark.parametrize("cfg,m,n,nb", [(TileConfig(16, 64, 1, split_k=2, dequant="bf16x2"), 16, 136, 5),
                                        (TileConfig(16, 32, 2, split_k=3, num_stages=2, dequant="bf16x2"), 7, 72, 7),
                                        (TileConfig(64, 64, 1, dequant="bf16x2"), 40, 64, 2)])
def test_bf16x2_dequantization_gpu(qtype, cfg, m, n, nb):
    """Q4_K (GPU layout), Q4_0 and Q4_1 dequantized by the packed bf16x2 PTX, at edge tiles
    (rows, blocks and x rows past the tiles, split K): against the reference, and against the
    same arithmetic in the interpreter (which rounds q * s + b twice where the PTX rounds once)."""
    from rjax.layout import gpu_weight_layout

    k = nb * gguf.GGML_QUANT_SIZES[qtype][0]
    w = gpu_weight_layout(_dev(random_qtensor(qtype, n, k, seed=n)))
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.bfloat16)
    assert _rel(fused_qmatmul(x, w, cfg), _ref(x, w)) < 1e-2
    # float32 partial sums, so that no bf16 rounding of the output hides or adds differences;
    # the interpreter on the CPU: XLA's GPU backend would skip its bf16 roundings (excess precision)
    sums = np.asarray(fused_qmatmul(x, w, cfg, partials=True), np.float64)
    cpu = jax.devices("cpu")[0]
    want = np.asarray(fused_qmatmul(jax.device_put(x, cpu), jax.device_put(w, cpu), cfg, interpret=True,
                                    partials=True), np.float64)
    assert _rel(sums.sum(axis=0), want.sum(axis=0)) < 1e-3


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q8_0, QType.Q6_K, QType.Q4_0, QType.Q4_1, QType.Q5_0])
@pytest.mark.parametrize("m,n,nb,bps", [(1, 64, 2, 2), (5, 64, 1, 1), (16, 128, 8, 4), (16, 192, 16, 8),
                                        (33, 64, 4, 2), (64, 128, 2, 1)])
def test_wgmma_gpu(m, n, nb, bps, qtype):
    """The Mosaic GPU wgmma kernel (Q4_K, Q8_0, Q6_K, Q4_0, Q4_1, Q5_0; GPU layout): against gguf-py's dequantized product,
    and against the same arithmetic in jnp (`reference_arithmetic`, float32 partial sums per
    split), which leaves only the order of the float32 additions to differ."""
    from pallas_kernels.quant_matmul import gemv
    from pallas_kernels.quant_matmul import wgmma_skinny as wg
    from pallas_kernels.quant_matmul.testing import dequantized_product
    from rjax.layout import gpu_weight_layout

    k = nb * 256
    raw = random_qtensor(qtype, n, k, seed=n + nb)
    w = gpu_weight_layout(_dev(raw))
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.bfloat16)
    cfg = wg.WgmmaConfig(blocks_per_split=bps)
    out = wg.wgmma_matmul(x, w, cfg)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    assert _rel(out, dequantized_product(x, raw)) < 1e-2
    sums = np.asarray(wg.wgmma_matmul(x, w, cfg, partials=True), np.float64)
    want = np.asarray(wg.reference_arithmetic(x, w, cfg), np.float64)
    assert sums.shape == want.shape == (nb // bps, m, n)
    assert _rel(sums, want) < 1e-5
    if qtype == QType.Q8_0:   # quants as words (a GPU model's Q8_0) or as the file's bytes: the same product
        as_bytes = _dev(raw)
        assert w.planes.qs.dtype == jnp.int32 and as_bytes.planes.qs.dtype == jnp.int8
        np.testing.assert_array_equal(np.asarray(wg.wgmma_matmul(x, as_bytes, cfg, partials=True), np.float64), sums)
    tuning = gemv.TUNING.replace(wgmma_min_values={t: 0 for t, _ in gemv.TUNING.wgmma_min_values})  # these small sizes
    if m < gemv.Tuning.get(tuning.wgmma_min_m, qtype):
        return
    assert gemv.uses_wgmma(w, m, x, interpret=False, tuning=tuning)
    assert _rel(qmatmul(x, w, tuning=tuning), dequantized_product(x, raw)) < 1e-2
