"""GatedX: the FFN's [gate | up] handed to the down product, whose decode kernels apply the GLU
as they load x. The int8 GEMV must equal the product of the GLU kernel's rounded output bit for
bit (the same rounding of the same float32 values); the float kernel must match the product of
the materialized act(gate) * up; qmatmul materializes it for every other path; the model's FFN
takes it when the dispatch says so, with the same logits."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from pallas_kernels.int8_activations import GatedX, glu, quantize
from pallas_kernels.quant_matmul import qmatmul, takes_gated_x
from pallas_kernels.quant_matmul.int8_gemv import Int8GemvConfig, as_words, int8_gemv
from pallas_kernels.quant_matmul.kernel import TileConfig, fused_qmatmul
from pallas_kernels.quant_matmul.testing import random_qtensor

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _gate_up(m, k, seed, dtype=jnp.bfloat16):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((m, 2 * k)) * 2, dtype)


def _w(qtype, n, k, seed):
    return jax.tree.map(jnp.asarray, random_qtensor(qtype, n, k, seed=seed))


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m,cfg", [(1, Int8GemvConfig(16, 2)), (2, Int8GemvConfig(8, 1, split_k=3)),
                                   (3, Int8GemvConfig(8, 1))])
def test_int8_gemv_equals_the_glu_kernel_then_the_product(qtype, activation, m, cfg):
    k = 768 if qtype == QType.Q4_K else 384
    w = _w(qtype, 40, k, m)
    if qtype == QType.Q4_K:
        w = as_words(w)
    gu = _gate_up(m, k, m + 5)
    got = int8_gemv(GatedX(gu, activation), w, cfg, interpret=True)      # M <= 2: rounded in the kernel
    want = int8_gemv(quantize(gu, activation, implementation="interpret"), w, cfg, interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0, QType.Q6_K, QType.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("m,cfg", [(1, TileConfig(1, 8, 1, split_k=2, method="fma")),
                                   (5, TileConfig(16, 16, 1, method="mma"))])
def test_float_kernel_matches_the_materialized_glu(qtype, m, cfg):
    k = 512 if qtype in (QType.Q6_K, QType.Q4_K) else 192
    w = _w(qtype, 24, k, 3)
    gx = GatedX(_gate_up(m, k, 9), "silu")
    got = fused_qmatmul(gx, w, cfg, interpret=True)
    assert got.shape == (m, 24) and got.dtype == jnp.bfloat16
    # Against the float32 product of the float32 GLU: the kernel rounds act(gate) * up to bf16
    # for the MMA (the fma path keeps float32) and its output to bf16.
    want = np.asarray(qmatmul(glu(gx.gate_up, "silu"), w, implementation="reference"), np.float64)
    err = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
    assert err < 1e-2
    plain = np.asarray(fused_qmatmul(gx.materialize(), w, cfg, interpret=True), np.float64)
    assert err < 2 * np.linalg.norm(plain - want) / np.linalg.norm(want) + 1e-3  # no worse than the XLA path


def test_qmatmul_takes_it_on_every_path():
    w = _w(QType.Q4_1, 24, 192, 4)
    gx = GatedX(_gate_up(3, 192, 2, jnp.float32), "silu")
    want = qmatmul(gx.materialize(), w, implementation="reference")
    np.testing.assert_array_equal(np.asarray(qmatmul(gx, w, implementation="reference")), np.asarray(want))
    for impl in ("interpret",):  # the decode GEMV (3 rows) and, over 64 rows, the prefill GEMM
        np.testing.assert_allclose(np.asarray(qmatmul(gx, w, implementation=impl)), np.asarray(want),
                                   rtol=1e-5, atol=1e-5)
    big = GatedX(_gate_up(70, 192, 3, jnp.float32), "silu")
    np.testing.assert_allclose(np.asarray(qmatmul(big, w, implementation="interpret")),
                               np.asarray(qmatmul(big.materialize(), w, implementation="reference")), rtol=1e-4,
                               atol=1e-4)
    parts = qmatmul(gx, w, implementation="interpret", partials=True)
    np.testing.assert_allclose(np.asarray(parts.sum(0)), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert not takes_gated_x(w, 1, jnp.bfloat16)  # the CPU backend: never


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_1], ids=lambda t: t.name)
def test_both_kernels_lower_to_triton_for_h100(qtype):
    import unittest.mock as mock
    import warnings

    from jax._src.pallas.triton import gpu_info

    from pallas_kernels.quant_matmul import gemv

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    n, k = 2048, 8192
    w = random_qtensor(qtype, 1, k)
    w = type(w)(jax.tree.map(lambda a: jax.ShapeDtypeStruct((n,) + a.shape[1:], a.dtype), w.planes), qtype, (n, k))
    x = GatedX(jax.ShapeDtypeStruct((1, 2 * k), jnp.bfloat16), "silu")
    with warnings.catch_warnings(), mock.patch.object(gpu_info, "get_gpu_info", lambda: h100):
        warnings.simplefilter("ignore")
        for fn, cfg in ((int8_gemv, gemv.default_int8_config(qtype, 1, n, k)),
                        (fused_qmatmul, gemv.default_gemv_config(qtype, 1, n, k))):
            lowered = jax.jit(fn, static_argnames=("cfg", "interpret")).trace(x, w, cfg).lower(
                lowering_platforms=("cuda",))
            assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_1, QType.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 5])
def test_gpu_kernels_apply_the_glu(qtype, m):
    """Compiled for the GPU: the int8 GEMV equals the GLU kernel then the product exactly, and
    the float kernel (the model's tiles) is as close to the float32 oracle as with XLA's GLU."""
    from pallas_kernels.quant_matmul import gemv

    n, k = 2048, 8192 if qtype != QType.Q4_K else 4096
    w = _w(qtype, n, k, 1)
    if qtype == QType.Q4_K:
        w = as_words(w)
    gu = _gate_up(m, k, 2)
    if m <= gemv.int8.MAX_M:
        cfg = gemv.default_int8_config(qtype, m, n, k)
        got = int8_gemv(GatedX(gu, "silu"), w, cfg)
        want = int8_gemv(quantize(gu, "silu"), w, cfg)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    cfg = gemv.default_gemv_config(qtype, m, n, k)
    oracle = np.asarray(qmatmul(glu(gu, "silu"), w, implementation="reference"), np.float64)
    rel = lambda out: np.linalg.norm(np.asarray(out, np.float64) - oracle) / np.linalg.norm(oracle)  # noqa: E731
    assert rel(fused_qmatmul(GatedX(gu, "silu"), w, cfg)) < 2 * rel(fused_qmatmul(GatedX(gu, "silu").materialize(), w,
                                                                                  cfg)) + 1e-3


def test_dispatch_takes_it_on_the_float_kernels_cuda_core_tiles():
    """On a GPU backend, at one row: a Q4_1 down product on the float kernel yes; one on the
    int8 GEMV or on the wgmma kernel (Q6_K from one row), or two rows, no."""

    from pallas_kernels.quant_matmul import gemv

    assert takes_gated_x(_w(QType.Q4_1, 576, 1536, 0), 1, jnp.bfloat16, gpu=True)
    assert not takes_gated_x(_w(QType.Q4_1, 576, 1536, 0), 2, jnp.bfloat16, gpu=True)
    assert not takes_gated_x(_w(QType.Q4_K, 2048, 8192, 0), 1, jnp.bfloat16, gpu=True)
    assert not takes_gated_x(_w(QType.Q6_K, 2048, 8192, 0), 1, jnp.bfloat16, gpu=True)
    assert not takes_gated_x(_w(QType.Q4_1, 576, 1536, 0), 1, jnp.bfloat16, gpu=True,
                             tuning=gemv.TUNING.replace(gated_x_max_m=0))
