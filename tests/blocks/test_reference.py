"""Pure-JAX dequantizers vs gguf-py's numpy dequantizers, bit for bit, on random blocks."""
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as QType

from gguf_blocks import formats, reference
from gguf_blocks.qtensor import QTensor
from rjax.math.ops import matmul, take_rows

QUANT_TYPES = sorted(formats.LAYOUTS)

# f16 scales that stress the arithmetic: zeros of both signs, subnormals, the smallest normal,
# the largest finite values, one.
EXTREME_F16 = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x83FF, 0x0400, 0x8400,
                        0x7BFF, 0xFBFF, 0x3C00, 0xBC00], np.uint16)


def random_blocks(qtype, rows, nb, rng, finite=True):
    """Random block bytes whose f16 fields are random finite halves (or any 16 bits)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, nb, type_size), dtype=np.uint8)
    off = 0
    for f in formats.LAYOUTS[qtype][1]:
        n = np.dtype(f.dtype).itemsize * math.prod(f.shape)
        if f.dtype == np.float16:
            bits = rng.integers(0, 1 << 16, (rows, nb), dtype=np.uint16)
            if finite:  # exponent all-ones (Inf/NaN) -> same mantissa with exponent 0
                bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits).astype(np.uint16)
            flat = bits.reshape(-1)
            flat[: len(EXTREME_F16)] = EXTREME_F16[: len(flat)]
            rng.shuffle(flat)
            raw[:, :, off:off + 2] = bits.view(np.uint8).reshape(rows, nb, 2)
        off += n
    return raw.reshape(rows, nb * type_size)


_dequantize = jax.jit(reference.dequantize)


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_random_blocks_bit_exact(qtype):
    rng = np.random.default_rng(1000 + int(qtype))
    rows, nb = 48, 8
    raw = random_blocks(qtype, rows, nb, rng)
    want = quants.dequantize(raw, qtype)
    qt = formats.to_host_weight("w", qtype, raw, (rows, nb * GGML_QUANT_SIZES[qtype][0]))
    got = np.asarray(_dequantize(jax.device_put(qt)))
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_nonfinite_scales_match_gguf(qtype):
    """Inf/NaN scales: same NaN positions, same bits everywhere else (NaN payloads may differ by platform)."""
    rng = np.random.default_rng(2000 + int(qtype))
    rows, nb = 16, 4
    raw = random_blocks(qtype, rows, nb, rng, finite=False)
    with np.errstate(all="ignore"):
        want = quants.dequantize(raw, qtype)
    got = np.asarray(_dequantize(formats.to_host_weight("w", qtype, raw, (rows, nb * GGML_QUANT_SIZES[qtype][0]))))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))


def test_dense_dequantize_matches_gguf():
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 1 << 16, (8, 16), dtype=np.uint16)
    bf16 = bits.view(ml_dtypes.bfloat16)
    want = quants.dequantize(bits.view(np.uint8), QType.BF16)
    got = np.asarray(jax.jit(reference.dequantize)(bf16))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # incl. NaN payloads

    f16 = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits).astype(np.uint16).view(np.float16)
    want = quants.dequantize(f16, QType.F16)
    got = np.asarray(jax.jit(reference.dequantize)(f16))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_dequantize_blocks_on_a_tile():
    """A tile of rows/blocks of every plane dequantizes to the same tile of the whole."""
    qtype = QType.Q4_K
    rng = np.random.default_rng(4)
    raw = random_blocks(qtype, 8, 4, rng)
    qt = formats.to_host_weight("w", qtype, raw, (8, 4 * 256))
    dq = jax.jit(reference.dequantize_blocks, static_argnums=0)
    full = np.asarray(dq(qtype, qt.planes))
    tile = jax.tree.map(lambda p: p[2:5, 1:3], qt.planes)
    np.testing.assert_array_equal(np.asarray(dq(qtype, tile)), full[2:5, 1:3])


@pytest.mark.parametrize("qtype", [QType.Q5_0, QType.Q3_K, QType.IQ4_XS], ids=lambda t: t.name)
def test_qtensor_matmul_and_take_rows(qtype):
    rng = np.random.default_rng(5)
    block_size = GGML_QUANT_SIZES[qtype][0]
    rows, cols = 6, 2 * 256
    raw = random_blocks(qtype, rows, cols // block_size, rng)
    qt = jax.device_put(formats.to_host_weight("w", qtype, raw, (rows, cols)))
    dense = quants.dequantize(raw, qtype).astype(np.float64)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    want = x @ dense.T
    got = np.asarray(jax.jit(matmul)(jnp.asarray(x), qt))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    ids = np.array([[5, 0], [2, 2]])
    np.testing.assert_array_equal(np.asarray(jax.jit(take_rows)(qt, jnp.asarray(ids))), quants.dequantize(raw, qtype)[ids])
