"""The int8 tensor-core skinny GEMM (pallas_kernels.quant_matmul.int8_mma) in Pallas' CPU
interpreter, lowered for the H100 without one, and compiled on the GPU when there is one.

Oracles as for the int8 GEMV: gguf-py's dequantized weight times the *rounded* activations
(`dequantize_x(quantize_x(x))`), matched to float32 accumulation error (<= 1e-6 relative,
float32 x and output), and times the exact activations, off by the int8 rounding of x only
(<= 1.5e-2 relative, bf16).
"""
from __future__ import annotations

import unittest.mock as mock
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from pallas_kernels.int8_activations import dequantize_x, quantize_x
from pallas_kernels.quant_matmul import int8_mma
from pallas_kernels.quant_matmul.int8_mma import Int8MmaConfig, int8_lanes
from pallas_kernels.quant_matmul.testing import dequantized_product, random_qtensor, rel_error
from rjax.quant.reference import q4_k_chunks
from rjax.quant.words import as_words

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
ROUNDED_TOL, EXACT_TOL = 1e-6, 1.5e-2
LAYOUTS = {  # as a GPU model holds them (rjax.model.gpu_weight_layout), and Q8_0 on words
    "q8_0-bytes": (QType.Q8_0, lambda w: w),
    "q8_0-words": (QType.Q8_0, as_words),
    "q4_k-chunks-words": (QType.Q4_K, lambda w: as_words(q4_k_chunks(w))),
}


def _weight(name, n, k, seed):
    qtype, layout = LAYOUTS[name]
    w = jax.tree.map(jnp.asarray, random_qtensor(qtype, n, k, seed=seed))
    return w, layout(w)


_oracle, _rel = dequantized_product, rel_error


def _x(m, k, seed, dtype=jnp.bfloat16):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k)), dtype)


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("m,cfg", [(3, Int8MmaConfig(16, 2)), (16, Int8MmaConfig(32, 1, split_k=3)),
                                   (40, Int8MmaConfig(16, 4, split_k=2))])
def test_int8_mma_matches_rounded_activations(name, m, cfg):
    """Edge tiles everywhere: 40 weight rows (not a multiple of block_n), 3 super-blocks or 9
    blocks per row (not a multiple of block_k or of the K split), M padded to the MMA tile."""
    qtype = LAYOUTS[name][0]
    k = 3 * 256 if qtype == QType.Q4_K else 9 * 32
    w_file, w = _weight(name, 40, k, seed=m)
    x = _x(m, k, seed=m + 10)
    out32 = int8_mma.int8_mma(x.astype(jnp.float32), w, cfg, interpret=True)
    assert out32.shape == (m, 40) and out32.dtype == jnp.float32
    assert _rel(out32, _oracle(dequantize_x(quantize_x(x.astype(jnp.float32))), w_file)) < ROUNDED_TOL
    out = int8_mma.int8_mma(x, w, cfg, interpret=True)
    assert out.dtype == jnp.bfloat16
    assert _rel(out, _oracle(x, w_file)) < EXACT_TOL


def test_int8_mma_takes_rounded_x_and_gives_partials():
    """A QuantizedX from the producer gives the same sums as raw x rounded by the kernel's
    caller; with `partials` the split-K sums come back unsummed."""
    w_file, w = _weight("q4_k-chunks-words", 24, 512, seed=3)
    x = _x(8, 512, seed=4, dtype=jnp.float32)
    cfg = Int8MmaConfig(16, 1, split_k=2)
    raw = int8_mma.int8_mma(x, w, cfg, interpret=True)
    rounded = int8_mma.int8_mma(quantize_x(x), w, cfg, interpret=True)   # a QuantizedX's dtype: bf16
    assert rounded.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(raw.astype(jnp.bfloat16)), np.asarray(rounded))
    parts = int8_mma.int8_mma(x, w, cfg, interpret=True, partials=True)
    assert parts.shape == (2, 8, 24) and parts.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(parts.sum(0)), np.asarray(raw), rtol=1e-6, atol=1e-6)


def test_int8_lanes_byte_order():
    """Both sides of the product are unpacked alike, in little-endian byte order."""
    rng = np.random.default_rng(0)
    b = rng.integers(-128, 128, (3, 16), dtype=np.int8)
    words = jnp.asarray(b.view(np.int32))
    np.testing.assert_array_equal(np.asarray(int8_lanes(words, signed=True)), b)
    np.testing.assert_array_equal(np.asarray(int8_lanes(words & 0x0F0F0F0F, signed=False)), b.view(np.uint8) & 15)


def test_int8_mma_rejects_what_it_cannot_do():
    _, w = _weight("q8_0-bytes", 16, 64, seed=0)
    with pytest.raises(ValueError, match="M must be 1..64"):
        int8_mma.int8_mma(_x(65, 64, seed=1), w, interpret=True)
    with pytest.raises(ValueError, match="block_n=8"):
        int8_mma.int8_mma(_x(2, 64, seed=1), w, Int8MmaConfig(8, 1), interpret=True)
    file_layout = jax.tree.map(jnp.asarray, random_qtensor(QType.Q4_K, 16, 256))
    with pytest.raises(NotImplementedError, match="Q4_K in layout Q4_K"):
        int8_mma.int8_mma(_x(2, 256, seed=1), file_layout, interpret=True)
    with pytest.raises(NotImplementedError, match="Q6_K"):
        int8_mma.int8_mma(_x(2, 256, seed=1), jax.tree.map(jnp.asarray, random_qtensor(QType.Q6_K, 16, 256)),
                          interpret=True)


@pytest.mark.parametrize("name", ["q8_0-bytes", "q4_k-chunks-words"])
def test_int8_mma_lowers_to_triton_for_h100(name):
    """The kernel lowers to a Triton module for sm_90 without a GPU."""
    from jax._src.pallas.triton import gpu_info

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    n, k = 4096, 4096
    _, w = _weight(name, 1, k, seed=0)
    w = type(w)(jax.tree.map(lambda a: jax.ShapeDtypeStruct((n,) + a.shape[1:], a.dtype), w.planes), w.qtype, (n, k))
    x = jax.ShapeDtypeStruct((16, k), jnp.bfloat16)
    with warnings.catch_warnings(), mock.patch.object(gpu_info, "get_gpu_info", lambda: h100):
        warnings.simplefilter("ignore")
        lowered = jax.jit(int8_mma.int8_mma, static_argnames=("cfg", "interpret")).trace(
            x, w, Int8MmaConfig(64, 4, split_k=4)).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("name", ["q8_0-bytes", "q4_k-chunks-words"])
@pytest.mark.parametrize("m", [5, 16, 33])
def test_gpu_int8_mma_matches_rounded_activations(name, m):
    """Compiled (the integer MMA's PTX), at a layer shape: the same sums as the oracle."""
    n, k = 1024, 4096
    w_file, w = _weight(name, n, k, seed=m)
    x = _x(m, k, seed=m + 1, dtype=jnp.float32)
    out = int8_mma.int8_mma(x, w, Int8MmaConfig(64, 4, split_k=4))
    assert _rel(out, _oracle(dequantize_x(quantize_x(x)), w_file)) < ROUNDED_TOL


def test_dispatch_takes_it_beyond_the_dp4a_rows_when_switched_on(monkeypatch):
    """Switched on, bf16 decode products of Q4_K (GPU layout) past the dp4a kernel's rows, up to
    MMA_MAX_M, go to this kernel with the default tiles; float32 x, Q4_K in the file's layout,
    rows past the limit, or INT8_MMA_MAX_M = 0 keep the float kernel."""
    from pallas_kernels.quant_matmul import gemv, qmatmul

    big = (4096, 4096)
    _, w = _weight("q4_k-chunks-words", 64, 4096, seed=1)
    w_big = type(w)(w.planes, w.qtype, big)   # int8_path reads only the type, layout and shape
    assert gemv.int8_path(w_big, 8, jnp.bfloat16) is None          # switched off by default
    monkeypatch.setattr(gemv, "INT8_MMA_MAX_M", 64)
    assert gemv.int8_path(w_big, 4, jnp.bfloat16) == "gemv"
    assert gemv.int8_path(w_big, 8, jnp.bfloat16) == "mma"
    assert gemv.int8_path(w_big, 16, jnp.bfloat16) == "mma"
    assert gemv.int8_path(w_big, 17, jnp.bfloat16) is None
    monkeypatch.setattr(gemv, "INT8_MMA_MAX_M", 0)
    assert gemv.int8_path(w_big, 8, jnp.bfloat16) is None          # switched off
    monkeypatch.setattr(gemv, "INT8_MMA_MAX_M", 64)
    assert gemv.int8_path(w_big, 8, jnp.float32) is None
    file_layout = jax.tree.map(jnp.asarray, random_qtensor(QType.Q4_K, 1, 256))
    assert gemv.int8_path(type(file_layout)(file_layout.planes, QType.Q4_K, big), 8, jnp.bfloat16) is None

    monkeypatch.setattr(gemv, "INT8_MIN_VALUES_ROUNDED_FIRST", 0)
    x = _x(8, 4096, seed=2)
    out = qmatmul(x, w, implementation="interpret")
    want = int8_mma.int8_mma(x, w, gemv.default_mma_config(QType.Q4_K, 8, 64, 4096), interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
