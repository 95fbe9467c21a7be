"""Fused quantized matmul (pallas_kernels.quant_matmul) on CPU: the Pallas kernels run in
the interpreter, at small shapes, on random valid blocks (never zeros).

Oracles: gguf.quants.dequantize (ggml's arithmetic) for the weights and float64 numpy for
the product. Error bounds (relative Frobenius norm against the float64 product):
  f32 activations: <= 1e-5 (the kernel dequantizes and dots in f32);
  bf16 activations: <= 1e-2 (the MMA operands are bf16: the weights round to 8 bits).
The tests marked `gpu` compile the kernels for the GPU (Triton lowering) with the production
tile choices (decode GEMV at M = 1, 16, 64; prefill GEMM at M = 300) plus edge tiles, bf16
and f32 activations, same bounds.
"""
from __future__ import annotations

import unittest.mock as mock
import warnings

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from pallas_kernels.quant_matmul import qmatmul, supports
from pallas_kernels.quant_matmul.gemm import gemm_config, qmatmul_gemm
from pallas_kernels.quant_matmul.gemv import default_gemv_config
from pallas_kernels.quant_matmul.kernel import TileConfig, fused_qmatmul
from pallas_kernels.quant_matmul.reference import dequantize_then_dot, qmatmul_reference
from pallas_kernels.quant_matmul.testing import quantized_qtensor, random_qtensor, raw_bytes
from gguf_blocks import reference
from gguf_blocks.reference import dequantize, q4_k_chunks
from gguf_blocks.words import WORD_FIELDS, as_words

TYPES = [QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q4_K, QType.Q6_K]
F32_TOL, BF16_TOL = 1e-5, 1e-2

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _block(qtype):
    return gguf.GGML_QUANT_SIZES[qtype][0]


def _oracle(x, w):
    """float64 x @ W.T with W from gguf-py's dequantizer."""
    wd = gguf.quants.dequantize(raw_bytes(w), w.qtype).reshape(w.shape)
    return np.asarray(x, np.float64) @ wd.astype(np.float64).T


def _rel(out, ref):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert np.all(np.isfinite(out)), "non-finite output (an element never written?)"
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _x(m, k, seed, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k)), dtype)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_reference_dequantize_matches_gguf(qtype):
    w = random_qtensor(qtype, 7, 2 * _block(qtype), seed=3)
    want = gguf.quants.dequantize(raw_bytes(w), qtype).reshape(w.shape)
    np.testing.assert_array_equal(np.asarray(dequantize(w)), want)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_qmatmul_reference_matches_float64(qtype):
    w = random_qtensor(qtype, 24, 2 * _block(qtype), seed=4)
    x = _x(3, w.shape[1], 5)
    out = qmatmul_reference(x, w)
    assert out.shape == (3, 24) and out.dtype == jnp.float32
    assert _rel(out, _oracle(x, w)) < 1e-6


# (method, block_m, block_n, block_k, split_k, M, N): tiles that do and do not divide the
# problem, K steps that overrun the last block, split-K with an empty last split.
CONFIGS = [
    ("mma", 16, 16, 2, 1, 1, 40),
    ("mma", 32, 32, 4, 3, 37, 24),
    ("fma", 1, 16, 2, 1, 1, 40),
    ("fma", 4, 16, 1, 2, 3, 20),
]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("method,bm,bn,bk,split,m,n", CONFIGS)
def test_fused_kernel_f32(qtype, method, bm, bn, bk, split, m, n):
    k = 3 * _block(qtype)
    w = random_qtensor(qtype, n, k, seed=m * 100 + n)
    x = _x(m, k, seed=bm + bk)
    cfg = TileConfig(bm, bn, bk, split_k=split, method=method)
    out = fused_qmatmul(x, w, cfg, interpret=True)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert _rel(out, _oracle(x, w)) < F32_TOL


@pytest.mark.parametrize("qtype", [t for t in TYPES if t in WORD_FIELDS], ids=lambda t: t.name)
@pytest.mark.parametrize("method,bm,bn,bk,split,m,n", [CONFIGS[1], CONFIGS[3]])
def test_fused_kernel_word_planes(qtype, method, bm, bn, bk, split, m, n):
    """Quant planes as int32 words (the GPU layout, gguf_blocks.words), unpacked to bytes in the
    kernel: the same sums as the byte planes, bit for bit."""
    k = 3 * _block(qtype)
    w = jax.tree.map(jnp.asarray, random_qtensor(qtype, n, k, seed=m * 100 + n + 1))
    x = _x(m, k, seed=bm + bk + 1)
    cfg = TileConfig(bm, bn, bk, split_k=split, method=method)
    layouts = [w, as_words(w)] + ([_chunks(w), as_words(_chunks(w))] if qtype == QType.Q4_K else [])
    assert all(getattr(layouts[1].planes, f).dtype == jnp.int32 for f in WORD_FIELDS[qtype])
    outs = [np.asarray(fused_qmatmul(x, v, cfg, interpret=True)) for v in layouts]
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    assert _rel(outs[0], _oracle(x, w)) < F32_TOL


def test_word_planes_dequantize_as_the_file():
    """as_words is a view: the reference and the embedding lookup read the same values."""
    for qtype in WORD_FIELDS:
        w = random_qtensor(qtype, 5, 2 * _block(qtype), seed=7)
        want = gguf.quants.dequantize(raw_bytes(w), qtype).reshape(w.shape)
        words = as_words(jax.tree.map(jnp.asarray, w))
        np.testing.assert_array_equal(np.asarray(dequantize(words)), want)
        np.testing.assert_array_equal(np.asarray(reference.take_rows(words, jnp.asarray([3, 1]))), want[[3, 1]])
        assert words.nbytes == w.nbytes
    chunks = as_words(_chunks(random_qtensor(QType.Q4_K, 5, 512, seed=8)))
    assert chunks.planes.qs.dtype == jnp.int32 and chunks.planes.qs.shape == (5, 2, 32)
    np.testing.assert_array_equal(np.asarray(dequantize(chunks)), np.asarray(dequantize(
        _chunks(random_qtensor(QType.Q4_K, 5, 512, seed=8)))))


def _chunks(w):
    return q4_k_chunks(jax.tree.map(jnp.asarray, w))


def test_q4_k_chunks_dequantize_as_the_file():
    """The GPU layout (scales re-encoded per quant chunk) holds the same values, bit for bit."""
    w = random_qtensor(QType.Q4_K, 7, 3 * 256, seed=3)
    want = gguf.quants.dequantize(raw_bytes(w), QType.Q4_K).reshape(w.shape)
    np.testing.assert_array_equal(np.asarray(dequantize(_chunks(w))), want)
    rows = jnp.asarray([4, 0, 4])
    np.testing.assert_array_equal(np.asarray(reference.take_rows(_chunks(w), rows, jnp.float32)), want[[4, 0, 4]])
    assert _chunks(w).nbytes == w.nbytes + 7 * 3 * 4     # 16 scale bytes per block instead of 12


@pytest.mark.parametrize("method,bm,bn,bk,split,m,n", CONFIGS)
def test_fused_kernel_q4_k_chunks(method, bm, bn, bk, split, m, n):
    k = 3 * 256
    w = random_qtensor(QType.Q4_K, n, k, seed=m * 100 + n)
    x = _x(m, k, seed=bm + bk)
    out = fused_qmatmul(x, _chunks(w), TileConfig(bm, bn, bk, split_k=split, method=method), interpret=True)
    assert _rel(out, _oracle(x, w)) < F32_TOL


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_fused_kernel_bf16_activations(qtype):
    k = 2 * _block(qtype)
    w = random_qtensor(qtype, 48, k, seed=11)
    x = _x(20, k, seed=12, dtype=jnp.bfloat16)
    out = fused_qmatmul(x, w, TileConfig(16, 32, 2, split_k=2), interpret=True)
    assert out.dtype == jnp.bfloat16
    assert _rel(out, _oracle(np.asarray(x.astype(jnp.float32)), w)) < BF16_TOL


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0], ids=lambda t: t.name)
def test_gguf_quantized_gaussian_weights(qtype):
    """Weights as gguf-py quantizes real data (not only random bytes)."""
    rng = np.random.default_rng(21)
    w = quantized_qtensor(qtype, rng.standard_normal((33, 96)).astype(np.float32) * 0.05)
    x = _x(2, 96, 22)
    out = qmatmul(x, w, implementation="interpret")
    assert _rel(out, _oracle(x, w)) < F32_TOL


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 16, 80])
def test_qmatmul_dispatch_interpret(qtype, m):
    """The public entry with the production tile choices (GEMV up to 64 rows, GEMM above)."""
    k = 2 * _block(qtype)
    w = random_qtensor(qtype, 24, k, seed=m)
    x = _x(m, k, seed=m + 1)
    out = qmatmul(x, w, implementation="interpret")
    assert out.shape == (m, 24)
    assert _rel(out, _oracle(x, w)) < F32_TOL


@pytest.mark.parametrize("implementation,m", [("interpret", 1), ("interpret", 80), ("reference", 2)])
def test_qmatmul_partials_sum_to_the_product(implementation, m):
    """partials=True: (S, ..., N) float32 that sum to the product; the decode GEMV splits K
    here (S > 1), the GEMM and the reference hand over one part."""
    k = 8 * 256
    w = random_qtensor(QType.Q4_K, 24, k, seed=m)
    x = _x(m, k, seed=m + 1).reshape(1, m, k)
    parts = qmatmul(x, w, implementation=implementation, partials=True)
    assert parts.dtype == jnp.float32 and parts.shape[1:] == (1, m, 24)
    assert (parts.shape[0] > 1) == (implementation == "interpret" and m == 1)
    assert _rel(parts.sum(0)[0], _oracle(np.asarray(x[0]), w)) < F32_TOL


def test_qmatmul_leading_dims_jit_and_cpu_default():
    w = random_qtensor(QType.Q4_K, 16, 256, seed=2)
    x = _x(6, 256, 3).reshape(2, 3, 256)
    out = jax.jit(lambda x, w: qmatmul(x, w, implementation="interpret"))(x, w)
    assert out.shape == (2, 3, 16)
    ref = _oracle(np.asarray(x).reshape(6, 256), w).reshape(2, 3, 16)
    assert _rel(out, ref) < F32_TOL
    # On a CPU backend the default is the reference path.
    np.testing.assert_array_equal(np.asarray(qmatmul(x, w)), np.asarray(qmatmul(x, w, implementation="reference")))


def test_dequantize_then_dot_bf16():
    w = random_qtensor(QType.Q6_K, 32, 512, seed=8)
    x = _x(70, 512, 9, jnp.bfloat16)
    out = dequantize_then_dot(x, w)
    assert out.dtype == jnp.bfloat16
    assert _rel(out, _oracle(np.asarray(x.astype(jnp.float32)), w)) < BF16_TOL


def test_supports_and_errors():
    assert all(supports(t) for t in TYPES)
    assert not supports(QType.Q2_K) and not supports(QType.F16)
    w = random_qtensor(QType.Q8_0, 8, 64, seed=1)
    with pytest.raises(ValueError, match="does not match"):
        qmatmul(jnp.ones((1, 32)), w)
    with pytest.raises(ValueError, match="implementation"):
        qmatmul(jnp.ones((1, 64)), w, implementation="cuda")
    with pytest.raises(ValueError, match="power of two"):
        TileConfig(16, 24, 1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernels_lower_to_triton_for_h100(qtype):
    """The production configs (decode and prefill) lower to a Triton module for an H100,
    without a GPU, so lowering errors show up on CPU."""
    from jax._src.pallas.triton import gpu_info

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    n, k = 4096, 4096
    w = random_qtensor(qtype, 1, k)
    w = _chunks(w) if qtype == QType.Q4_K else w        # the layout a GPU model has
    w = type(w)(jax.tree.map(lambda a: jax.ShapeDtypeStruct((n,) + a.shape[1:], a.dtype), w.planes), qtype, (n, k))
    for m, cfg in [(1, default_gemv_config(qtype, 1, n, k)), (64, default_gemv_config(qtype, 64, n, k)),
                   (1, TileConfig(1, 32, 8 if _block(qtype) == 32 else 1, method="fma")),
                   (2048, gemm_config(qtype, 2048, n, k))]:
        x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
        with warnings.catch_warnings(), mock.patch.object(gpu_info, "get_gpu_info", lambda: h100):
            warnings.simplefilter("ignore")
            lowered = jax.jit(fused_qmatmul, static_argnames=("cfg", "interpret")).trace(
                x, w, cfg).lower(lowering_platforms=("cuda",))
        assert "__gpu$xla.gpu.triton" in lowered.as_text(), (m, cfg)


@pytest.mark.parametrize("qtype", list(WORD_FIELDS), ids=lambda t: t.name)
def test_word_planes_lower_to_triton_for_h100(qtype):
    """The float kernel's in-register byte unpacking of word planes (two-way joins) lowers to a
    Triton module for sm_90 without a GPU."""
    from jax._src.pallas.triton import gpu_info

    from rjax.math.layout import gpu_weight_layout

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    w = gpu_weight_layout(jax.tree.map(jnp.asarray, random_qtensor(qtype, 64, 512, seed=1)))
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), w)
    for method, bm in (("mma", 16), ("fma", 4)):
        with warnings.catch_warnings(), mock.patch.object(gpu_info, "get_gpu_info", lambda: h100):
            warnings.simplefilter("ignore")
            lowered = jax.jit(fused_qmatmul, static_argnames=("cfg",)).trace(
                jax.ShapeDtypeStruct((bm, 512), jnp.bfloat16), shapes,
                TileConfig(bm, 32, 2, method=method)).lower(lowering_platforms=("cuda",))
        assert "__gpu$xla.gpu.triton" in lowered.as_text()


# ---- compiled for the GPU (Triton lowering) at the production tile choices, against the reference ----

def _ref(x, w):
    from gguf_blocks.reference import dequantize
    wd = np.asarray(dequantize(w), np.float64)
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64) @ wd.T


def _dev(w):
    return jax.tree.map(jnp.asarray, w)


def _layouts(w):
    """w as the file has it, and as a GPU model holds it (rjax.math.layout.gpu_weight_layout: Q4_K
    scales per quant chunk, quant planes as int32 words)."""
    from gguf_blocks.reference import q4_k_chunks
    from gguf_blocks.words import as_words
    return [w, as_words(q4_k_chunks(w))]


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q4_0, QType.Q4_1], ids=lambda t: t.name)
@pytest.mark.parametrize("cfg,m,n,nb", [(TileConfig(16, 64, 1, split_k=2, dequant="bf16x2"), 16, 136, 5),
                                        (TileConfig(16, 32, 2, split_k=3, num_stages=2, dequant="bf16x2"), 7, 72, 7),
                                        (TileConfig(64, 64, 1, dequant="bf16x2"), 40, 64, 2)])
def test_bf16x2_dequantization_gpu(qtype, cfg, m, n, nb):
    """Q4_K (GPU layout), Q4_0 and Q4_1 dequantized by the packed bf16x2 PTX, at edge tiles
    (rows, blocks and x rows past the tiles, split K): against the reference, and against the
    same arithmetic in the interpreter (which rounds q * s + b twice where the PTX rounds once)."""
    from rjax.math.layout import gpu_weight_layout

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


@pytest.mark.gpu
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
    from rjax.math.layout import gpu_weight_layout

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
