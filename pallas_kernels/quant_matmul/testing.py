"""Random quantized weights for tests and benchmarks: valid blocks of every bit pattern.

Quant bytes, packed scales and high bits are uniform random bytes (every byte is a valid
encoding), and f16 scales are random with random sign, sized per type so that dequantized
values are O(1). Planes come from `gguf_blocks.formats.split_planes`, exactly as the loader
makes them.
"""
from __future__ import annotations

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from gguf_blocks import formats
from gguf_blocks.qtensor import QTensor

# Typical |scale * quant| products per type, so values come out O(1).
_F16_SCALE = {QType.Q8_0: 1 / 64, QType.Q4_0: 1 / 8, QType.Q4_1: 1 / 8, QType.Q5_0: 1 / 16,
              QType.Q4_K: 1 / 256, QType.Q6_K: 1 / 1024}


def random_blocks(qtype: QType, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw block bytes (rows, k // block_size * type_size) uint8 of random valid blocks."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if k % block_size:
        raise ValueError(f"{qtype.name}: K={k} is not a multiple of the block size {block_size}")
    _, fields = formats.LAYOUTS[qtype]
    nb = k // block_size
    parts = []
    for f in fields:
        shape = (rows, nb, int(np.prod(f.shape, dtype=np.int64)))
        if np.dtype(f.dtype) == np.float16:
            mag = rng.uniform(0.5, 1.0, shape) * _F16_SCALE.get(qtype, 1 / 64)
            v = (mag * rng.choice([-1.0, 1.0], shape)).astype(np.float16)
            parts.append(v.view(np.uint8))
        else:
            nbytes = shape[2] * np.dtype(f.dtype).itemsize
            parts.append(rng.integers(0, 256, (rows, nb, nbytes), dtype=np.uint8))
    raw = np.concatenate(parts, axis=-1)
    assert raw.shape[-1] == type_size
    return raw.reshape(rows, nb * type_size)


def random_qtensor(qtype: QType, n: int, k: int, seed: int = 0) -> QTensor:
    """A QTensor of logical shape (n, k) with numpy planes of random valid blocks."""
    rng = np.random.default_rng(seed)
    raw = random_blocks(qtype, n, k, rng)
    return QTensor(formats.split_planes(qtype, raw), qtype, (n, k))


def quantized_qtensor(qtype: QType, w: np.ndarray) -> QTensor:
    """Quantize a dense (n, k) float weight with gguf-py (types it can quantize) -> QTensor."""
    raw = gguf.quants.quantize(np.asarray(w, np.float32), qtype)
    return QTensor(formats.split_planes(qtype, raw.reshape(w.shape[0], -1)), qtype, tuple(w.shape))


def raw_bytes(w: QTensor) -> np.ndarray:
    """The QTensor's blocks as the file's bytes (rows, n_blocks * type_size): for gguf.quants."""
    return formats.join_planes(w.qtype, [np.asarray(p) for p in w.planes])


def dequantized_product(x, w: QTensor) -> np.ndarray:
    """x (M, K) @ gguf-py's dequantized w, in float64: the oracle of the kernels' tests."""
    wd = gguf.quants.dequantize(raw_bytes(w), w.qtype).reshape(w.shape).astype(np.float64)
    return np.asarray(np.asarray(x, np.float32), np.float64) @ wd.T


def rel_error(out, ref: np.ndarray) -> float:
    """Relative Frobenius error of out against ref; out must be finite."""
    out = np.asarray(np.asarray(out, np.float32), np.float64)
    assert np.all(np.isfinite(out)), "non-finite output"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
