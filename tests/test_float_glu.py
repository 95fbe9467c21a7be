"""The float kernel's gate/up product that applies the GLU as it stores its rows
(`fused_qmatmul(..., glu=)`, dispatched by `qmatmul_glu` for a plain x): in Pallas' interpreter
against gguf-py's dequantized weight, its tiles and refusals, lowered for sm_90, and on the GPU
against the product followed by XLA's act(gate) * up."""
from __future__ import annotations

import unittest.mock as mock
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from pallas_kernels.int8_activations import glu
from pallas_kernels.quant_matmul import gemv, qmatmul, qmatmul_glu
from pallas_kernels.quant_matmul.kernel import TileConfig, fused_qmatmul
from pallas_kernels.quant_matmul.testing import dequantized_product, random_qtensor, rel_error

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _rows(m, k, seed, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k)), dtype)


@pytest.mark.parametrize("qtype,f,m,cfg,activation", [
    (QType.Q4_1, 40, 1, TileConfig(1, 8, 2, method="fma"), "silu"),       # F not a multiple of the tile
    (QType.Q8_0, 64, 3, TileConfig(4, 16, 1, method="fma"), "gelu_tanh"),
    (QType.Q4_0, 32, 1, TileConfig(1, 4, 4, method="fma"), "silu"),
    (QType.Q4_K, 16, 2, TileConfig(2, 8, 1, method="fma"), "silu"),
], ids=lambda v: v.name if isinstance(v, QType) else str(v))
def test_glu_matches_plain_jax(qtype, f, m, cfg, activation):
    """act(x @ gate.T) * (x @ up.T) with gguf-py's dequantized [gate; up], float32 x."""
    k = 512 if qtype == QType.Q4_K else 6 * 32
    w = jax.tree.map(jnp.asarray, random_qtensor(qtype, 2 * f, k, seed=f + m))
    x = _rows(m, k, seed=m)
    got = fused_qmatmul(x, w, cfg, interpret=True, glu=activation)
    assert got.shape == (m, f) and got.dtype == x.dtype
    want = glu(jnp.asarray(dequantized_product(x, w), jnp.float32), activation)
    assert rel_error(got, np.asarray(want, np.float64)) < 1e-5


def test_glu_bf16_rows_through_qmatmul_glu():
    """The dispatch's entry for a plain x: bf16 rows, the tiles `float_glu_config` picks, the
    same values as the product in bf16 followed by the activation (up to bf16 rounding)."""
    qtype, f, k = QType.Q4_1, 48, 4 * 32
    w = jax.tree.map(jnp.asarray, random_qtensor(qtype, 2 * f, k, seed=3))
    x = _rows(1, k, seed=4, dtype=jnp.bfloat16)
    got = qmatmul_glu(x, w, "silu", jnp.bfloat16, interpret=True)
    assert got.shape == (1, f) and got.dtype == jnp.bfloat16
    gate_up = qmatmul(x, w, implementation="interpret").astype(jnp.float32)
    want = glu(gate_up, "silu")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2,
                               atol=2e-2 * float(jnp.abs(want).max()))


def test_float_glu_tiles():
    """One split always; rows per program halved until the half has the type's program count;
    no tiles off the CUDA-core path."""
    cfg = gemv.float_glu_config(QType.Q4_1, 1, 3072, 576)       # smollm2's gate/up: F = 1536
    assert cfg.method == "fma" and cfg.split_k == 1 and cfg.block_n == 4 and cfg.block_m == 1
    assert gemv.float_glu_config(QType.Q8_0, 1, 2 * 8192, 2048).block_n == 16
    assert gemv.float_glu_config(QType.Q4_K, 1, 3072, 576) is None   # tensor-core tiles at M=1
    assert gemv.float_glu_config(QType.Q4_1, 2, 3072, 576) is None


@pytest.mark.parametrize("cfg,rows,activation,match", [
    (TileConfig(16, 16, 1, method="mma"), 64, "silu", "fma"),
    (TileConfig(1, 8, 1, split_k=2, method="fma"), 64, "silu", "split_k 1"),
    (TileConfig(1, 8, 1, method="fma"), 63, "silu", "even row count"),
    (TileConfig(1, 8, 1, method="fma"), 64, "relu", "activation"),
])
def test_glu_refusals(cfg, rows, activation, match):
    w = jax.tree.map(jnp.asarray, random_qtensor(QType.Q8_0, rows, 64, seed=1))
    with pytest.raises(ValueError, match=match):
        fused_qmatmul(_rows(1, 64, seed=1), w, cfg, interpret=True, glu=activation)


def test_glu_lowers_to_triton_for_h100():
    from jax._src.pallas.triton import gpu_info

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    n, k = 3072, 576
    w = jax.tree.map(jnp.asarray, random_qtensor(QType.Q4_1, 1, k))
    w = type(w)(jax.tree.map(lambda a: jax.ShapeDtypeStruct((n,) + a.shape[1:], a.dtype), w.planes), w.qtype, (n, k))
    x = jax.ShapeDtypeStruct((1, k), jnp.bfloat16)
    with warnings.catch_warnings(), mock.patch.object(gpu_info, "get_gpu_info", lambda: h100):
        warnings.simplefilter("ignore")
        lowered = jax.jit(lambda x, w: fused_qmatmul(x, w, gemv.float_glu_config(QType.Q4_1, 1, n, k),
                                                     glu="silu")).trace(x, w).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("qtype,f,k", [(QType.Q4_1, 1536, 576), (QType.Q4_1, 8960, 1536), (QType.Q8_0, 4096, 1024)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_glu_on_gpu(qtype, f, k):
    """The production tiles against the product and XLA's act(gate) * up they replace, and
    against gguf-py's dequantized weight."""
    w = jax.tree.map(jnp.asarray, random_qtensor(qtype, 2 * f, k, seed=3))
    x = _rows(1, k, 4, dtype=jnp.bfloat16)
    got = jax.jit(lambda x: qmatmul_glu(x, w, "silu", jnp.bfloat16))(x)
    gate_up = jax.jit(lambda x: qmatmul(x, w))(x)
    two_step = np.asarray(glu(gate_up, "silu"))
    scale = float(np.abs(two_step).max())
    np.testing.assert_allclose(np.asarray(got, np.float32), two_step, rtol=0, atol=2e-2 * scale)
    want = glu(jnp.asarray(dequantized_product(x.astype(jnp.float32), w), jnp.float32), "silu")
    assert rel_error(got.astype(jnp.float32), np.asarray(want, np.float64)) < 1e-2


def test_dispatch_takes_the_float_glu_where_both_products_are_float():
    """`fuses_glu` on a GPU backend with the switch on: smollm2's Q4_1 FFN (both products on the
    float kernel) yes; an FFN whose products run on the int8 GEMV, or more rows, no."""
    from pallas_kernels import quant_matmul

    def w(qtype, n, k):
        return jax.tree.map(jnp.asarray, random_qtensor(qtype, n, k, seed=0))

    gate_up, down = w(QType.Q4_1, 3072, 576), w(QType.Q4_1, 576, 1536)
    with mock.patch.object(jax, "default_backend", lambda: "gpu"), mock.patch.object(gemv, "FLOAT_GLU_MAX_M", 1):
        assert not quant_matmul.fuses_glu(gate_up, down, 1, jnp.bfloat16)  # the down product takes a GatedX
    with (mock.patch.object(jax, "default_backend", lambda: "gpu"), mock.patch.object(gemv, "FLOAT_GLU_MAX_M", 1),
          mock.patch.object(gemv, "GATED_X_MAX_M", 0)):
        assert quant_matmul.fuses_glu(gate_up, down, 1, jnp.bfloat16)
        assert not quant_matmul.fuses_glu(gate_up, down, 2, jnp.bfloat16)
        assert not quant_matmul.fuses_glu(w(QType.Q8_0, 3072, 576), w(QType.Q8_0, 576, 1536), 1, jnp.bfloat16)
    with mock.patch.object(jax, "default_backend", lambda: "gpu"):
        assert not quant_matmul.fuses_glu(gate_up, down, 1, jnp.bfloat16)   # off by default
