"""PendingNorm: the residual add + RMS norm between two blocks, applied by the next product's
float decode kernel as it loads x. In Pallas' interpreter against the add + norm reference then
gguf-py's dequantized product; the fallback through the add + norm kernel; the dispatch; the
model decoding the same logits with and without it; the Triton lowering for sm_90; and on the
GPU against the two kernels it replaces."""
from __future__ import annotations

import unittest.mock as mock
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from pallas_kernels.quant_matmul import gemv, qmatmul, qmatmul_pending_norm, takes_pending_norm
from pallas_kernels.quant_matmul.kernel import TileConfig, fused_qmatmul
from pallas_kernels.quant_matmul.testing import dequantized_product, random_qtensor, rel_error
from pallas_kernels.rms_norm import PendingNorm, add_rms_norm_reference

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
EPS = 1e-5


def _pending(m, k, n_parts, seed, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    parts = jnp.asarray(r.standard_normal((n_parts, m, k)), jnp.float32) if n_parts else None
    return PendingNorm(jnp.asarray(r.standard_normal((m, k)) * 3, jnp.float32), parts,
                       jnp.asarray(r.uniform(0.5, 1.5, k), jnp.float32), EPS, jnp.dtype(dtype))


def _w(qtype, n, k, seed=1):
    return jax.tree.map(jnp.asarray, random_qtensor(qtype, n, k, seed=seed))


@pytest.mark.parametrize("qtype,n,k,m,cfg,n_parts", [
    (QType.Q4_1, 40, 576, 1, TileConfig(1, 8, 8, split_k=3, method="fma"), 3),   # smollm2's K, ragged splits
    (QType.Q4_0, 24, 192, 2, TileConfig(2, 8, 2, method="fma"), 0),
    (QType.Q8_0, 20, 256, 3, TileConfig(4, 16, 4, split_k=2, method="fma"), 4),
    (QType.Q6_K, 16, 512, 1, TileConfig(1, 16, 1, split_k=2, method="fma"), 1),
], ids=lambda v: v.name if isinstance(v, QType) else str(v))
@pytest.mark.parametrize("partials", [False, True])
def test_kernel_matches_the_norm_then_the_product(qtype, n, k, m, cfg, n_parts, partials):
    w = _w(qtype, n, k)
    x = _pending(m, k, n_parts, seed=n + m)
    out, residual = fused_qmatmul(x, w, cfg, interpret=True, partials=partials)
    want_residual, normed = add_rms_norm_reference(x.residual, x.parts, x.weight, EPS, jnp.float32)
    np.testing.assert_allclose(np.asarray(residual), np.asarray(want_residual), rtol=1e-6, atol=1e-6)
    want = dequantized_product(normed, w)
    if partials:
        assert out.dtype == jnp.float32 and out.shape == (max(cfg.split_k, 1), m, n)
        assert rel_error(out.sum(0), want) < 1e-5
    else:
        assert out.dtype == jnp.float32 and out.shape == (m, n)
        assert rel_error(out, want) < 1e-5


def test_bf16_rows_within_rounding_of_the_two_kernels():
    """bf16 activations: the kernel multiplies the unrounded float32 rows, so it is at least as
    close to the float32 oracle as the product of the norm's bf16 output."""
    w = _w(QType.Q4_1, 64, 576, seed=5)
    x = _pending(1, 576, 3, seed=6, dtype=jnp.bfloat16)
    cfg = gemv.default_gemv_config(QType.Q4_1, 1, 64, 576)
    out, _ = fused_qmatmul(x, w, cfg, interpret=True)
    assert out.dtype == jnp.bfloat16
    _, normed32 = add_rms_norm_reference(x.residual, x.parts, x.weight, EPS, jnp.float32)
    oracle = dequantized_product(normed32, w)
    two_step = fused_qmatmul(normed32.astype(jnp.bfloat16), w, cfg, interpret=True)
    assert rel_error(out, oracle) <= rel_error(two_step, oracle) + 1e-3


def test_fallback_materializes():
    """Off the kernel (the reference, or tiles that are not CUDA-core ones) the add + norm runs
    first and the product takes its output: the same numbers as doing both by hand."""
    w = _w(QType.Q4_K, 32, 256)
    x = _pending(2, 256, 2, seed=3)
    out, residual = qmatmul_pending_norm(x, w)   # the CPU backend: the reference
    want_residual, normed = add_rms_norm_reference(x.residual, x.parts, x.weight, EPS, jnp.float32)
    np.testing.assert_array_equal(np.asarray(residual), np.asarray(want_residual))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(qmatmul(normed, w, implementation="reference")))
    parts, _ = qmatmul_pending_norm(x.reshape(1, 2), w, partials=True)
    assert parts.shape == (1, 1, 2, 32)
    # Through the interpreter with the leading dims kept: the kernel's tiles at one row.
    x1 = _pending(1, 576, 3, seed=4).reshape(1, 1)
    w1 = _w(QType.Q4_1, 48, 576)
    out, residual = qmatmul_pending_norm(x1, w1, implementation="interpret")
    assert out.shape == (1, 1, 48) and residual.shape == (1, 1, 576)
    _, normed = add_rms_norm_reference(x1.residual, x1.parts, x1.weight, EPS, jnp.float32)
    assert rel_error(out, dequantized_product(normed.reshape(1, 576), w1).reshape(1, 1, 48)) < 1e-5


@pytest.mark.parametrize("cfg,kw,match", [
    (TileConfig(16, 16, 1, method="mma"), {}, "fma"),
])
def test_refusals(cfg, kw, match):
    w = _w(QType.Q8_0, 64, 64)
    with pytest.raises(ValueError, match=match):
        fused_qmatmul(_pending(1, 64, 1, seed=1), w, cfg, interpret=True, **kw)
    bad = PendingNorm(jnp.zeros((1, 64), jnp.bfloat16), None, jnp.ones(64), EPS, jnp.dtype(jnp.bfloat16))
    with pytest.raises(ValueError, match="float32 residual"):
        fused_qmatmul(bad, w, TileConfig(1, 8, 1, method="fma"), interpret=True)


def test_dispatch():
    """On a GPU backend: smollm2's Q4_1 products at one row (the float kernel's CUDA-core
    tiles) yes; two rows, a product on the int8 GEMV, or the switch off, no."""
    for n, k in ((960, 576), (3072, 576)):
        assert takes_pending_norm(_w(QType.Q4_1, n, k), 1, jnp.bfloat16, gpu=True)
        assert not takes_pending_norm(_w(QType.Q4_1, n, k), 2, jnp.bfloat16, gpu=True)
    assert not takes_pending_norm(_w(QType.Q4_K, 2048, 2048), 1, jnp.bfloat16, gpu=True)    # int8 GEMV
    assert not takes_pending_norm(_w(QType.Q6_K, 1024, 1024), 1, jnp.bfloat16, gpu=True)    # wgmma from one row
    assert not takes_pending_norm(jnp.zeros((64, 64)), 1, jnp.bfloat16, gpu=True)           # dense
    off = gemv.TUNING.replace(pending_norm_max_m=0)
    assert not takes_pending_norm(_w(QType.Q4_1, 960, 576), 1, jnp.bfloat16, gpu=True, tuning=off)
    assert not takes_pending_norm(_w(QType.Q4_1, 960, 576), 1, jnp.bfloat16, gpu=False)    # the CPU backend


def test_lowers_to_triton_for_h100():
    from jax._src.pallas.triton import gpu_info

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    n, k = 960, 576
    w = random_qtensor(QType.Q4_1, 1, k)
    w = type(w)(jax.tree.map(lambda a: jax.ShapeDtypeStruct((n,) + a.shape[1:], a.dtype), w.planes), w.qtype, (n, k))
    x = PendingNorm(jax.ShapeDtypeStruct((1, k), jnp.float32), jax.ShapeDtypeStruct((4, 1, k), jnp.float32),
                    jax.ShapeDtypeStruct((k,), jnp.float32), EPS, jnp.dtype(jnp.bfloat16))
    with warnings.catch_warnings(), mock.patch.object(gpu_info, "get_gpu_info", lambda: h100):
        warnings.simplefilter("ignore")
        lowered = jax.jit(lambda x, w: fused_qmatmul(x, w, gemv.default_gemv_config(QType.Q4_1, 1, n, k),
                                                     partials=True)).trace(x, w).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("qtype,n,k,n_parts", [(QType.Q4_1, 960, 576, 4), (QType.Q4_1, 3072, 576, 3),
                                               (QType.Q4_0, 4096, 1024, 2), (QType.Q8_0, 1024, 1024, 0)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_on_gpu(qtype, n, k, n_parts):
    """Compiled, with the model's tiles: the residual exactly, and the product at least as close
    to the float32 oracle as the add + norm kernel followed by the product."""
    from pallas_kernels.rms_norm import add_rms_norm

    w = _w(qtype, n, k, seed=2)
    x = _pending(1, k, n_parts, seed=3, dtype=jnp.bfloat16)
    cfg = gemv.default_gemv_config(qtype, 1, n, k)
    out, residual = jax.jit(lambda x: fused_qmatmul(x, w, cfg))(x)
    two_res, normed = jax.jit(lambda x: add_rms_norm(x.residual, x.parts, x.weight, EPS, jnp.bfloat16))(x)
    np.testing.assert_allclose(np.asarray(residual), np.asarray(two_res), rtol=1e-6, atol=1e-5)
    _, normed32 = add_rms_norm_reference(x.residual, x.parts, x.weight, EPS, jnp.float32)
    oracle = dequantized_product(normed32, w)
    two_step = jax.jit(lambda h: fused_qmatmul(h, w, cfg))(normed)
    assert rel_error(out, oracle) <= rel_error(two_step, oracle) + 1e-3


def test_pending_tiles():
    """The product's own CUDA-core tiles, with more weight rows per program where they would
    make more than PENDING_NORM_MAX_TILES programs (each of which loads x's whole row)."""
    assert gemv.pending_norm_config(_w(QType.Q4_1, 3072, 576), 1, jnp.bfloat16) == \
        gemv.default_gemv_config(QType.Q4_1, 1, 3072, 576)
    wide = gemv.pending_norm_config(_w(QType.Q4_0, 9728, 896), 1, jnp.bfloat16)   # qwen2.5-0.5b's gate/up
    assert (wide.method, wide.block_n, wide.split_k) == ("fma", 16, 1)
    assert gemv.pending_norm_config(_w(QType.Q4_K, 2048, 2048), 1, jnp.bfloat16) is None