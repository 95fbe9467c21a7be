"""Quantize on the device: a weight already on the device (dense, or a QTensor of any type) ->
a QTensor of Q8_0 or Q4_0, in jitted JAX.

`gguf_blocks.quantize` is the host path (numpy, gguf-py's quantizers) for checkpoints read from
disk; this one serves weights that are on the device already, e.g. a model's own weights
requantized to fewer bits for a speculative draft: an 8B model's 8 GB of Q8_0 would take
minutes through numpy, and a fraction of a second here. The arithmetic is ggml's reference
quantizers' (float32, as gguf-py's ports compute them), so the planes equal gguf-py's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from gguf_blocks import formats
from gguf_blocks.qtensor import QTensor
from gguf_blocks.reference import dequantize

REQUANTIZE_TYPES = (QType.Q8_0, QType.Q4_0)


def _q8_0(blocks):
    d = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True) / 127
    inv = jnp.where(d == 0, 0, 1 / jnp.where(d == 0, 1, d))
    x = blocks * inv
    a = jnp.abs(x)  # round half away from zero, as ggml's roundf
    fl = jnp.floor(a)
    qs = (jnp.sign(x) * (fl + jnp.floor(2 * (a - fl)))).astype(jnp.int8)
    return formats.Q8_0(d[..., 0].astype(jnp.float16), qs)


def _q4_0(blocks):
    imax = jnp.argmax(jnp.abs(blocks), axis=-1, keepdims=True)
    mx = jnp.take_along_axis(blocks, imax, axis=-1)
    d = mx / -8
    inv = jnp.where(d == 0, 0, 1 / jnp.where(d == 0, 1, d))
    q = jnp.clip(jnp.trunc(blocks * inv + jnp.float32(8.5)), 0, 15).astype(jnp.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)   # byte j: value j low, value j + 16 high
    return formats.Q4_0(d[..., 0].astype(jnp.float16), qs)


_QUANTIZERS = {QType.Q8_0: _q8_0, QType.Q4_0: _q4_0}


@functools.partial(jax.jit, static_argnames=("qtype",))
def _requantize(w, qtype: QType) -> QTensor:
    x = dequantize(w)
    rows, cols = x.shape
    block = GGML_QUANT_SIZES[qtype][0]
    planes = _QUANTIZERS[qtype](x.reshape(rows, cols // block, block))
    return QTensor(planes, qtype, (rows, cols))


def requantize(w, qtype: QType | str, name: str = "<weight>"):
    """A 2-D weight (dense array, or QTensor in the file's layout) -> a QTensor of `qtype`
    (Q8_0 or Q4_0) with the same logical shape. Anything else (norms, biases, a matrix whose
    rows are not whole blocks) is returned unchanged."""
    t = formats.resolve_type(qtype.upper() if isinstance(qtype, str) else qtype, name)
    if t not in REQUANTIZE_TYPES:
        raise formats.TensorFormatError(f"weight {name!r}: cannot requantize to {t.name} on the device; "
                                        f"supported: {', '.join(q.name for q in REQUANTIZE_TYPES)}")
    shape = w.shape if isinstance(w, QTensor) else jnp.shape(w)
    if len(shape) != 2 or shape[1] % GGML_QUANT_SIZES[t][0]:
        return w
    if isinstance(w, QTensor) and w.qtype == t:
        return w
    return _requantize(w, t)


def requantize_tree(tree, qtype: QType | str):
    """Every 2-D weight of a params pytree (QTensors in the file's layout, and dense matrices)
    requantized to `qtype`; 1-D leaves (norms, biases) unchanged."""
    return jax.tree.map(lambda w: requantize(w, qtype), tree, is_leaf=lambda x: isinstance(x, QTensor))
