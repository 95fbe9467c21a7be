"""Quant planes as int32 words: the GPU layout of the byte planes the decode kernels read.

A GGUF quant plane is bytes (`formats.LAYOUTS`). The GPU kernels read it four bytes at a time
anyway (a dp4a multiplies four packed values), and when the plane arrives as int32 words
XLA's Triton loads them as 16-byte vectors and keeps a chunk's words in one thread: the Q4_K
int8 GEMV ran 24% faster on words than on bytes assembled in the kernel (H100, notes). So a
GPU model's quant planes are viewed as words once, at load (`as_words`): the same bits, no
copy on the host. Readers that want bytes get them back with `as_bytes` (XLA code: fused
into the reader) or, inside a kernel, `pallas_kernels.quant_matmul.tiles.bytes_of_words`.

A plane is in words when its dtype is int32 while the format declares one-byte values.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as QType

from gguf_blocks.formats import LAYOUTS, Q4_KChunks
from gguf_blocks.qtensor import QTensor

# The planes a kernel reads as packed 4-byte groups (Q4_K's packed scales are 12 bytes: 3 words;
# Q6_K's 16 int8 scales 4 words, one load each instead of one per byte).
WORD_FIELDS = {QType.Q8_0: ("qs",), QType.Q4_0: ("qs",), QType.Q4_1: ("qs",),
               QType.Q4_K: ("scales", "qs"), QType.Q6_K: ("ql", "qh", "scales")}


def _fields(w: QTensor) -> tuple[str, ...]:
    if isinstance(w.planes, Q4_KChunks):
        return ("qs",)
    return WORD_FIELDS.get(w.qtype, ())


def _byte_dtype(qtype: QType, field: str):
    cls, fields = LAYOUTS[qtype]
    return np.dtype(fields[cls._fields.index(field)].dtype)


def as_words(w):
    """w with its packed quant planes viewed as int32 words (..., n // 4); anything without
    such planes, or already in words, as is."""
    if not isinstance(w, QTensor):
        return w
    planes = {}
    for f in _fields(w):
        p = getattr(w.planes, f)
        if p.dtype != jnp.int32:
            if p.shape[-1] % 4:
                raise ValueError(f"as_words: {w.qtype.name} plane {f} of shape {p.shape} is not whole words")
            planes[f] = jax.lax.bitcast_convert_type(jnp.asarray(p).reshape(*p.shape[:-1], -1, 4), jnp.int32)
    return QTensor(w.planes._replace(**planes), w.qtype, w.shape) if planes else w


def as_bytes(qtype: QType, planes):
    """planes with every word plane viewed back as its declared bytes (..., 4n)."""
    out = {}
    for f in WORD_FIELDS.get(qtype, ()):
        p = getattr(planes, f, None)
        if p is not None and p.dtype == jnp.int32:
            b = jax.lax.bitcast_convert_type(jnp.asarray(p), _byte_dtype(qtype, f))
            out[f] = b.reshape(*p.shape[:-1], 4 * p.shape[-1])
    return planes._replace(**out) if out else planes
