"""The float kernel's bf16x2 dequantization of Q4_K (tiles.py: packed bf16 instructions as
inline PTX on the GPU, the same arithmetic in jnp in the interpreter), on CPU: the interpreter
against gguf-py's dequantizer, the arithmetic against numpy bit for bit, the dispatch, the
errors, and the sm_90 lowering. tests/kernels/test_quant_matmul.py runs the PTX."""
from __future__ import annotations

import unittest.mock as mock
import warnings

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from pallas_kernels.quant_matmul import gemv, qmatmul
from pallas_kernels.quant_matmul.kernel import TileConfig, fused_qmatmul
from pallas_kernels.quant_matmul.testing import random_qtensor, raw_bytes
from pallas_kernels.quant_matmul.tiles import nibbles_bf16
from rjax.math.layout import gpu_weight_layout
from gguf_blocks.reference import q4_k_chunks
from gguf_blocks.words import as_words

BF16_TOL = 1e-2


def _oracle(x, w):
    wd = gguf.quants.dequantize(raw_bytes(w), w.qtype).reshape(w.shape).astype(np.float64)
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64) @ wd.T


def _rel(out, ref):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert np.all(np.isfinite(out))
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _x(m, k, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k)), jnp.bfloat16)


def test_nibbles_bf16_is_one_rounding_of_the_exact_value():
    """Every byte, scales and biases of both signs: bf16(nibble * s + b) with s and b bf16."""
    rng = np.random.default_rng(0)
    q = np.arange(256, dtype=np.uint8).reshape(8, 32)
    s, b = (jnp.asarray(rng.standard_normal((8, 1)) * 0.05, jnp.bfloat16) for _ in range(2))
    lo, hi = nibbles_bf16(jnp.asarray(q), s, b, -s, b, interpret=True)
    s64, b64 = (np.asarray(v.astype(jnp.float32), np.float64) for v in (s, b))
    want_lo = (q & 15) * s64 + b64
    want_hi = (q >> 4) * -s64 + b64
    np.testing.assert_array_equal(np.asarray(lo), np.asarray(jnp.asarray(want_lo, jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(hi), np.asarray(jnp.asarray(want_hi, jnp.bfloat16)))


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q4_0, QType.Q4_1], ids=lambda t: t.name)
@pytest.mark.parametrize("bm,bn,bk,split,m,n,nb", [(16, 32, 1, 1, 16, 64, 2), (16, 32, 2, 3, 7, 72, 7),
                                                  (32, 64, 1, 2, 20, 40, 3), (64, 16, 4, 1, 64, 16, 4)])
def test_fused_kernel_bf16x2(qtype, bm, bn, bk, split, m, n, nb):
    """Edge tiles (rows, blocks and x rows past them, split K, an empty split), quant planes
    as bytes and as words (Q4_K: both in the GPU layout, Q4_KChunks)."""
    k = nb * gguf.GGML_QUANT_SIZES[qtype][0]
    w = random_qtensor(qtype, n, k, seed=n + nb)
    x = _x(m, k, seed=m)
    ref = _oracle(x, w)
    dev = jax.tree.map(jnp.asarray, w)
    cfg = TileConfig(bm, bn, bk, split_k=split, dequant="bf16x2")
    for layout in ((q4_k_chunks(dev), gpu_weight_layout(dev)) if qtype == QType.Q4_K else (dev, as_words(dev))):
        out = fused_qmatmul(x, layout, cfg, interpret=True)
        assert out.shape == (m, n) and out.dtype == jnp.bfloat16
        assert _rel(out, ref) < BF16_TOL


def test_dispatch_takes_bf16x2_for_q4_k_in_the_gpu_layout():
    w = random_qtensor(QType.Q4_K, 64, 512, seed=1)
    gpu_w = gpu_weight_layout(jax.tree.map(jnp.asarray, w))
    cfg = gemv.bf16x2_config(gpu_w, 16, jnp.bfloat16)
    assert cfg is not None and cfg.dequant == "bf16x2" and cfg.method == "mma"
    assert gemv.bf16x2_config(gpu_w, 16, jnp.float32) is None            # f32 x keeps the exact path
    assert gemv.bf16x2_config(jax.tree.map(jnp.asarray, w), 16, jnp.bfloat16) is None   # the file's layout
    assert gemv.bf16x2_config(random_qtensor(QType.Q8_0, 64, 512), 16, jnp.bfloat16) is None
    assert gemv.bf16x2_config(random_qtensor(QType.Q4_1, 64, 512), 8, jnp.bfloat16).dequant == "bf16x2"
    assert gemv.bf16x2_config(random_qtensor(QType.Q4_1, 64, 512), 1, jnp.bfloat16) is None  # CUDA-core tiles
    assert gemv.bf16x2_config(gpu_w, 16, jnp.bfloat16, gemv.TUNING.replace(bf16x2_max_m=0)) is None
    x = _x(16, 512, seed=2)
    assert _rel(qmatmul(x, gpu_w, implementation="interpret"), _oracle(x, w)) < BF16_TOL


def test_bf16x2_errors():
    w = random_qtensor(QType.Q4_K, 32, 256)
    chunks = q4_k_chunks(jax.tree.map(jnp.asarray, w))
    cfg = TileConfig(16, 32, 1, dequant="bf16x2")
    with pytest.raises(NotImplementedError, match="Q4_K in the GPU layout"):
        fused_qmatmul(_x(16, 256, 0), jax.tree.map(jnp.asarray, w), cfg, interpret=True)
    with pytest.raises(NotImplementedError, match="Q8_0"):
        fused_qmatmul(_x(16, 256, 0), random_qtensor(QType.Q8_0, 32, 256), cfg, interpret=True)
    with pytest.raises(ValueError, match="plain bf16 x"):
        fused_qmatmul(jnp.ones((16, 256), jnp.float32), chunks, cfg, interpret=True)
    with pytest.raises(ValueError, match="dequant"):
        TileConfig(1, 32, 1, method="fma", dequant="bf16x2")
    with pytest.raises(ValueError, match="dequant"):
        TileConfig(16, 32, 1, dequant="f16")


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q4_0, QType.Q4_1], ids=lambda t: t.name)
def test_bf16x2_lowers_to_triton_for_h100(qtype):
    """The inline PTX and the two dots per step lower to a Triton module for sm_90."""
    from jax._src.pallas.triton import gpu_info

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    w = gpu_weight_layout(jax.tree.map(jnp.asarray, random_qtensor(qtype, 256, 1024, seed=1)))
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), w)
    for m in (16, 64):
        cfg = gemv.bf16x2_config(w, m, jnp.bfloat16)
        with warnings.catch_warnings(), mock.patch.object(gpu_info, "get_gpu_info", lambda: h100):
            warnings.simplefilter("ignore")
            lowered = jax.jit(fused_qmatmul, static_argnames=("cfg",)).trace(
                jax.ShapeDtypeStruct((m, 1024), jnp.bfloat16), shapes, cfg).lower(lowering_platforms=("cuda",))
        text = lowered.as_text()
        assert "__gpu$xla.gpu.triton" in text and "fma.rn.bf16x2" in text
