"""The int8 decode GEMV (pallas_kernels.quant_matmul.int8_gemv) in Pallas' CPU interpreter.

Two oracles: the float64 product of gguf-py's dequantized weight with the *rounded*
activations the kernel multiplies (`dequantize_x(quantize_x(x))`), which it must match to
float32 accumulation error (<= 1e-6 relative); and the product with the exact activations,
off by the int8 rounding of x only (<= 1.5e-2 relative, ~5e-3 measured).
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

from pallas_kernels.quant_matmul import gemv, int8_gemv, qmatmul
from pallas_kernels.quant_matmul.int8_formats import dp4a
from pallas_kernels.quant_matmul.int8_gemv import Int8GemvConfig, as_words, dequantize_x, quantize_x
from pallas_kernels.quant_matmul.testing import dequantized_product, random_qtensor, rel_error
from gguf_blocks.reference import q4_k_chunks

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
TYPES = list(int8_gemv.FORMATS)
ROUNDED_TOL, EXACT_TOL = 1e-6, 1.5e-2


_oracle, _rel = dequantized_product, rel_error


def _x(m, k, seed, dtype=jnp.bfloat16):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k)), dtype)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("layout", ["bytes", "words"])
@pytest.mark.parametrize("m,cfg", [(1, Int8GemvConfig(16, 2)), (3, Int8GemvConfig(8, 1, split_k=3)),
                                   (1, Int8GemvConfig(4, 4, split_k=2))])
def test_int8_gemv_matches_rounded_activations(qtype, layout, m, cfg):
    """Edge tiles everywhere: 40 rows (not a multiple of block_n), 3 or 9 blocks per row (not
    a multiple of block_k or of the K split)."""
    bs = gguf.GGML_QUANT_SIZES[qtype][0]
    k = 3 * bs if bs == 256 else 9 * bs
    w = jax.tree.map(jnp.asarray, random_qtensor(qtype, 40, k, seed=m))
    x = _x(m, k, seed=m + 10)
    out = int8_gemv.int8_gemv(x, as_words(w) if layout == "words" else w, cfg, interpret=True)
    assert out.shape == (m, 40) and out.dtype == jnp.bfloat16
    out32 = int8_gemv.int8_gemv(x.astype(jnp.float32), w, cfg, interpret=True)
    assert _rel(out32, _oracle(dequantize_x(quantize_x(x)), w)) < ROUNDED_TOL
    assert _rel(out, _oracle(x, w)) < EXACT_TOL


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q8_0], ids=lambda t: t.name)
def test_int8_gemv_sixteen_rows(qtype):
    """The most rows a call takes (x rounded first, as beyond two rows always)."""
    k = 512 if qtype == QType.Q4_K else 256
    w = jax.tree.map(jnp.asarray, random_qtensor(qtype, 24, k, seed=16))
    x = _x(int8_gemv.MAX_M, k, seed=17)
    out = int8_gemv.int8_gemv(x, as_words(w) if qtype == QType.Q4_K else w, Int8GemvConfig(8, 1), interpret=True)
    assert out.shape == (16, 24)
    assert _rel(out, _oracle(dequantize_x(quantize_x(x)), w)) < 1e-2  # bf16 output
    with pytest.raises(ValueError, match="M must be 1..16"):
        int8_gemv.int8_gemv(_x(17, k, seed=1), w, Int8GemvConfig(8, 1), interpret=True)


@pytest.mark.parametrize("m,cfg", [(1, Int8GemvConfig(16, 2)), (2, Int8GemvConfig(8, 1, split_k=3, prefetch=False))])
def test_int8_gemv_q4_k_chunks_equals_packed_scales(m, cfg):
    """The GPU layout of Q4_K (scales per quant chunk) gives the same sums, bit for bit."""
    w = jax.tree.map(jnp.asarray, random_qtensor(QType.Q4_K, 40, 3 * 256, seed=m))
    x = _x(m, 3 * 256, seed=m + 20)
    got = int8_gemv.int8_gemv(x.astype(jnp.float32), q4_k_chunks(w), cfg, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(int8_gemv.int8_gemv(
        x.astype(jnp.float32), w, cfg, interpret=True)))
    assert _rel(got, _oracle(dequantize_x(quantize_x(x)), w)) < ROUNDED_TOL


@pytest.mark.parametrize("split", [1, 3])
def test_int8_gemv_partials(split):
    """partials=True hands over the split-K partial sums, in float32, unsummed."""
    w = jax.tree.map(jnp.asarray, random_qtensor(QType.Q8_0, 40, 9 * 32, seed=4))
    x = _x(2, 9 * 32, seed=5)
    cfg = Int8GemvConfig(16, 2, split_k=split)
    parts = int8_gemv.int8_gemv(x, w, cfg, interpret=True, partials=True)
    assert parts.shape == (split, 2, 40) and parts.dtype == jnp.float32
    assert _rel(parts.sum(0), _oracle(dequantize_x(quantize_x(x)), w)) < ROUNDED_TOL


def test_quantize_x_round_trip_and_zero_rows():
    x = _x(3, 96, seed=1, dtype=jnp.float32).at[1].set(0.0)
    xq = quantize_x(x)
    back = np.asarray(dequantize_x(xq))
    assert np.all(np.isfinite(back)) and np.all(back[1] == 0)
    # Rounding error at most half a step (d/2) per value.
    d = np.repeat(np.asarray(xq.d), 32, axis=1)
    assert np.all(np.abs(back - np.asarray(x)) <= 0.5 * d + 1e-7)
    q = np.asarray(jax.lax.bitcast_convert_type(xq.words, jnp.int8)).reshape(3, 96).astype(np.int64)
    np.testing.assert_allclose(np.asarray(xq.dsum16), np.asarray(xq.d).repeat(2, 1) * q.reshape(3, 6, 16).sum(-1),
                               rtol=1e-6)


def test_dp4a_interpreted_arithmetic():
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(-2**31, 2**31, 64, dtype=np.int64).astype(np.int32) for _ in range(3))
    got = np.asarray(dp4a(jnp.asarray(a), jnp.asarray(b), jnp.asarray(c), True))
    la, lb = a.view(np.int8).reshape(64, 4).astype(np.int64), b.view(np.int8).reshape(64, 4).astype(np.int64)
    want = ((la * lb).sum(1) + c) % 2**32
    np.testing.assert_array_equal(got.astype(np.int64) % 2**32, want)


def test_dispatch_uses_int8_for_large_half_precision_decode():
    big = (4096, 4096)
    assert gemv.uses_int8(QType.Q4_K, 1, *big, jnp.bfloat16)
    assert not gemv.uses_int8(QType.Q4_K, 1, *big, jnp.float32)       # f32 keeps the exact kernel
    assert gemv.uses_int8(QType.Q4_K, 4, *big, jnp.bfloat16)
    assert not gemv.uses_int8(QType.Q4_K, 8, *big, jnp.bfloat16)      # tensor cores win from M=8
    assert gemv.uses_int8(QType.Q8_0, 4, *big, jnp.bfloat16)
    assert not gemv.uses_int8(QType.Q8_0, 8, *big, jnp.bfloat16)
    assert not gemv.uses_int8(QType.Q6_K, 1, *big, jnp.bfloat16)
    assert gemv.uses_int8(QType.Q6_K, 1, 128256, 2048, jnp.bfloat16)  # output layers only
    assert not gemv.uses_int8(QType.Q6_K, 2, 128256, 2048, jnp.bfloat16)
    assert gemv.reads_words(QType.Q6_K, 128256, 2048) and not gemv.reads_words(QType.Q6_K, *big)
    # Q8_0 as words where the wgmma kernel takes M > 4 (its float kernel reads bytes faster)
    assert gemv.reads_words(QType.Q8_0, 4096, 4096) and gemv.reads_words(QType.Q8_0, 2048, 2048)
    assert not gemv.reads_words(QType.Q8_0, 49152, 576)       # smollm2's LM head: K % 256
    assert not gemv.reads_words(QType.Q4_1, *big)
    assert not gemv.uses_int8(QType.Q4_1, 1, 576, 576, jnp.bfloat16)
    assert gemv.uses_int8(QType.Q4_K, 1, 576, 576, jnp.bfloat16)      # no XLA fusions before it: all sizes
    # Rounding raw x per program is for 1-2 rows and, but for Q4_K, products below 2**25
    # values; more rows or larger products get x rounded before (and small products then
    # stay on floats).
    assert gemv.rounds_x_itself(QType.Q8_0, 1, 4096, 4096)
    assert not gemv.rounds_x_itself(QType.Q8_0, 1, 28672, 4096)
    assert not gemv.rounds_x_itself(QType.Q4_K, 1, 4096, 4096)
    assert not gemv.rounds_x_itself(QType.Q8_0, 3, 4096, 4096)
    assert gemv.uses_int8(QType.Q8_0, 1, 2048, 2048, jnp.bfloat16)
    assert not gemv.uses_int8(QType.Q8_0, 8, 2048, 2048, jnp.bfloat16)
    cfg = gemv.default_int8_config(QType.Q4_K, 1, 1024, 4096)
    assert cfg.split_k > 1   # 64 row tiles alone would leave most SMs idle


def test_qmatmul_routes_to_int8_kernel():
    """With the size threshold lowered, the public entry takes the int8 kernel for bf16 decode."""
    w = jax.tree.map(jnp.asarray, random_qtensor(QType.Q8_0, 24, 128, seed=5))
    x = _x(1, 128, seed=6)
    tuning = gemv.TUNING.replace(int8_min_values={QType.Q8_0: 0})
    out = qmatmul(x, w, implementation="interpret", tuning=tuning)
    want = int8_gemv.int8_gemv(x, w, gemv.default_int8_config(QType.Q8_0, 1, 24, 128), interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


@pytest.mark.parametrize("qtype,chunks", [(t, False) for t in TYPES] + [(QType.Q4_K, True)],
                         ids=lambda v: v.name if isinstance(v, QType) else ("chunks" if v else "file"))
def test_int8_gemv_lowers_to_triton_for_h100(qtype, chunks):
    """The production tiles lower to a Triton module with the dp4a PTX, without a GPU."""
    from jax._src.pallas.triton import gpu_info

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    n, k = 4096, 4096
    w = random_qtensor(qtype, 1, k)
    w = q4_k_chunks(jax.tree.map(jnp.asarray, w)) if chunks else w
    w = type(w)(jax.tree.map(lambda a: jax.ShapeDtypeStruct((n,) + a.shape[1:], a.dtype), w.planes), qtype, (n, k))
    cfg = gemv.default_int8_config(qtype, 1, n, k) if qtype in gemv.INT8_TILES else Int8GemvConfig(32, 2)
    x = jax.ShapeDtypeStruct((1, k), jnp.bfloat16)
    with warnings.catch_warnings(), mock.patch.object(gpu_info, "get_gpu_info", lambda: h100):
        warnings.simplefilter("ignore")
        lowered = jax.jit(int8_gemv.int8_gemv, static_argnames=("cfg", "interpret")).trace(
            x, w, cfg).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()
