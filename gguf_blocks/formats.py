"""GGUF tensor types and their host layout: dense arrays, or block-quantized "planes".

Every quantized GGML type stores a row of `block_size` values per block, `type_size` bytes
each, laid out as a C struct (ggml-common.h). At load, a tensor's raw bytes
(rows, n_blocks * type_size) are split into one array per struct field, in the struct's
field order and with ggml's field names, each shaped (rows, n_blocks, *field_shape) in the
field's natural dtype (f16 for half scales, uint8 for packed bytes, int8 for signed
quants/scales, uint16 for 16-bit packed fields). Bit packing inside a field is unchanged
from the file and nothing is widened, so plane bytes == file bytes. A tile of output rows
is a plain slice of every plane, which is what the kernels read. `rows` is the product of
all but the last logical dimension (a 2-D weight (out, in) has rows = out).

Planes per type (per block; QK_K = 256):

    type    block  bytes  fields (name dtype shape)
    Q4_0     32     18    d f16 (), qs u8 (16,)
    Q4_1     32     20    d f16 (), m f16 (), qs u8 (16,)
    Q5_0     32     22    d f16 (), qh u8 (4,), qs u8 (16,)
    Q5_1     32     24    d f16 (), m f16 (), qh u8 (4,), qs u8 (16,)
    Q8_0     32     34    d f16 (), qs i8 (32,)
    Q2_K    256     84    scales u8 (16,), qs u8 (64,), d f16 (), dmin f16 ()
    Q3_K    256    110    hmask u8 (32,), qs u8 (64,), scales u8 (12,), d f16 ()
    Q4_K    256    144    d f16 (), dmin f16 (), scales u8 (12,), qs u8 (128,)
    Q5_K    256    176    d f16 (), dmin f16 (), scales u8 (12,), qh u8 (32,), qs u8 (128,)
    Q6_K    256    210    ql u8 (128,), qh u8 (64,), scales i8 (16,), d f16 ()
    IQ4_NL   32     18    d f16 (), qs u8 (16,)
    IQ4_XS  256    136    d f16 (), scales_h u16 (), scales_l u8 (4,), qs u8 (128,)

Packing inside fields (as in ggml; `reference.py` decodes each):
- 32-blocks, 4-bit `qs`: byte j holds value j (low nibble) and value j+16 (high nibble).
  Q5_x `qh`: bit j of the little-endian 32-bit word is the 5th bit of value j.
- K-quants' `qs` hold 4-bit quants for 64 values per 32 bytes (low nibbles: the first 32,
  high nibbles: the next 32); 2-bit quants (Q2_K/Q3_K `qs`, Q6_K `qh`) hold 128 values per
  32 bytes at shifts 0, 2, 4, 6. Q4_K/Q5_K `scales` pack eight 6-bit scales and eight 6-bit
  mins in 12 bytes; Q3_K `scales` pack sixteen 6-bit scales (offset by 32) in 12 bytes.
- IQ4_NL/IQ4_XS quants index the 16-entry non-linear table `IQ4_NL_VALUES`.

Dense types (F32, F16, BF16) stay plain arrays of the logical shape ((out, in) for weights);
BF16 is viewed as `ml_dtypes.bfloat16` (== jnp.bfloat16), so nothing is converted.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from gguf_blocks.qtensor import QTensor

QK_K = 256

# The IQ4_NL / IQ4_XS codebook (ggml's kvalues_iq4nl).
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


class Q4_0(NamedTuple):
    d: np.ndarray   # (rows, nb) f16
    qs: np.ndarray  # (rows, nb, 16) uint8: byte j = value j (low nibble), value j+16 (high)


class Q4_1(NamedTuple):
    d: np.ndarray   # (rows, nb) f16
    m: np.ndarray   # (rows, nb) f16
    qs: np.ndarray  # (rows, nb, 16) uint8, as Q4_0


class Q5_0(NamedTuple):
    d: np.ndarray   # (rows, nb) f16
    qh: np.ndarray  # (rows, nb, 4) uint8: bit j of the LE u32 = bit 4 of value j
    qs: np.ndarray  # (rows, nb, 16) uint8: low 4 bits, as Q4_0


class Q5_1(NamedTuple):
    d: np.ndarray   # (rows, nb) f16
    m: np.ndarray   # (rows, nb) f16
    qh: np.ndarray  # (rows, nb, 4) uint8, as Q5_0
    qs: np.ndarray  # (rows, nb, 16) uint8, as Q5_0


class Q8_0(NamedTuple):
    d: np.ndarray   # (rows, nb) f16
    qs: np.ndarray  # (rows, nb, 32) int8


class Q2_K(NamedTuple):
    scales: np.ndarray  # (rows, nb, 16) uint8: low nibble scale, high nibble min
    qs: np.ndarray      # (rows, nb, 64) uint8: 2-bit quants
    d: np.ndarray       # (rows, nb) f16
    dmin: np.ndarray    # (rows, nb) f16


class Q3_K(NamedTuple):
    hmask: np.ndarray   # (rows, nb, 32) uint8: high bit of each quant (set = no -4 offset)
    qs: np.ndarray      # (rows, nb, 64) uint8: low 2 bits
    scales: np.ndarray  # (rows, nb, 12) uint8: sixteen 6-bit scales
    d: np.ndarray       # (rows, nb) f16


class Q4_K(NamedTuple):
    d: np.ndarray       # (rows, nb) f16
    dmin: np.ndarray    # (rows, nb) f16
    scales: np.ndarray  # (rows, nb, 12) uint8: eight 6-bit scales + eight 6-bit mins
    qs: np.ndarray      # (rows, nb, 128) uint8: 4-bit quants


class Q4_KChunks(NamedTuple):
    """Q4_K with its twelve packed scale bytes re-encoded per 32-byte quant chunk: the GPU
    layout (`q4_k_chunks`). Chunk c of a super-block holds sub-block 2c in its low nibbles and
    2c+1 in its high nibbles, and word c of `chunk_scales` has their 6-bit scales and mins as
    little-endian bytes [sc(2c), sc(2c+1), mn(2c), mn(2c+1)]. A decode kernel then reads one
    word per chunk instead of unpacking three; 148 bytes per 256 values instead of 144."""
    d: np.ndarray             # (rows, nb) f16
    dmin: np.ndarray          # (rows, nb) f16
    chunk_scales: np.ndarray  # (rows, nb, 4) int32
    qs: np.ndarray            # (rows, nb, 128) uint8, as Q4_K


class Q5_K(NamedTuple):
    d: np.ndarray       # (rows, nb) f16
    dmin: np.ndarray    # (rows, nb) f16
    scales: np.ndarray  # (rows, nb, 12) uint8, as Q4_K
    qh: np.ndarray      # (rows, nb, 32) uint8: 5th bit of each quant
    qs: np.ndarray      # (rows, nb, 128) uint8: low 4 bits, as Q4_K


class Q6_K(NamedTuple):
    ql: np.ndarray      # (rows, nb, 128) uint8: low 4 bits
    qh: np.ndarray      # (rows, nb, 64) uint8: high 2 bits
    scales: np.ndarray  # (rows, nb, 16) int8
    d: np.ndarray       # (rows, nb) f16


class IQ4_NL(NamedTuple):
    d: np.ndarray   # (rows, nb) f16
    qs: np.ndarray  # (rows, nb, 16) uint8: table indices, nibble order as Q4_0


class IQ4_XS(NamedTuple):
    d: np.ndarray         # (rows, nb) f16
    scales_h: np.ndarray  # (rows, nb) uint16: high 2 bits of eight 6-bit scales
    scales_l: np.ndarray  # (rows, nb, 4) uint8: low 4 bits of eight 6-bit scales
    qs: np.ndarray        # (rows, nb, 128) uint8: table indices, 16 bytes per 32 values


class Field(NamedTuple):
    name: str
    dtype: type
    shape: tuple[int, ...]  # per block


_F16, _U8, _I8, _U16 = np.float16, np.uint8, np.int8, np.uint16

# (plane type, fields in the byte order of ggml's block struct)
LAYOUTS: dict[QType, tuple[type, tuple[Field, ...]]] = {
    QType.Q4_0: (Q4_0, (Field("d", _F16, ()), Field("qs", _U8, (16,)))),
    QType.Q4_1: (Q4_1, (Field("d", _F16, ()), Field("m", _F16, ()), Field("qs", _U8, (16,)))),
    QType.Q5_0: (Q5_0, (Field("d", _F16, ()), Field("qh", _U8, (4,)), Field("qs", _U8, (16,)))),
    QType.Q5_1: (Q5_1, (Field("d", _F16, ()), Field("m", _F16, ()), Field("qh", _U8, (4,)),
                        Field("qs", _U8, (16,)))),
    QType.Q8_0: (Q8_0, (Field("d", _F16, ()), Field("qs", _I8, (32,)))),
    QType.Q2_K: (Q2_K, (Field("scales", _U8, (16,)), Field("qs", _U8, (64,)), Field("d", _F16, ()),
                        Field("dmin", _F16, ()))),
    QType.Q3_K: (Q3_K, (Field("hmask", _U8, (32,)), Field("qs", _U8, (64,)), Field("scales", _U8, (12,)),
                        Field("d", _F16, ()))),
    QType.Q4_K: (Q4_K, (Field("d", _F16, ()), Field("dmin", _F16, ()), Field("scales", _U8, (12,)),
                        Field("qs", _U8, (128,)))),
    QType.Q5_K: (Q5_K, (Field("d", _F16, ()), Field("dmin", _F16, ()), Field("scales", _U8, (12,)),
                        Field("qh", _U8, (32,)), Field("qs", _U8, (128,)))),
    QType.Q6_K: (Q6_K, (Field("ql", _U8, (128,)), Field("qh", _U8, (64,)), Field("scales", _I8, (16,)),
                        Field("d", _F16, ()))),
    QType.IQ4_NL: (IQ4_NL, (Field("d", _F16, ()), Field("qs", _U8, (16,)))),
    QType.IQ4_XS: (IQ4_XS, (Field("d", _F16, ()), Field("scales_h", _U16, ()), Field("scales_l", _U8, (4,)),
                            Field("qs", _U8, (128,)))),
}

# Dense types: numpy dtype of the array handed to the model.
DENSE_TYPES: dict[QType, type] = {QType.F32: np.float32, QType.F16: np.float16, QType.BF16: ml_dtypes.bfloat16}

SUPPORTED_TYPES: frozenset[QType] = frozenset(DENSE_TYPES) | frozenset(LAYOUTS)


def supported_types() -> list[str]:
    """Names of the GGML types `to_host_weight` accepts, sorted by type id."""
    return [t.name for t in sorted(SUPPORTED_TYPES)]


class TensorFormatError(ValueError):
    """A GGUF tensor whose type, shape or byte size cannot be loaded."""


def _check_layouts() -> None:
    for qtype, (cls, fields) in LAYOUTS.items():
        assert cls._fields == tuple(f.name for f in fields), qtype
        nbytes = sum(np.dtype(f.dtype).itemsize * math.prod(f.shape) for f in fields)
        assert nbytes == GGML_QUANT_SIZES[qtype][1], (qtype, nbytes)


_check_layouts()


def resolve_type(qtype: QType | int | str, name: str = "<tensor>") -> QType:
    """A GGML type id/name -> QType, with an error naming the tensor if it is unknown or unsupported."""
    try:
        t = QType[qtype] if isinstance(qtype, str) else QType(int(qtype))
    except (KeyError, ValueError):
        raise TensorFormatError(
            f"tensor {name!r}: unknown GGML type {qtype!r}; supported types: {', '.join(supported_types())}"
        ) from None
    if t not in SUPPORTED_TYPES:
        raise TensorFormatError(
            f"tensor {name!r}: GGML type {t.name} (id {int(t)}) is not supported; "
            f"supported types: {', '.join(supported_types())}"
        )
    return t


def tensor_nbytes(qtype: QType, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of logical `shape` occupies in the file (and as planes)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block_size * type_size


def plane_views(qtype: QType, raw: np.ndarray):
    """Raw block bytes (rows, n_blocks * type_size) uint8 -> the type's planes as strided views
    of `raw` (no copy): what a check of the values reads without moving the bytes."""
    cls, fields = LAYOUTS[qtype]
    type_size = GGML_QUANT_SIZES[qtype][1]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, type_size)
    out, off = [], 0
    for f in fields:
        n = np.dtype(f.dtype).itemsize * math.prod(f.shape)
        out.append(blocks[:, :, off:off + n].view(f.dtype).reshape(rows, blocks.shape[1], *f.shape))
        off += n
    return cls(*out)


def split_planes(qtype: QType, raw: np.ndarray):
    """Raw block bytes (rows, n_blocks * type_size) uint8 -> the type's planes (numpy, copies)."""
    views = plane_views(qtype, raw)
    return type(views)(*(np.ascontiguousarray(v) for v in views))


def planes_from_bytes(qtype: QType, raw):
    """`split_planes` for a JAX array (a traced one too): the block bytes moved to a device in
    one piece and split into planes there. -> the same planes, as JAX arrays."""
    cls, fields = LAYOUTS[qtype]
    type_size = GGML_QUANT_SIZES[qtype][1]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, type_size)
    out, off = [], 0
    for f in fields:
        size = np.dtype(f.dtype).itemsize
        n = size * math.prod(f.shape)
        field = blocks[:, :, off:off + n]
        if size > 1:
            field = field.reshape(rows, blocks.shape[1], n // size, size)
        if np.dtype(f.dtype) != np.uint8:
            field = jax.lax.bitcast_convert_type(field, f.dtype)
        out.append(field.reshape(rows, blocks.shape[1], *f.shape))
        off += n
    return cls(*out)


def join_planes(qtype: QType, planes) -> np.ndarray:
    """Inverse of `split_planes`: planes -> raw block bytes (rows, n_blocks * type_size) uint8."""
    _, fields = LAYOUTS[qtype]
    parts = [np.ascontiguousarray(np.asarray(p)) for p in planes]
    rows, nb = parts[0].shape[:2]
    blocks = [p.reshape(rows, nb, -1).view(np.uint8) for p in parts]
    return np.concatenate(blocks, axis=-1).reshape(rows, -1)


def to_host_weight(name: str, qtype: QType | int | str, data: np.ndarray, shape: tuple[int, ...],
                   views: bool = False):
    """One GGUF tensor -> what the model holds: a dense numpy array, or a QTensor of numpy planes.

    `shape` is the logical numpy shape (GGUF's ne reversed, e.g. (out, in)); `data` is
    `gguf.GGUFReader`'s `tensor.data` (typed for F32/F16, uint8 block bytes otherwise; any
    array with the right number of bytes works). Dense results may be views of `data` (e.g.
    of the memory-mapped file); planes are fresh arrays, or with `views` strided views of
    `data` (`plane_views`). Nothing is put on a device.
    """
    t = resolve_type(qtype, name)
    shape = tuple(int(s) for s in shape)
    block_size, type_size = GGML_QUANT_SIZES[t]
    if t in LAYOUTS and (len(shape) == 0 or shape[-1] % block_size):
        raise TensorFormatError(
            f"tensor {name!r} ({t.name}): row length {shape[-1] if shape else None} of shape {shape} "
            f"is not a multiple of the {t.name} block size {block_size}"
        )
    expected = tensor_nbytes(t, shape)
    if data.nbytes != expected:
        raise TensorFormatError(
            f"tensor {name!r} ({t.name}, shape {shape}): expected {expected} bytes, got {data.nbytes}"
        )
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if t in DENSE_TYPES:
        return raw.view(DENSE_TYPES[t]).reshape(shape)
    rows = math.prod(shape[:-1])
    planes = (plane_views if views else split_planes)(t, raw.reshape(rows, shape[-1] // block_size * type_size))
    return QTensor(planes, t, shape)
