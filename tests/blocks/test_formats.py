"""Planes of every supported GGUF type: layout, byte accounting, and load-time validation."""
import math

import jax
import ml_dtypes
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from gguf_blocks import formats
from gguf_blocks.qtensor import QTensor

QUANT_TYPES = sorted(formats.LAYOUTS)

# The planes the Pallas kernels are written against: these must not change.
AGREED_PLANES = {
    QType.Q8_0: [("d", np.float16, ()), ("qs", np.int8, (32,))],
    QType.Q4_0: [("d", np.float16, ()), ("qs", np.uint8, (16,))],
    QType.Q4_1: [("d", np.float16, ()), ("m", np.float16, ()), ("qs", np.uint8, (16,))],
    QType.Q5_0: [("d", np.float16, ()), ("qh", np.uint8, (4,)), ("qs", np.uint8, (16,))],
    QType.Q4_K: [("d", np.float16, ()), ("dmin", np.float16, ()), ("scales", np.uint8, (12,)),
                 ("qs", np.uint8, (128,))],
    QType.Q6_K: [("ql", np.uint8, (128,)), ("qh", np.uint8, (64,)), ("scales", np.int8, (16,)),
                 ("d", np.float16, ())],
}


def test_supported_types():
    expected = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}
    assert set(formats.supported_types()) == expected
    assert {t.name for t in formats.SUPPORTED_TYPES} == expected


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_layout_sizes_match_ggml(qtype):
    cls, fields = formats.LAYOUTS[qtype]
    assert cls.__name__ == qtype.name
    assert cls._fields == tuple(f.name for f in fields)
    nbytes = sum(np.dtype(f.dtype).itemsize * math.prod(f.shape) for f in fields)
    assert nbytes == GGML_QUANT_SIZES[qtype][1]


@pytest.mark.parametrize("qtype", sorted(AGREED_PLANES), ids=lambda t: t.name)
def test_agreed_kernel_planes_unchanged(qtype):
    rows, nb = 3, 2
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.zeros((rows, nb * type_size), np.uint8)
    qt = formats.to_host_weight("w", qtype, raw, (rows, nb * block_size))
    got = [(name, p.dtype.type, p.shape[2:]) for name, p in zip(qt.planes._fields, qt.planes)]
    assert got == AGREED_PLANES[qtype]
    assert all(p.shape[:2] == (rows, nb) for p in qt.planes)


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_planes_hold_file_bytes(qtype):
    rng = np.random.default_rng(int(qtype))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, nb = 5, 3
    raw = rng.integers(0, 256, (rows, nb * type_size), dtype=np.uint8)
    qt = formats.to_host_weight("w", qtype, raw, (rows, nb * block_size))
    assert isinstance(qt, QTensor) and qt.qtype == qtype and qt.shape == (rows, nb * block_size)
    assert qt.nbytes == raw.nbytes == formats.tensor_nbytes(qtype, qt.shape)
    np.testing.assert_array_equal(formats.join_planes(qtype, qt.planes), raw)
    # each plane is the field's byte range of every block, in struct order
    off = 0
    for f, plane in zip(formats.LAYOUTS[qtype][1], qt.planes):
        n = np.dtype(f.dtype).itemsize * math.prod(f.shape)
        want = raw.reshape(rows, nb, type_size)[:, :, off:off + n]
        np.testing.assert_array_equal(plane.reshape(rows, nb, -1).view(np.uint8), want)
        off += n
    # planes are a pytree that device_put accepts as is
    on_device = jax.device_put(qt)
    assert [np.asarray(p).tobytes() for p in on_device.planes] == [p.tobytes() for p in qt.planes]


def test_n_dimensional_and_1d_quantized_tensors():
    block_size, type_size = GGML_QUANT_SIZES[QType.Q8_0]
    raw = np.arange(2 * 3 * 2 * type_size, dtype=np.uint8)
    qt = formats.to_host_weight("experts", QType.Q8_0, raw, (2, 3, 2 * block_size))
    assert qt.planes.qs.shape == (6, 2, 32)
    vec = formats.to_host_weight("v", QType.Q8_0, raw[:type_size], (block_size,))
    assert vec.planes.qs.shape == (1, 1, 32)


def test_dense_types_from_reader_data():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 6)).astype(np.float32)
    got = formats.to_host_weight("w", QType.F32, w, (4, 6))
    assert got.dtype == np.float32 and got.shape == (4, 6)
    np.testing.assert_array_equal(got, w)

    h = w.astype(np.float16)
    got = formats.to_host_weight("h", QType.F16, h, (4, 6))
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, h)

    # gguf gives BF16 as uint8 (rows, 2 * cols)
    b = w.astype(ml_dtypes.bfloat16)
    got = formats.to_host_weight("b", QType.BF16, b.view(np.uint8).reshape(4, 12), (4, 6))
    assert got.dtype == ml_dtypes.bfloat16 and got.shape == (4, 6)
    np.testing.assert_array_equal(got.view(np.uint16), b.view(np.uint16))

    norm = formats.to_host_weight("norm", 0, w[0], (6,))
    assert norm.shape == (6,) and norm.dtype == np.float32


def test_error_wrong_byte_size_names_tensor_type_and_sizes():
    raw = np.zeros((4, 2 * 144 - 1), np.uint8)
    with pytest.raises(formats.TensorFormatError, match=r"blk\.0\.ffn_up\.weight.*Q4_K.*expected 1152 bytes, got 1148"):
        formats.to_host_weight("blk.0.ffn_up.weight", QType.Q4_K, raw, (4, 512))
    with pytest.raises(formats.TensorFormatError, match=r"'norm'.*F32.*expected 24 bytes, got 20"):
        formats.to_host_weight("norm", QType.F32, np.zeros(5, np.float32), (6,))


def test_error_row_not_multiple_of_block():
    with pytest.raises(formats.TensorFormatError, match=r"'w' \(Q6_K\): row length 100 .*block size 256"):
        formats.to_host_weight("w", QType.Q6_K, np.zeros(100, np.uint8), (2, 100))


def test_error_unknown_type_id_lists_supported():
    with pytest.raises(formats.TensorFormatError, match=r"'w'.*unknown GGML type 99.*supported types: F32, F16, Q4_0"):
        formats.to_host_weight("w", 99, np.zeros(4, np.uint8), (4,))


def test_error_unsupported_type_names_it():
    with pytest.raises(formats.TensorFormatError, match=r"'w'.*IQ2_XXS \(id 16\) is not supported.*Q4_K"):
        formats.to_host_weight("w", QType.IQ2_XXS, np.zeros(66, np.uint8), (256,))
