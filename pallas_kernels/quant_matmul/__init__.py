"""Quantized matmul over GGUF planes: fused Pallas kernels with a pure-JAX reference.

    qmatmul(x, w, *, implementation=None) -> x @ dequantize(w).T    x: (..., K), w: QTensor (N, K)
    supports(qtype) -> bool                                        a fused kernel exists

`implementation`: None picks the kernels on a GPU backend for supported types (the decode
GEMV for M <= 64 rows, the prefill GEMM above) and the reference elsewhere; "reference",
"pallas" (the kernels, compiled) and "interpret" (the kernels in Pallas' CPU interpreter)
force one. The result has x's dtype; accumulation is float32.
"""
from __future__ import annotations

import jax
from gguf import GGMLQuantizationType as QType

from pallas_kernels.quant_matmul.gemm import qmatmul_gemm
from pallas_kernels.quant_matmul.gemv import MAX_M, qmatmul_gemv
from pallas_kernels.quant_matmul.reference import qmatmul_reference
from pallas_kernels.quant_matmul.tiles import FORMATS
from rjax.quant.qtensor import QTensor

IMPLEMENTATIONS = ("reference", "pallas", "interpret")


def supports(qtype: QType) -> bool:
    """Whether the fused kernels handle this GGML type."""
    return qtype in FORMATS


def qmatmul(x: jax.Array, w: QTensor, *, implementation: str | None = None) -> jax.Array:
    """x (..., K) @ dequantize(w).T with w of logical shape (N, K) -> (..., N) in x.dtype."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"qmatmul: x of shape {x.shape} does not match weight {w.qtype.name} of shape {w.shape}")
    if implementation is None:
        on_gpu = jax.default_backend() == "gpu"
        implementation = "pallas" if on_gpu and supports(w.qtype) else "reference"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"qmatmul: implementation={implementation!r}; expected None or one of {IMPLEMENTATIONS}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if implementation == "reference" or x2.shape[0] == 0:
        out = qmatmul_reference(x2, w)
    elif not supports(w.qtype):
        raise NotImplementedError(
            f"qmatmul: no fused kernel for {w.qtype.name}; supported: {', '.join(t.name for t in FORMATS)}")
    else:
        interpret = implementation == "interpret"
        if x2.shape[0] <= MAX_M:
            out = qmatmul_gemv(x2, w, interpret=interpret)
        else:
            # The interpreter always runs the fused kernel, so CPU tests cover its code.
            out = qmatmul_gemm(x2, w, path="fused" if interpret else None, interpret=interpret)
    return out.reshape(*lead, n)
