"""GGUF block formats and their repacked device layout ("planes").

Every quantized type stores a weight row as consecutive blocks of `block_size` values. At
load, the raw (rows, n_blocks * type_size) bytes are split into one array per block field,
each shaped (rows, n_blocks, *field_shape), so a kernel reads quants and scales as separate
contiguous arrays and a tile of output rows is a slice of each plane. Field order and bit
packing inside a field are those of the file (ggml's block structs); nothing is widened, so
device bytes equal file bytes.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType


class Q8_0(NamedTuple):
    d: np.ndarray   # (rows, nb) f16
    qs: np.ndarray  # (rows, nb, 32) int8


class Q4_0(NamedTuple):
    d: np.ndarray   # (rows, nb) f16
    qs: np.ndarray  # (rows, nb, 16) uint8: byte j = value j (low nibble), value j+16 (high)


class Q4_1(NamedTuple):
    d: np.ndarray   # (rows, nb) f16
    m: np.ndarray   # (rows, nb) f16
    qs: np.ndarray  # (rows, nb, 16) uint8, as Q4_0


# (plane type, [(field name, numpy dtype, per-block field shape)]) in byte order of the block.
LAYOUTS: dict[QType, tuple[type, list[tuple[str, np.dtype, tuple[int, ...]]]]] = {
    QType.Q8_0: (Q8_0, [("d", np.float16, ()), ("qs", np.int8, (32,))]),
    QType.Q4_0: (Q4_0, [("d", np.float16, ()), ("qs", np.uint8, (16,))]),
    QType.Q4_1: (Q4_1, [("d", np.float16, ()), ("m", np.float16, ()), ("qs", np.uint8, (16,))]),
}

DENSE_TYPES = {QType.F32: np.float32, QType.F16: np.float16}


def supported_types() -> list[str]:
    return sorted([t.name for t in DENSE_TYPES] + [t.name for t in LAYOUTS])


def split_planes(qtype: QType, raw: np.ndarray):
    """Raw block bytes (rows, n_blocks * type_size) uint8 -> the type's planes (numpy)."""
    cls, fields = LAYOUTS[qtype]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, type_size)
    out, off = [], 0
    for _, dtype, shape in fields:
        n = int(np.dtype(dtype).itemsize * np.prod(shape, dtype=np.int64))
        field = np.ascontiguousarray(blocks[:, :, off:off + n]).view(dtype)
        out.append(field.reshape(rows, blocks.shape[1], *shape))
        off += n
    assert off == type_size, (qtype, off, type_size)
    return cls(*out)
