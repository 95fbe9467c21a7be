"""The float kernel's tensor-core tiles adding their product to the residual stream and handing
the RMS-normed sum on with its scale pending (`fused_qmatmul_add_norm`, a NormedRows), and the
consumer that applies the scale: in Pallas' interpreter against the plain product then the add
+ norm reference, the reference path, the dispatch, lowered for sm_90, and on the GPU."""
from __future__ import annotations

import unittest.mock as mock
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from pallas_kernels.quant_matmul import fuses_add_norm_rows, gemv, qmatmul, qmatmul_add_norm
from pallas_kernels.quant_matmul.kernel import TileConfig, fused_qmatmul, fused_qmatmul_add_norm
from pallas_kernels.quant_matmul.testing import dequantized_product, random_qtensor, rel_error
from pallas_kernels.rms_norm import NormedRows, add_rms_norm_reference

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
EPS = 1e-5


def _w(qtype, n, k, seed=1):
    return jax.tree.map(jnp.asarray, random_qtensor(qtype, n, k, seed=seed))


def _inputs(m, n, k, seed):
    r = np.random.default_rng(seed)
    return (jnp.asarray(r.standard_normal((m, k)), jnp.bfloat16), jnp.asarray(r.standard_normal((m, n)) * 3, jnp.float32),
            jnp.asarray(r.uniform(0.5, 1.5, n), jnp.float32))


CASES = [
    (QType.Q4_1, 128, 576, 5, TileConfig(16, 64, 8, split_k=3, dequant="bf16x2")),   # smollm2's K, ragged splits
    (QType.Q8_0, 96, 256, 7, TileConfig(16, 32, 2, split_k=2)),                    # f32 dequantization
    (QType.Q4_0, 64, 192, 16, TileConfig(16, 32, 8, dequant="bf16x2")),            # one split
]


@pytest.mark.parametrize("qtype,n,k,m,cfg", CASES, ids=lambda v: v.name if isinstance(v, QType) else str(v))
def test_kernel_matches_the_product_then_add_and_norm(qtype, n, k, m, cfg):
    """The new residual is the residual plus the same tiles' product (up to the order of the
    float32 additions); the rows are bf16(sum * weight) and their sums of squares per 32 values
    those of the sum; the counts come back zeroed, so a second call with them gives the same."""
    w = _w(qtype, n, k)
    x, residual, norm_w = _inputs(m, n, k, seed=n + m)
    counts = jnp.zeros((n // 32,), jnp.int32)
    x_out, normed, counts = fused_qmatmul_add_norm(x, w, cfg, residual, norm_w, counts, EPS, interpret=True)
    assert not np.asarray(counts).any()
    want = residual + fused_qmatmul(x, w, cfg, interpret=True, partials=True).sum(0)
    np.testing.assert_allclose(np.asarray(x_out), np.asarray(want), rtol=1e-6, atol=1e-5)
    assert normed.x.dtype == jnp.bfloat16 and normed.ss.shape == (m, n // 32)
    np.testing.assert_array_equal(np.asarray(normed.x, np.float32),
                                  np.asarray((x_out * norm_w).astype(jnp.bfloat16), np.float32))
    np.testing.assert_allclose(np.asarray(normed.ss), np.asarray(jnp.square(x_out).reshape(m, n // 32, 32).sum(-1)),
                               rtol=1e-5)
    _, want_normed = add_rms_norm_reference(x_out, None, norm_w, EPS, jnp.float32)
    assert rel_error(normed.materialize(), want_normed) < 8e-3    # bf16's rounding
    again, _, counts = fused_qmatmul_add_norm(x, w, cfg, residual, norm_w, counts, EPS, interpret=True)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(x_out))


@pytest.mark.parametrize("qtype,cfg", [(QType.Q4_1, TileConfig(16, 32, 4, split_k=2, dequant="bf16x2")),
                                       (QType.Q8_0, TileConfig(16, 16, 2, split_k=3))],
                         ids=lambda v: v.name if isinstance(v, QType) else str(v))
def test_consumer_applies_the_scale(qtype, cfg):
    """A product of NormedRows scales its sums by each row's 1/rms: as close to the float32
    oracle as the product of the normed rows rounded to bf16 (the two-kernel path)."""
    r = np.random.default_rng(3)
    h = jnp.asarray(r.standard_normal((5, 256)) * 2, jnp.float32)
    norm_w = jnp.asarray(r.uniform(0.5, 1.5, 256), jnp.float32)
    rows = NormedRows((h * norm_w).astype(jnp.bfloat16), jnp.square(h).reshape(5, 8, 32).sum(-1), EPS)
    w = _w(qtype, 48, 256, seed=4)
    _, normed32 = add_rms_norm_reference(h, None, norm_w, EPS, jnp.float32)
    oracle = dequantized_product(normed32, w)
    got = fused_qmatmul(rows, w, cfg, interpret=True)
    two_step = fused_qmatmul(normed32.astype(jnp.bfloat16), w, cfg, interpret=True)
    assert got.dtype == jnp.bfloat16 and rel_error(got, oracle) <= 1.5 * rel_error(two_step, oracle) + 1e-3
    parts = fused_qmatmul(rows, w, cfg, interpret=True, partials=True)
    assert rel_error(parts.sum(0), oracle) <= 1.5 * rel_error(two_step, oracle) + 1e-3
    # every other consumer materializes them
    np.testing.assert_array_equal(np.asarray(qmatmul(rows, w, implementation="reference")),
                                  np.asarray(qmatmul(rows.materialize(), w, implementation="reference")))


def test_every_decode_kernel_takes_it():
    """Off the tensor-core tiles (one row on CUDA-core tiles, rows on the int8 GEMV) the rows
    are materialized first: the same numbers as passing the normed rows."""
    r = np.random.default_rng(5)
    for qtype, m in ((QType.Q4_1, 1), (QType.Q8_0, 2)):
        h = jnp.asarray(r.standard_normal((m, 256)), jnp.float32)
        rows = NormedRows(h.astype(jnp.bfloat16), jnp.square(h).reshape(m, 8, 32).sum(-1), EPS)
        w = _w(qtype, 64, 256, seed=6)
        np.testing.assert_array_equal(np.asarray(qmatmul(rows, w, implementation="interpret"), np.float32),
                                      np.asarray(qmatmul(rows.materialize(), w, implementation="interpret"), np.float32))


def test_reference_path():
    """The reference (CPU plans, tests) computes what the kernel hands over, in plain JAX."""
    w = _w(QType.Q4_1, 64, 192)
    x, residual, norm_w = _inputs(3, 64, 192, seed=2)
    counts = jnp.zeros((2,), jnp.int32)
    x_out, normed, back = qmatmul_add_norm(x, w, residual, norm_w, EPS, counts, jnp.bfloat16, rows=True,
                                           implementation="reference")
    want = residual + qmatmul(x, w, implementation="reference").astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(x_out), np.asarray(want), rtol=1e-6, atol=1e-5)
    assert isinstance(normed, NormedRows) and back is counts
    _, want_normed = add_rms_norm_reference(x_out, None, norm_w, EPS, jnp.float32)
    assert rel_error(normed.materialize(), want_normed) < 8e-3
    got, _, _ = qmatmul_add_norm(x[None], w, residual[None], norm_w, EPS, counts, jnp.bfloat16, rows=True,
                                 implementation="interpret")
    assert got.shape == (1, 3, 64)
    assert rel_error(got[0], np.asarray(x_out)) < 5e-3    # the kernel's tiles: the weights in bf16


def test_dispatch():
    """On a GPU backend: smollm2's Q4_1 output and down products at 2..16 rows, feeding Q4_1
    products, yes; one row (the CUDA-core tiles), 17 rows, a dense consumer (XLA's dot), the
    switch off or the CPU backend, no."""
    o, gate_up = _w(QType.Q4_1, 576, 576), _w(QType.Q4_1, 3072, 576)
    for m in (2, 5, 16):
        assert fuses_add_norm_rows(o, m, jnp.bfloat16, [gate_up], gpu=True)
    assert not fuses_add_norm_rows(o, 1, jnp.bfloat16, [gate_up], gpu=True)
    assert not fuses_add_norm_rows(o, 17, jnp.bfloat16, [gate_up], gpu=True)
    assert not fuses_add_norm_rows(o, 5, jnp.bfloat16, [jnp.zeros((1024, 576), jnp.bfloat16)], gpu=True)
    assert not fuses_add_norm_rows(o, 5, jnp.bfloat16, [gate_up], gpu=True,
                                   tuning=gemv.TUNING.replace(rows_add_norm_max_m=0))
    assert not fuses_add_norm_rows(o, 5, jnp.bfloat16, [gate_up], gpu=False)


def test_refusals():
    w = _w(QType.Q8_0, 64, 64)
    x, residual, norm_w = _inputs(2, 64, 64, seed=1)
    counts = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="'mma' tiles over one M tile"):
        fused_qmatmul_add_norm(x, w, TileConfig(2, 8, 1, method="fma"), residual, norm_w, counts, EPS, interpret=True)
    with pytest.raises(ValueError, match="do not match"):
        fused_qmatmul_add_norm(x, w, TileConfig(16, 32, 1), residual, norm_w, counts[:1], EPS, interpret=True)
    rows = NormedRows(x, jnp.ones((2, 2), jnp.float32), EPS)
    with pytest.raises(ValueError, match="scaled by 'mma' tiles"):
        fused_qmatmul(rows, w, TileConfig(2, 8, 1, method="fma"), interpret=True)


def test_lowers_to_triton_for_h100():
    from jax._src.pallas.triton import gpu_info

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    w = _w(QType.Q4_1, 576, 576)
    cfg = gemv.bf16x2_config(w, 5, jnp.bfloat16)
    x, residual, norm_w = _inputs(5, 576, 576, seed=1)
    with warnings.catch_warnings(), mock.patch.object(gpu_info, "get_gpu_info", lambda: h100):
        warnings.simplefilter("ignore")
        lowered = jax.jit(lambda x, r, c: fused_qmatmul_add_norm(x, w, cfg, r, norm_w, c, EPS)).trace(
            x, residual, jnp.zeros((18,), jnp.int32)).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 5, 16])
def test_on_gpu(m):
    """Compiled, with the model's tiles at smollm2's shapes (down, then gate/up): the residual
    as the product plus the residual, the rows as the add + norm kernel's within bf16's
    rounding, the counts zeroed over repeated calls, and the consumer as close to the float32
    oracle as the two-kernel path."""
    from pallas_kernels.rms_norm import add_rms_norm

    down, gate_up = _w(QType.Q4_1, 576, 1536, seed=2), _w(QType.Q4_1, 3072, 576, seed=3)
    x, residual, norm_w = _inputs(m, 576, 1536, seed=m)
    cfg, cfg2 = gemv.bf16x2_config(down, m, jnp.bfloat16), gemv.bf16x2_config(gate_up, m, jnp.bfloat16)
    counts = jnp.zeros((18,), jnp.int32)
    for _ in range(3):
        x_out, normed, counts = fused_qmatmul_add_norm(x, down, cfg, residual, norm_w, counts, EPS)
    assert not np.asarray(counts).any()
    want = residual + jax.jit(lambda x: fused_qmatmul(x, down, cfg, partials=True).sum(0))(x)
    np.testing.assert_allclose(np.asarray(x_out), np.asarray(want), rtol=1e-5, atol=1e-4)
    _, two_rows = jax.jit(lambda r: add_rms_norm(r, None, norm_w, EPS, jnp.bfloat16))(x_out)
    assert rel_error(normed.materialize(), two_rows) < 8e-3
    _, normed32 = add_rms_norm_reference(x_out, None, norm_w, EPS, jnp.float32)
    oracle = dequantized_product(normed32, gate_up)
    got = jax.jit(lambda r: fused_qmatmul(r, gate_up, cfg2))(normed)
    two_step = jax.jit(lambda h: fused_qmatmul(h, gate_up, cfg2))(two_rows)
    assert rel_error(got, oracle) <= 1.5 * rel_error(two_step, oracle) + 1e-3
